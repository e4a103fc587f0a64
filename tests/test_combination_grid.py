"""The combination grid (tests/combination_grid.py): the generated rows cover every pair of
settings; every row is a configuration the start-up check accepts and every refused pair one
it refuses, naming why (CI, torchtitan 0.3); and each row, run end to end, equals PP=1 in
its configuration (``bash scripts/test_grid.sh``: 26 torchtitan runs and their references,
about an hour on 2 cores, so not in CI; docs/tests.md says which rows CI's hand-written runs
already hold).

Tolerances: fp32 runs as tests/test_titan.py's (loss 1e-4, grad norm 1e-3; the routed
experts' bf16 GEMMs make it 1e-2, tests/test_titan_models.py). bf16 runs, whose PP=1
reference runs eagerly in bf16: loss 1e-3, a quarter of bf16's relative step (2^-8), which a
wrong segment's attention exceeds 10 to 100 times; grad norm 1e-2 (printed to 4 digits and
summed over differently rounded shards).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from combination_grid import (
    FACTORS,
    REFUSED,
    all_pairs,
    pairs_of,
    processes,
    reference_args,
    reference_key,
    reference_processes,
    refusal_rows,
    row_args,
    rows,
)
from titan_utils import TITAN, Run, assert_same_curve, run_titan, seed_checkpoint

ROWS = rows()
STEPS = 3
#: the long part runs only when asked (scripts/test_grid.sh sets it)
RUN_GRID = os.environ.get("SEQ1F1B_GRID") == "1"


@pytest.mark.fast
def test_the_rows_cover_every_pair_and_no_refused_one() -> None:
    covered = {p for row in ROWS for p in pairs_of(row)}
    assert all_pairs() <= covered, sorted(all_pairs() - covered)[:5]
    assert not covered & set(REFUSED)
    # the two largest factors (6 model families x 5 schedules) need 30 rows at least; the
    # Latin square of the first five families with the schedules and parallelisms (25 rows,
    # less a row per refused pair among those three) and the greedy rows after it take 31
    sizes = sorted(len(v) for v in FACTORS.values())
    assert sizes[-1] * sizes[-2] == 30 <= len(ROWS) <= 31
    assert ROWS == rows()  # generated the same way every time
    assert len(refusal_rows()) == len(REFUSED)
    for row, _ in refusal_rows():
        assert any(p in REFUSED for p in pairs_of(row))


@pytest.mark.fast
def test_every_pair_of_factors_is_in_the_grid() -> None:
    """Each factor's values all occur, and each two factors' values occur together."""
    for a, b in itertools.combinations(list(FACTORS), 2):
        seen = {(row[a], row[b]) for row in ROWS}
        want = {
            (va, vb)
            for va, vb in itertools.product(FACTORS[a], FACTORS[b])
            if ((a, va), (b, vb)) not in REFUSED
        }
        assert want <= seen, (a, b, want - seen)


needs_03 = pytest.mark.skipif(TITAN != "0.3", reason="the grid's runs map onto torchtitan 0.3")


@needs_03
@pytest.mark.default_release_only  # config wiring
def test_every_row_is_accepted_and_every_refused_pair_refused() -> None:
    from titan_utils import CONFIG

    from torchtitan_integration.v03.toml import build_config
    from torchtitan_integration.v03.validate import validate_before_start

    for row in ROWS:
        validate_before_start(build_config(CONFIG, row_args(row)))
    for row, why in refusal_rows():
        with pytest.raises(ValueError, match=why):
            validate_before_start(build_config(CONFIG, row_args(row)))


class _Runs:
    """Each model's seed checkpoint and each reference, run once for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seeds: dict[str, list[str]] = {}
        self.references: dict[tuple[str, str, int, str], Run] = {}

    def seed(self, model: str) -> list[str]:
        if model not in self.seeds:
            from combination_grid import MODELS

            self.seeds[model] = seed_checkpoint(*MODELS[model], dump=self.root / f"seed_{model}")
        return self.seeds[model]

    def reference(self, key: tuple[str, str, int, str]) -> Run:
        if key not in self.references:
            dump = self.root / "ref_{}_{}_dp{}{}".format(*key)
            self.references[key] = run_titan(
                reference_processes(key), *self.seed(key[0]), *reference_args(key),
                "--training.steps", str(STEPS), dump=dump, timeout=600)  # fmt: skip
        return self.references[key]


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("grid"))


def _row_id(row: dict[str, str]) -> str:
    return "-".join(row.values())


@needs_03
@pytest.mark.titan_grid
@pytest.mark.skipif(not RUN_GRID, reason="the long grid: bash scripts/test_grid.sh")
@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_row_matches_unpipelined(row: dict[str, str], grid_runs: _Runs, tmp_path: Path) -> None:
    ref = grid_runs.reference(reference_key(row))
    run = run_titan(processes(row), *grid_runs.seed(row["model"]), *row_args(row),
                    "--training.steps", str(STEPS), dump=tmp_path, timeout=900)  # fmt: skip
    moe = row["model"] in ("qwen3_moe", "deepseek_v3", "gpt_oss")
    if row["precision"] == "bf16":
        assert_same_curve(run, ref, steps=STEPS, tol=1e-3, grad_tol=1e-2)
    else:
        assert_same_curve(run, ref, steps=STEPS, grad_tol=1e-2 if moe else 1e-3)
    # the first step checked itself, where it has something to compare: not under BitPipe
    # (microbatches, not segments), ring attention or TP's DTensor outputs
    if row["schedule"] != "BitPipe" and row["parallel"] not in ("cp", "tp"):
        assert "first-step check passed" in run.output, run.output[-3000:]
