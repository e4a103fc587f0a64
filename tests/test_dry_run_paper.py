"""Smoke test of ``python -m benchmarks.dry_run.paper``: its quick cell (a tiny model at
pp 2 x tp 2, torch's tensor and sequence parallelism over the fake device mesh) dry-runs, and
the table and its Megatron attribution print. The paper's own cells are a benchmark
(docs/dry_run.md), not a test."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.dry_run import paper
from benchmarks.dry_run.model_ranks import dry_run_isolated
from seq1f1b._runtime import HAS_WARMUP_P2P

# benchmark tooling: on the default release only; the dry run itself needs torch >= 2.15
pytestmark = [
    pytest.mark.default_release_only,
    pytest.mark.skipif(HAS_WARMUP_P2P, reason="the dry run needs torch >= 2.15"),
]


def test_quick_cell_runs_tensor_parallel_and_prints_the_attribution() -> None:
    quick = next(c for c in paper.paper_cells(quick=True) if c.schedule == "Seq1F1B")
    cell = replace(quick, seq_len=512, microbatches=2)  # smaller still: 8 units
    (report,) = dry_run_isolated([cell.job()])
    cfg = cell.cfg
    per_layer = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn  # no GQA: wq, wk, wv, wo
    layers = cfg.n_layers // cell.pp
    full = 2 * (layers * per_layer + cfg.vocab * cfg.dim)  # bf16, rank 0: embedding too
    # TP shards the projections and the embedding (the norms' weights stay whole)
    assert report.peak.parameters == pytest.approx(full / cell.tp, rel=0.05)
    assert report.peak.kv_cache > 0 and report.n_units == cell.microbatches * 4
    text = paper.report([cell], [report], [report.host_s])
    assert "model state: 18 B/param vs 8" in text and "SP matmul inputs" in text
    assert "Seq1F1B" in text and "bytes per token-layer" in text
