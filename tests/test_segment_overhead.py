"""Smoke test of ``benchmarks.step_time.segment_overhead`` (tiny sizes, CPU): it measures the right
computation (the segmented attention equals one unsegmented causal call, outputs and
gradients) and reports finite, positive ratios in its table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.step_time import segment_overhead as so

# benchmark tooling: on the default release only (scripts/test_oldest.sh skips it for time)
pytestmark = pytest.mark.default_release_only


@pytest.mark.parametrize("lengths", [[48], [24, 24], [12, 12, 12, 12], [20, 16, 12]])
def test_segmented_step_equals_unsegmented(lengths: list[int]) -> None:
    cfg = so.Config("cpu", (48,), heads=4, kv_heads=2, head_dim=8, batch=2, dtype="float64")
    q, k, v, go = so._inputs(cfg, 48)
    ref = so.unsegmented_step(q, k, v, go)
    got = so.segmented_step(q, k, v, go, lengths)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_ratios_are_finite_and_positive(tmp_path: Path) -> None:
    out = tmp_path / "so"
    assert so.main(["--device", "cpu", "--lengths", "64", "--chunks", "1", "2", "4",
                    "--repeats", "1", "--out", str(out)]) == 0  # fmt: skip
    res = json.loads((out / "segment_overhead.json").read_text())
    rows = res["rows"]
    assert [(r["seq_len"], r["chunks"]) for r in rows] == [(64, 1), (64, 2), (64, 4)]
    for r in rows:
        assert 0 < r["ratio"] < float("inf") and 0 < r["cpu_ratio"] < float("inf")
        assert r["segmented_s"] > 0 and r["unsegmented_s"] > 0
    table = (out / "segment_overhead.md").read_text()
    assert "| 64 |" in table and "K=4" in table


def test_default_picks_the_full_set_only_on_cuda() -> None:
    assert so.Config.default("cuda").lengths == (4096, 8192, 16384, 32768)
    cpu = so.Config.default("cpu")
    assert max(cpu.lengths) <= 8192 and cpu.dtype == "float32"
