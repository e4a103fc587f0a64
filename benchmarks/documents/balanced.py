"""Balanced packing (WLB-LLM) against the splits alone, simulated at the 8B shape.

The shipped corpus packed in arrival order (:func:`.packed.pack`, as torchtitan packs) gives
one step's rows; :func:`torchtitan_integration.balanced_packing.balance_rows` reassigns their
documents among them so the costliest row's attention (sum of squared document lengths) is as
low as the greedy finds. The pipeline is then simulated as :mod:`.packed` does (one row per
sample, every unit priced under its own row's document mask): the causal compute split and
the per-sample mask-aware split on the arrival-order rows, and both on the balanced rows.

    python -m benchmarks.documents.balanced [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.schedules.mask_split import mask_balanced_split
from seq1f1b.schedules.partition import ModelShape, compute_balanced_split

from .packed import (
    SHAPE_8B,
    balanced_documents,
    corpus_document_lengths,
    pack,
    positions_of,
    row_prefix_flops,
    step_time,
)

__all__ = ["compare", "max_row_attention"]


def max_row_attention(docs: torch.Tensor) -> int:
    """The costliest row's sum of squared piece lengths."""
    pos = positions_of(docs)
    lengths = torch.where(
        torch.cat([pos[:, 1:] == 0, torch.ones_like(pos[:, :1], dtype=torch.bool)], 1), pos + 1, 0
    )
    return int((lengths**2).sum(dim=1).max())


def compare(docs: torch.Tensor, shape: ModelShape, pp: int, k: int) -> dict[str, float | int]:
    """Simulated step time (FLOPs) of the causal and per-sample mask-aware splits on the
    arrival-order rows and on the balanced rows (one row per sample)."""
    rows, seq_len = docs.shape
    order = build_orders(OrderSpec(pp, 1, rows, k))
    causal = [compute_balanced_split(seq_len, k, shape)] * rows
    out: dict[str, float | int] = {}
    for name, layout in (("arrival", docs), ("balanced", balanced_documents(docs))):
        prefixes = row_prefix_flops(layout, shape)
        per_sample = [mask_balanced_split(layout[r : r + 1], k, shape) for r in range(rows)]
        out[f"{name}/causal"] = step_time(order, prefixes, causal, pp)
        out[f"{name}/per_sample"] = step_time(order, prefixes, per_sample, pp)
        out[f"{name}/max_row_attention"] = max_row_attention(layout)
    return out


def run(seeds: int = 3, pp: int = 4, microbatches: int = 8) -> list[dict[str, Any]]:
    """Every (seq_len, K) at pp, M: the mean over ``seeds`` packings of each time, relative
    to the arrival-order causal split."""
    lengths = corpus_document_lengths()
    results = []
    for seq_len in (32768, 131072):
        # seed seq_len + pp first: the packing benchmarks.documents.packed reports
        seeds_ = range(seq_len + pp, seq_len + pp + seeds)
        packings = [pack(lengths, microbatches, seq_len, seed=s) for s in seeds_]
        for k in (4, 8):
            runs = [compare(docs, SHAPE_8B, pp, k) for docs in packings]
            rel = {
                key: statistics.fmean(r[key] / r["arrival/causal"] for r in runs)
                for key in ("arrival/per_sample", "balanced/causal", "balanced/per_sample")
            }
            attn = statistics.fmean(
                r["balanced/max_row_attention"] / r["arrival/max_row_attention"] for r in runs
            )
            results.append({"seq_len": seq_len, "pp": pp, "M": microbatches, "K": k,
                            **rel, "max_row_attention_balanced_vs_arrival": attn})  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="packings averaged per setting")
    args = parser.parse_args()
    print("shipped corpus, 8B shape, pp=4, M=8 (one row per sample); simulated step time "
          f"relative to the arrival-order causal split, mean of {args.seeds} packings")  # fmt: skip
    print("| seq_len | K | causal | per-sample | balanced + causal | balanced + per-sample | "
          "costliest row's attention, balanced / arrival |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in run(args.seeds):
        print(f"| {r['seq_len']} | {r['K']} | 1.000 | {r['arrival/per_sample']:.3f} | "
              f"{r['balanced/causal']:.3f} | {r['balanced/per_sample']:.3f} | "
              f"{r['max_row_attention_balanced_vs_arrival']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
