"""Packed documents: what skipping invisible blocks buys (measured), and what a
document-aware split buys over the causal compute split (simulated).

Why: with short packed documents most (query, key) blocks of a long sequence share no
document. ``ScheduleSeq1F1B`` skips them (no kernel call) and caches only the K/V later
segments can see; ``skip_invisible=False`` is the mask-alone baseline that computes every block
under the mask and keeps every segment. And the causal compute split makes later segments
shorter for an attention cost that documents remove, which unbalances the pipeline; the split
from the masked per-token cost (:func:`seq1f1b.schedules.partition.profile_balanced_split`) does
not.
"""

from __future__ import annotations

from typing import Any

from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning.simulate import FlopsCosts, simulate
from seq1f1b.schedules.partition import (
    ModelShape,
    attended_keys,
    compute_balanced_split,
    profile_balanced_split,
    profile_flops,
    uniform_split,
)

from ..harness.measured import RunSpec, Setting, measure, packed_documents
from ..harness.presets import Preset

__all__ = ["measure_skipping", "simulate_masked_splits"]


def measure_skipping(preset: Preset, timed_steps: int | None = None) -> dict[str, Any]:
    """pp=2, M=2, K=4, the preset's first length, documents of ~1/32 of it: skip vs mask only."""
    seq_len = preset.seq_lens[0]
    doc = max(8, seq_len // 32)
    specs = (
        RunSpec("Seq1F1B", 4, "compute"),
        RunSpec("Seq1F1B", 4, "uniform", documents=doc),
        RunSpec("Seq1F1B", 4, "uniform", documents=doc, skip_invisible=False),
    )
    setting = Setting(
        pp=2,
        microbatches=2,
        seq_len=seq_len,
        model=preset.model,
        specs=specs,
        timed_steps=preset.timed_steps if timed_steps is None else timed_steps,
        keep_trace=False,
    )
    runs = measure(setting)
    for r in runs:
        r.pop("trace", None)
        r.pop("step_traces", None)
    return {"seq_len": seq_len, "document_tokens": doc, "runs": runs}


def simulate_masked_splits(
    shape: ModelShape,
    seq_len: int = 32768,
    pp: int = 4,
    microbatches: int = 8,
    chunks: tuple[int, ...] = (4, 8),
    document_tokens: int = 2048,
    window: int = 4096,
) -> list[dict[str, Any]]:
    """Bubble and step time (FLOPs) of uniform, causal compute and mask-aware splits, all
    costed with the masked attention (packed documents; a sliding window)."""
    ids = packed_documents(8, seq_len, document_tokens).tolist()
    masks = {
        f"documents ~{document_tokens}": attended_keys(seq_len, ids),
        f"window {window}": attended_keys(seq_len, window=window),
    }
    orders = {k: build_orders(OrderSpec(pp, 1, microbatches, k)) for k in chunks}
    rows = []
    for mask, keys in masks.items():
        flops = tuple(profile_flops(keys, shape))
        for k in chunks:
            splits = {
                "uniform": uniform_split(seq_len, k),
                "compute (causal)": compute_balanced_split(seq_len, k, shape),
                "compute (mask-aware)": profile_balanced_split(flops, k),
            }
            base = None
            for name, lengths in splits.items():
                costs = FlopsCosts(shape, tuple(lengths), pp, pp, position_flops=flops)
                res = simulate(orders[k], costs.cost)
                base = base or res.makespan
                seg = costs.segment_costs
                rows.append(
                    {
                        "mask": mask,
                        "pp": pp,
                        "microbatches": microbatches,
                        "seq_chunks": k,
                        "split": name,
                        "lengths": list(lengths),
                        "segment_cost_max_over_mean": max(seg) / (sum(seg) / len(seg)),
                        "bubble_ratio": res.bubble_ratio,
                        "time_vs_uniform": res.makespan / base,
                    }
                )
    return rows
