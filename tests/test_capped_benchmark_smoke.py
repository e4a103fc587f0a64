"""Smoke test: ``python -m benchmarks.memory.capped --smoke`` measures every split and writes
its table.

Benchmarks are not part of the test suite; this only checks the command end to end and that the
numbers it reports are consistent with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# benchmark tooling: on the default release only (scripts/test_oldest.sh skips it for time)
pytestmark = pytest.mark.default_release_only

ROOT = Path(__file__).resolve().parents[1]


def test_capped_benchmark_smoke(tmp_path: Path) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory.capped", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads((tmp_path / "capped.json").read_text())
    rows = {r["label"]: r for r in res["rows"]}
    assert {
        "1F1B",
        "Seq1F1B K=4 uniform",
        "Seq1F1B K=4 compute",
        "Seq1F1B K=8 uniform",
        "Seq1F1B K=8 compute",
        "Seq1F1B K=4 memory_capped",
        "Seq1F1B K=8 memory_capped",
    } <= set(rows)
    assert rows["1F1B"]["time_vs_1f1b"] == 1.0 and rows["1F1B"]["longest_vs_1f1b"] == 1.0
    for label, r in rows.items():
        assert r["step_time_s"] > 0 and r["longest_seq_len"] > 0, label
        assert sum(r["lengths"]) == 256 and len(r["peak_vs_budget"]) == 2, label
        assert r["simulated_vs_1f1b"] <= 1.0 + 1e-9, label
    # the uniform split's simulated peak bounds the capped one's (default cap 1.0), so its
    # measured stage peaks stay within rounding of the uniform split's
    for k in (4, 8):
        capped, uniform = rows[f"Seq1F1B K={k} memory_capped"], rows[f"Seq1F1B K={k} uniform"]
        assert max(capped["peak_vs_budget"]) <= max(uniform["peak_vs_budget"]) * 1.05
        assert capped["simulated_vs_1f1b"] <= uniform["simulated_vs_1f1b"] + 1e-9
    assert res["last_stage_ceiling"] > 1.0
    assert "| Seq1F1B K=8 memory_capped |" in (tmp_path / "capped.md").read_text()
