"""Smoke tests of ``benchmarks.step_time.unit_overhead`` and ``benchmarks.step_time.pp4``
(tiny sizes, CPU, each in a process of its own: they pin the process and start a process
group): what they report is consistent with what they ran, and the history a run is recorded
into grows by that run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.presets import PRESETS
from benchmarks.step_time import pp4
from benchmarks.step_time import unit_overhead as uo

ROOT = Path(__file__).resolve().parent.parent

# benchmark tooling: on the default release only (scripts/test_oldest.sh skips it for time)
pytestmark = pytest.mark.default_release_only


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def test_unit_overhead_models_are_the_presets() -> None:
    """The module repeats the presets' models (to import only the library's public API)."""
    assert {name: PRESETS[name].model for name in uo.MODELS} == uo.MODELS


def test_unit_overhead_reports_and_records(tmp_path: Path) -> None:
    history = tmp_path / "history.json"
    args = ("benchmarks.step_time.unit_overhead", "--preset", "smoke", "--layers", "2",
            "--seq-len", "128", "--chunks", "2,4", "--steps", "1",
            "--record", str(history))  # fmt: skip
    _run(*args, "--out", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "unit_overhead.json").read_text())
    labels = [r["label"] for r in result["rows"]]
    assert labels == ["1F1B", "Seq1F1B K=2 compute", "Seq1F1B K=4 compute"]
    assert [r["units"] for r in result["rows"]] == [2, 4, 8]  # M=2 samples x K (1F1B: K=1)
    base = result["rows"][0]
    for row in result["rows"]:
        assert row["step_s"] > 0 and set(row["parts_s"]) == set(uo.PARTS)
        assert row["ratio_vs_1f1b"] == pytest.approx(row["step_s"] / base["step_s"])
        for part in uo.PARTS:  # the excess per unit is the profiled parts' difference
            want = 1e3 * (row["parts_s"][part] - base["parts_s"][part]) / row["units"]
            assert row["excess_ms_per_unit"][part] == pytest.approx(want)
    _run(*args)  # a second run, recorded
    runs = json.loads(history.read_text())
    assert len(runs) == 2 and all(r["config"]["seq_len"] == 128 for r in runs)
    table = history.with_suffix(".md").read_text().splitlines()
    assert sum(line.startswith(f"| {runs[0]['commit']} |") for line in table) == 4  # 2 x K


def test_pp4_rows_are_ratios_of_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pp4's rows (run here, its ranks spawned as the command spawns them) against an
    independent replay of the measured actions (:mod:`replay_check`; the harness is spied on
    to keep each schedule's traces) and the actions' own clocks."""

    from replay_check import check_step, keeping_traces

    kept = keeping_traces(pp4, monkeypatch)
    assert pp4.main(["--preset", "smoke", "--steps", "1", "--seq-len", "128",
                     "--out", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads((tmp_path / "pp4.json").read_text())["rows"]
    assert [r["label"] for r in rows] == [s.label for s in pp4.SPECS] == [r["label"] for r in kept]
    base = rows[0]
    assert base["replayed_vs_1f1b"] == 1.0 and base["wall_vs_1f1b"] == 1.0
    replays = [check_step(run) for run in kept]
    for r, replay in zip(rows, replays, strict=True):
        # the same model, data and seed under every schedule: the same loss
        assert r["loss"] == pytest.approx(base["loss"], rel=1e-5)
        assert r["replayed_vs_1f1b"] == pytest.approx(replay / replays[0], rel=1e-9)
        assert r["replay_step_time_s"] > 0 and r["wall_over_cpu"] > 0
