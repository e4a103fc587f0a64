"""The planner's peak memory against the dry run's (``python -m benchmarks.dry_run.planner_check``):
one small tensor-parallel Seq1F1B cell of the grid, dry-run (pipeline rank 0, TP rank 0, a
process of its own), must be priced within 10% by the planner for the same model and trainer
(the saved tensors of torch's eager ops on the CPU, :data:`~seq1f1b.planning.saved.
TORCH_EAGER_CPU`). The formula the planner priced before (:data:`~seq1f1b.planning.saved.
FUSED`: fused norms, shards for the sequence-parallel matmul inputs) is a third below the
same cell, so the check can fail."""

from __future__ import annotations

import pytest

from benchmarks.dry_run.planner_check import CheckCell, planner_peak, run_cells
from seq1f1b._runtime import HAS_WARMUP_P2P
from seq1f1b.planning.saved import FUSED
from seq1f1b.testing import TinyConfig

# benchmark tooling: on the default release only; the dry run itself needs torch >= 2.15
pytestmark = [
    pytest.mark.default_release_only,
    pytest.mark.skipif(HAS_WARMUP_P2P, reason="the dry run needs torch >= 2.15"),
]

CFG = TinyConfig(vocab=4096, dim=512, n_heads=8, n_kv_heads=4, n_layers=4, ffn=1408)


def test_planner_prices_a_tensor_parallel_seq1f1b_cell_within_10_percent() -> None:
    cell = CheckCell("Seq1F1B", 4, "none", 2, seq_len=4096, microbatches=2, cfg=CFG)
    (row,) = run_cells([cell])
    dry = row.dry.peak.total
    assert row.dry.peak.kv_cache > 0 and row.dry.n_units == cell.microbatches * cell.k
    assert row.ratio == pytest.approx(1.0, abs=0.10), (row.planned, row.dry.peak)
    before = planner_peak(cell, FUSED).peak_bytes[0] / dry
    assert before < 0.9, before  # the old formula misses the gathered inputs and fp32 norms
