"""One schedule registry serves the torchtitan integration, the benchmarks and the planner."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from seq1f1b._runtime import FULL_BACKWARD
from seq1f1b._runtime import reference as torch_ref
from seq1f1b._runtime.replay import replay
from seq1f1b._runtime.topology import StageTopology
from seq1f1b.planning.simulate import simulate
from seq1f1b.registry import REGISTRY, is_baseline, lookup, schedule_names

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_every_entry_builds_a_valid_order(entry) -> None:
    pp, m, k = 4, 8, 2 if entry.seq_chunked else 1
    v = entry.stages_per_rank
    order = entry.compute_orders(pp, m, k)
    per_stage = m * k // (2 if entry.replicas == 2 else 1)
    mapping = torch_ref.validate_schedule(order, pp, pp * v, per_stage)
    assert len(mapping) == pp * v
    topology = StageTopology.chains(pp * v, mapping.__getitem__, entry.model_stages(pp))
    assert replay(order, topology).finished
    if entry.bubble_formula is not None:  # the published formula, exactly, at equal costs
        unit = 1 / (v * k) if entry.replicas == 1 else 1 / 2

        def cost(a) -> float:
            b = a.computation_type == FULL_BACKWARD
            return (entry.formula_backward_cost if b else 1.0) * unit

        res = simulate(order, cost, replicas=entry.replicas)
        assert res.bubble_ratio == pytest.approx(entry.bubble_formula(pp, m, k, v), rel=1e-9)
    # a class to run it: torch's get_schedule_class or ours
    assert entry.schedule_class().__name__.startswith("Schedule")


def test_lookup_is_case_insensitive_and_names_the_choices() -> None:
    assert lookup("seq1f1b") is lookup("Seq1F1B")
    assert lookup("interleaved1f1b").name == "Interleaved1F1B"
    with pytest.raises(ValueError, match="unknown: use one of"):
        lookup("Seq2F2B")
    assert {"Seq1F1B", "ZBSeq1F1B", "ZBVSeq1F1B", "InterleavedSeq1F1B", "BitPipe"} == set(
        schedule_names(ours=True)
    )
    assert is_baseline("1f1b") and not is_baseline("Seq1F1B")


def test_stages_per_rank_limits() -> None:
    lookup("Seq1F1B").check_stages_per_rank(1)
    with pytest.raises(ValueError, match=">= 2 stages per rank"):
        lookup("InterleavedSeq1F1B").check_stages_per_rank(1)
    with pytest.raises(ValueError, match="exactly 4"):
        lookup("BitPipe").check_stages_per_rank(2)


_NAMES = "|".join(re.escape(e.name) for e in REGISTRY)
_COMPARE = re.compile(
    rf"""(==|!=)\s*["']({_NAMES})["']|["']({_NAMES})["']\s*(==|!=)|\.lower\(\)\s*==\s*["']"""
    rf"""|endswith\(["'](Seq1F1B)["']\)""",
    re.IGNORECASE,
)


def test_no_schedule_name_compared_outside_the_registry() -> None:
    offenders = []
    paths = [*ROOT.glob("seq1f1b/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    paths += ROOT.glob("torchtitan_integration/**/*.py")
    for path in sorted(p for p in paths if p.name != "registry.py"):
        offenders += [
            f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if _COMPARE.search(line)
        ]
    assert not offenders, "\n".join(offenders)
