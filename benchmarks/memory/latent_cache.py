"""The latent K/V cache measured on CPU: one multi-head latent attention layer run segment by
segment as Seq1F1B runs a sample (forwards 0..K-1, then backwards K-1..0).

    python -m benchmarks.memory.latent_cache [--seq-len 4096] [--width 16b|671b|debug] [--tp T]

Per K: the K/V cache's peak bytes with the expanded cache and with the latent one (measured:
the cache's own accounting), and the wall time of the layer's forwards and backwards both
ways (median of 3), so the re-expansion's cost shows next to what it saves. One layer, not a
step: the step-level share at real sizes is simulated in
``python -m benchmarks.planner_models.families``.

``--tp T``: one tensor-parallel rank's layer, as torchtitan's plan shards DeepSeek-V3's MLA
(``wq``/``wkv_b`` column-wise, ``wo`` row-wise: ``heads / T`` heads a rank; ``wkv_a`` and the
latent's norm replicated). Each rank caches the whole latent and expands its own heads, so the
latent cache per rank is the same at any T while the expanded one shrinks by T.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import seq1f1b
from seq1f1b.attention.kv import SegmentInfo, StageKVState, UnitContext, activate
from seq1f1b.schedules.partition import segment_offsets, uniform_split

__all__ = ["MLA", "MLAWidths", "run_segments"]


@dataclass(frozen=True)
class MLAWidths:
    """DeepSeek-V3's attention widths: model ``dim``, ``heads``, the latent ``rank``, the
    shared RoPE key ``rope``, each head's key part ``nope`` and value ``v``."""

    dim: int
    heads: int
    rank: int
    rope: int
    nope: int
    v: int


WIDTHS = {
    "16b": MLAWidths(2048, 16, 512, 64, 128, 128),  # torchtitan's DeepSeek-V3 16B
    "debug": MLAWidths(256, 16, 512, 64, 128, 128),  # its debugmodel
    "671b": MLAWidths(7168, 128, 512, 64, 128, 128),  # DeepSeek-V3 671B
}


def tp_shard(w: MLAWidths, tp: int) -> MLAWidths:
    """The widths one of ``tp`` tensor-parallel ranks holds: its ``heads / tp`` heads."""
    if w.heads % tp:
        raise ValueError(f"{w.heads} heads do not split over tp = {tp}")
    return MLAWidths(w.dim, w.heads // tp, w.rank, w.rope, w.nope, w.v)


class MLA(nn.Module):
    """One multi-head latent attention layer shaped like DeepSeek-V3's: every head's K and V
    expanded from a ``rank``-wide latent, plus a ``rope``-wide key the heads share (a sine
    stands in for the rotation); ``latent`` selects the cache, ``ckpt`` checkpoints it."""

    def __init__(self, w: MLAWidths, latent: bool, ckpt: bool = False) -> None:
        super().__init__()
        self.w, self.latent, self.ckpt = w, latent, ckpt
        self.wq = nn.Linear(w.dim, w.heads * (w.nope + w.rope), bias=False)
        self.wkv_a = nn.Linear(w.dim, w.rank + w.rope, bias=False)
        self.norm = nn.RMSNorm(w.rank)
        self.wkv_b = nn.Linear(w.rank, w.heads * (w.nope + w.v), bias=False)
        self.wo = nn.Linear(w.heads * w.v, w.dim, bias=False)

    def expand(self, c: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, (b, s, _) = self.w, c.shape
        k_nope, v = self.wkv_b(c).view(b, s, w.heads, w.nope + w.v).split([w.nope, w.v], -1)
        k = torch.cat([k_nope, pe.unsqueeze(2).expand(-1, -1, w.heads, -1)], -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        w, (b, s, _) = self.w, x.shape
        q = self.wq(x).view(b, s, w.heads, -1).transpose(1, 2)
        c, pe = self.wkv_a(x).split([w.rank, w.rope], -1)
        c, pe = self.norm(c), torch.sin(pe)
        if self.latent:
            out = seq1f1b.latent_attention(q, (c, pe), self.expand, layer=self)
        else:
            out = seq1f1b.chunk_aware_attention(q, *self.expand(c, pe), layer=self)
        return x + self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.attend, x, use_reentrant=False) if self.ckpt else self.attend(x)


def run_segments(layer: nn.Module, x: torch.Tensor, lengths: Sequence[int]) -> int:
    """``layer`` over ``x`` cut into ``lengths``, forwards in order then backwards in reverse
    (a squared-sum loss per segment), as the schedule runs one sample on one stage; returns
    the K/V cache's peak bytes."""
    k, seq_len = len(lengths), sum(lengths)
    state, starts = StageKVState(0, k), segment_offsets(list(lengths))
    bounds = (*starts, seq_len)

    def info(seg: int) -> SegmentInfo:
        return SegmentInfo(0, seg, k, starts[seg], lengths[seg], seq_len, bounds)

    outs = []
    for seg in range(k):
        state.begin_forward(0, seg)
        a = starts[seg]
        with activate(UnitContext(state, info(seg), "forward", True)):
            outs.append(layer(x[:, a : a + lengths[seg]]))
        state.end_forward(0, seg, keep=True)
    for seg in reversed(range(k)):
        state.begin_backward(0, seg)
        with activate(UnitContext(state, info(seg), "backward", True)):
            outs[seg].square().sum().backward()
        state.end_backward(0, seg)
    return state.peak_bytes


def measure(widths: MLAWidths, seq_len: int, k: int, latent: bool) -> tuple[int, float]:
    """(peak cache bytes, median seconds of 3) for one layer under full checkpointing."""
    torch.manual_seed(0)
    layer = MLA(widths, latent, ckpt=True)
    x = torch.randn(1, seq_len, widths.dim)
    times, peak = [], 0
    for _ in range(3):
        t = time.perf_counter()
        peak = run_segments(layer, x, uniform_split(seq_len, k))
        times.append(time.perf_counter() - t)
    return peak, statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory.latent_cache",
                                 description=__doc__)  # fmt: skip
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--width", choices=sorted(WIDTHS), default="16b")
    ap.add_argument("--tp", type=int, default=1, help="one TP rank's shard of the heads")
    ap.add_argument("--k", default="2,4,8", help="segment counts, comma-separated")
    a = ap.parse_args(argv)
    w = tp_shard(WIDTHS[a.width], a.tp)
    print(f"one MLA layer ({a.width}, tp {a.tp}: a rank's {w}), {a.seq_len} tokens, full "
          "checkpointing, CPU")  # fmt: skip
    print("| K | cache MiB, expanded | cache MiB, latent | ratio | s, expanded | s, latent | "
          "latent / expanded time |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for k in (int(x) for x in a.k.split(",")):
        (pe, te), (pl, tl) = measure(w, a.seq_len, k, False), measure(w, a.seq_len, k, True)
        print(f"| {k} | {pe / 2**20:.1f} | {pl / 2**20:.2f} | 1/{pe / pl:.0f} | {te:.2f} | "
              f"{tl:.2f} | {tl / te:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
