"""GPU profiles: the A100 profile against the Seq1F1B paper's published 7B table (fitted cells,
held-out cells, what fits), the added time terms, ties in the ranking and ``--gpu``."""

from __future__ import annotations

import itertools

import pytest

from seq1f1b.planning.costmodel import PRESETS, Hardware, fsdp_exposed_seconds
from seq1f1b.planning.planner import Setting, main, price, tie_groups
from seq1f1b.planning.profiles import PROFILES, profile
from seq1f1b.planning.published import (
    FIT_CELLS,
    PUBLISHED_TFLOPS,
    fits_rows,
    memory_rows,
    tflops_rows,
)

A100 = PROFILES["a100-80gb"]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return tflops_rows(A100)


def test_fitted_cells_are_reproduced(rows: list[dict]) -> None:
    fitted = [r for r in rows if r["fitted"]]
    assert len(fitted) == len(FIT_CELLS) == 5
    assert all(abs(r["error"]) < 0.005 for r in fitted), fitted


def test_held_out_cells_within_the_profiles_stated_error(rows: list[dict]) -> None:
    """Every cell not fitted on, as a ratio to its length's baseline, within the error the
    planner states for ties (6%); 5% (the target) is met by all but the interleaved Seq1F1B
    at 64k and 128k (+5.9%, +5.1%: the model overrates it at long lengths)."""
    held = [r for r in rows if not r["fitted"] and r["ratio_to"]]
    assert len(held) == 4
    worst = max(abs(r["error"]) for r in held)
    assert worst <= A100.efficiency.error, held
    over = {(r["seq_len"], r["schedule"]) for r in held if abs(r["error"]) > 0.05}
    assert over <= {(65536, "Seq1F1B-I"), (131072, "Seq1F1B-I")}
    absolute = [r for r in rows if not r["fitted"] and r["ratio_to"] is None]
    assert all(abs(r["error"]) <= 0.07 for r in absolute), absolute


def test_published_orderings_at_32k(rows: list[dict]) -> None:
    """At 32k the predicted order of the four schedules is the published one (Seq1F1B and
    1F1B-I 0.9% apart there, a tie for the model)."""
    pred = {
        r["schedule"]: r["predicted"] for r in rows if r["seq_len"] == 32768 and not r["ratio_to"]
    }
    published = PUBLISHED_TFLOPS[32768]
    assert sorted(pred, key=pred.__getitem__) == sorted(published, key=published.__getitem__)


def test_published_oom_cells_do_not_fit_and_the_rest_do() -> None:
    for r in fits_rows(A100):
        assert r["predicted_fits"] == r["published_runs"], r


def test_memory_row_within_what_the_model_achieves() -> None:
    """With Megatron's own terms and the 4 GB reserve: 3 of 4 cells within 15%, Seq1F1B at
    -23% (the model undercounts every cell; what is missing is not attributed)."""
    errors = {r["schedule"]: r["error"] for r in memory_rows(A100)}
    assert all(-0.24 < e < 0 for e in errors.values()), errors
    assert sum(abs(e) <= 0.15 for e in errors.values()) == 3


def test_pipeline_sends_cost_more_across_nodes() -> None:
    """The same setting on a profile: its pipeline crosses nodes at 32 GPUs, not at 8."""
    setting = Setting(4, 2, 1, 4, 8, "compute", False, True, "Seq1F1B")
    shape, costs = PRESETS["paper-7b"], A100.action_costs()
    inside = price(setting, shape, 32768, A100.hardware(8), actions=costs)
    across = price(setting, shape, 32768, A100.hardware(32), actions=costs, global_batch=8)
    unpriced = Hardware(
        32, 80.0, tflops=A100.hardware(32).tflops, tp_gbps=A100.hardware(32).tp_gbps
    )
    free = price(setting, shape, 32768, unpriced, actions=costs, global_batch=8)
    assert free.step_seconds < inside.step_seconds < across.step_seconds


def test_fsdp_traffic_hides_behind_compute() -> None:
    kw = {"layers": 8, "pipelined": True, "microbatches": 4}
    # 1e9 parameters over 8 ranks at 100 GB/s: 17.5 ms of gathers, 35 ms of reductions
    gather, reduce = 2e9 * 7 / 8 / 100e9, 4e9 * 7 / 8 / 100e9
    long = fsdp_exposed_seconds(1e9, 8, 100.0, forward=1.0, backward=2.0, **kw)
    assert long == pytest.approx((gather + reduce) / 8)  # only the first and last layer
    none = fsdp_exposed_seconds(1e9, 8, 100.0, forward=0.0, backward=0.0, **kw)
    assert none == pytest.approx((gather + reduce) * 9 / 8)
    assert fsdp_exposed_seconds(1e9, 1, 100.0, forward=0.0, backward=0.0, **kw) == 0.0
    assert fsdp_exposed_seconds(1e9, 8, None, forward=0.0, backward=0.0, **kw) == 0.0


def test_ties_are_grouped_and_ordered_by_the_stated_rule() -> None:
    shape = PRESETS["paper-7b"]
    hw, costs = A100.hardware(32), A100.action_costs()
    cands = [
        price(
            Setting(4, 8, 1, k, 8, "compute", False, True, name, v), shape, 65536, hw, actions=costs
        )
        for name, v, k in (
            ("1F1B", 1, 1),
            ("Interleaved1F1B", 2, 1),
            ("Seq1F1B", 1, 4),
            ("InterleavedSeq1F1B", 2, 4),
        )
    ]
    groups = tie_groups(cands, 0.06)
    assert [len(g) for g in groups] == [3, 1]  # 1F1B is 14% slower: a group of its own
    first = groups[0]
    assert [c.setting.name for c in first] == ["InterleavedSeq1F1B", "Seq1F1B", "Interleaved1F1B"]
    assert all(c.max_bytes <= d.max_bytes for c, d in itertools.pairwise(first))
    assert [len(g) for g in tie_groups(cands, 0.0)] == [1, 1, 1, 1]


def test_gpu_flag_picks_a_profile(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "--model paper-7b --seq-len 65536 --gpus 32 --global-batch 8 --pp 4 --tp 8".split()
    argv += "--ac none --chunks 4 --split compute --precision bf16".split()
    assert main([*argv, "--gpu", "a100-80gb", "--schedules", "Seq1F1B,1F1B"]) == 0
    out = capsys.readouterr().out
    assert "profile a100-80gb" in out and "x 80 GB" in out
    assert "within 6% of its fastest" in out and "held-out" in out
    assert main([*argv, "--gpu", "h200", "--schedules", "Seq1F1B"]) == 0
    assert "x 141 GB" in capsys.readouterr().out
    assert main([*argv, "--gpu", "a100-80gb", "--tflops", "300"]) == 2
    assert "--gpu sets the time model" in capsys.readouterr().err
    assert main(argv) == 2
    assert "give --gpu" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a100-80gb, h100-80gb, h200"):
        profile("v100")
