"""Smoke test: ``python -m benchmarks --smoke`` runs every part on tiny sizes and writes results.

Benchmarks are not part of the test suite; this only checks that the command works end to end
and that results.json has what docs/benchmarks.md promises (simulated bubble per schedule; measured
median step time and per-stage peak activation bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seq1f1b.registry import lookup

# benchmark tooling: on the default release only (scripts/test_oldest.sh skips it for time)
pytestmark = pytest.mark.default_release_only

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_results_json(smoke_out: Path) -> None:
    res = json.loads((smoke_out / "results.json").read_text())
    sim = [r for r in res["simulation"] if "error" not in r]
    # only torch's own schedules may refuse a size (e.g. DualPipeV with M < 2 pp); ours never
    refused = [r for r in res["simulation"] if "error" in r]
    assert all(not lookup(r["schedule"]).ours for r in refused), refused
    assert {r["schedule"] for r in sim} >= {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "ZBVZeroBubble",
        "Seq1F1B",
    }
    assert all(0 <= r["bubble_ratio"] < 1 for r in sim)
    pp2 = next(s for k, s in res["measured"].items() if k.startswith("pp2"))
    labels = {r["label"] for r in pp2["runs"]}
    assert {"1F1B", "GPipe", "Interleaved1F1B", "Seq1F1B K=4 compute"} <= labels
    assert {"ZBVSeq1F1B K=4 compute", "ZBVSeq1F1B K=8 uniform"} <= labels
    per_rank = {"Interleaved1F1B": 2, "BitPipe": 4, "ZBVSeq1F1B": 2}
    for r in pp2["runs"]:
        assert r["step_time_s"] > 0
        assert len(r["peak_activation_bytes"]) == 2 * per_rank.get(r["schedule"], 1)
        assert all(b > 0 for b in r["peak_activation_bytes"])
        assert r["simulated_bubble_ratio"] >= 0
    runs = {r["label"]: r for r in pp2["runs"]}
    # BitPipe holds two replicas: twice the weights of 1F1B over the pipeline
    assert sum(runs["BitPipe"]["param_bytes_rank"]) == 2 * sum(runs["1F1B"]["param_bytes_rank"])
    bit = [r for r in sim if r["schedule"] == "BitPipe"]
    assert bit and all(
        abs(r["bubble_ratio_equal_cost"] - r["formula_bubble_ratio"]) < 1e-9 for r in bit
    )
    losses = {round(r["loss"], 4) for r in pp2["runs"]}
    assert len(losses) == 1, losses  # same model, same data: every schedule, the same loss
    pp4 = {r["label"]: r for r in res["measured"]["pp4"]["runs"]}
    assert (
        pp4["Seq1F1B K=4 uniform"]["peak_activation_bytes"][0]
        < (pp4["1F1B"]["peak_activation_bytes"][0])
    )
    assert res["budget"]["rows"] and all(r["longest_seq_len"] > 0 for r in res["budget"]["rows"])
    # measurements only: the goals they are read against live in docs/benchmarks.md
    assert res["headline"] and all(set(h) == {"name", "value"} for h in res["headline"])
    bounds = [b for b in res["memory_bounds"] if b["label"].startswith("ZBVSeq1F1B")]
    assert {b["stage"] for b in bounds} == {0, 1, 2, 3}
    assert all(b["measured_units"] and b["measured_units"] > 0 for b in bounds)
    values = " ".join(h["value"] for h in res["headline"])
    assert "ZBVSeq1F1B K=8" in values and "of 1F1B's length" in values
    cp = {(r["label"], r["cp"]): r for r in res["context_parallel"]["measured"]["runs"]}
    for (_, c), r in cp.items():  # the ring moved exactly what the formula says
        if c > 1:
            assert all(sent == r["cp_formula_bytes"] for sent in r["cp_sent_bytes_rank"])
    # the calibrated planner priced every measured pp=2 run, next to its measured ratio
    cal = {r["label"] for r in res["calibration"]["rows"]}
    assert cal == {r["label"] for r in pp2["runs"]}
    assert all(r["predicted_vs_1f1b"] > 0 for r in res["calibration"]["rows"])
    assert all(r["profile_vs_1f1b"] > 0 for r in res["calibration"]["rows"])  # the CPU profile's
    published = {r["schedule"] for r in res["memory_vs_published"]["rows"]}
    assert published == {"1F1B", "1F1B-I", "Seq1F1B", "Seq1F1B-I"}
    with_cp, without = cp[("Seq1F1B K=4 uniform", 2)], cp[("Seq1F1B K=4 uniform", 1)]
    assert with_cp["peak_activation_bytes"][0] < 0.6 * without["peak_activation_bytes"][0]
    assert with_cp["kv_peak_bytes_rank"][0] * 2 == without["kv_peak_bytes_rank"][0]
    q, kv = cp[("Seq1F1B K=4 uniform, pass_q", 2)], cp[("Seq1F1B K=4 uniform, pass_kv", 2)]
    assert q["cp_sent_bytes_rank"][0]["prefix"] != kv["cp_sent_bytes_rank"][0]["prefix"]
    sim = {
        (r["label"], r["recompute"]): r["longest_tokens"]
        for r in res["context_parallel"]["simulated"]
    }
    assert sim[("Seq1F1B K=4, pp=4 x cp=2", False)] > sim[("1F1B, pp=4 x cp=2", False)]
    _, skip, mask_only = res["masks"]["measured"]["runs"]
    assert skip["kv_peak_bytes_rank"][0] < mask_only["kv_peak_bytes_rank"][0]
    assert skip["loss"] == pytest.approx(mask_only["loss"], rel=1e-6)  # same masked model
    split = {(r["mask"], r["seq_chunks"], r["split"]): r for r in res["masks"]["simulated"]}
    for (mask, k, name), r in split.items():
        if name == "compute (mask-aware)":
            assert (
                r["segment_cost_max_over_mean"]
                < split[(mask, k, "compute (causal)")]["segment_cost_max_over_mean"]
            )
    published = res["planner_example"]
    assert not published["131072"]["K=1"]["fits"] and published["131072"]["K=8"]["fits"]
    assert (smoke_out / "results.md").read_text().count("|") > 50
    trace = json.loads((smoke_out / "traces" / "pp4.json").read_text())
    assert any(ev["ph"] == "X" and ev["name"].startswith("F") for ev in trace["traceEvents"])


def test_pictures(smoke_out: Path) -> None:
    pytest.importorskip("matplotlib")
    pngs = list(smoke_out.glob("**/*.png"))
    assert len(pngs) >= 5
    assert (smoke_out / "timeline_1f1b_vs_seq1f1b.png").stat().st_size > 1000


def test_budget_fit_and_step_down() -> None:
    from benchmarks.memory.budget import budget_rows, fit_line, verify_rows

    a, b, worst = fit_line([(1024, 1124.0), (2048, 2148.0), (4096, 4196.0)])
    assert (a, b) == pytest.approx((100.0, 1.0)) and worst < 1e-9
    runs = [{"seq_len": n, "peak_activation_rank_bytes": [50 + n, 100 + n]} for n in (1024, 4096)]
    rows = budget_rows({"x": runs}, budget=8292.0, granule=64)
    assert rows[0]["longest_seq_len"] == 8192

    def peaks(lengths: dict[str, int]) -> dict[str, float]:  # truly superlinear: over at first
        return {k: 100 + n + n * n / 100_000 for k, n in lengths.items()}

    verify_rows(rows, peaks, budget=8292.0, granule=64)
    assert rows[0]["verified_within_budget"] and rows[0]["verify_runs"] == 2
    assert rows[0]["longest_seq_len"] < 8192


def test_meter_releases_saved_outputs_of_a_retained_graph() -> None:
    """A saved *output* (ReLU saves its result) of a graph run with retain_graph=True, as a
    split backward's input half does, is released with the graph: the meter must not hold the
    tensor itself (tensor -> grad_fn -> saved -> holder -> tensor would be a cycle through C++
    that no collector breaks, and the meter would report it as live until the step ended)."""
    import gc

    from benchmarks.harness.probe import SavedTensorMeter

    w = torch.randn(8, 8, requires_grad=True)
    meter = SavedTensorMeter(exclude=[w])
    meter.stage = 0
    with meter.active():
        x = torch.randn(4, 8, requires_grad=True)
        y = torch.relu(x @ w)
        loss = y.sum()
        loss.backward(retain_graph=True)
    assert meter.live_total > 0  # the retained graph still holds its saved tensors
    del y, loss
    gc.collect()
    assert meter.live_total == 0 and meter.live[0] == 0


def test_gap_measures_and_tabulates(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks.step_time.gap`` on tiny sizes: ratios vs 1F1B for each schedule, 1F1B's own
    1.0, the simulated ratio below 1 for Seq1F1B (the FLOPs model's bubble saving), and a table
    row per tree and schedule. The replayed ratio is checked against an independent replay of
    the measured actions (:mod:`replay_check`, kept by spying on the harness), the wall
    times against the actions' own clocks."""

    from replay_check import check_step, keeping_traces

    import benchmarks.harness.measured as measured
    from benchmarks.step_time.gap import _table, measure_gap

    kept = keeping_traces(measured, monkeypatch)
    res = measure_gap([2], steps=1, seq_len=128)
    runs = res["runs"]
    assert list(runs) == ["1F1B", "Seq1F1B K=2 compute"]
    base, seq = runs["1F1B"], runs["Seq1F1B K=2 compute"]
    assert 0 < seq["simulated_vs_1f1b"] < 1
    for kind in ("step_time_s", "replay_step_time_s"):
        assert 0 < base[kind] < 60 and 0 < seq[kind] < 60
    replays = {r["label"]: check_step(r) for r in kept}
    assert seq["replay_vs_1f1b"] == pytest.approx(
        replays["Seq1F1B K=2 compute"] / replays["1F1B"], rel=1e-9
    )
    # wall: each schedule's step at least its ranks' actions, the ratio from those steps
    assert [r["step_time_s"] for r in kept] == [base["step_time_s"], seq["step_time_s"]]
    assert base["wall_vs_1f1b"] == 1.0 and seq["wall_vs_1f1b"] > 0
    table = _table({"old": [res], "new": [res, res]})
    assert table.count("| Seq1F1B K=2 compute |") == 2 and "load average" in table
