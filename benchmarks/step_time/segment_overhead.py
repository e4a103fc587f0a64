"""Segment overhead: one attention layer's forward + backward over K segments, against one
unsegmented causal call at the same length.

Why: Seq1F1B's bubble saving is paid for in attention: segment ``k`` attends to the cached K/V
of segments ``0..k-1`` and its own (one kernel call per block, merged by log-sum-exp), and its
backward hands K/V gradients back to the earlier segments. This measures that price alone,
with the schedule's order (forwards 0..K-1, backwards K-1..0, each segment's q/k/v its own
leaves, as its projections would give them) and the library's own entry point
(:func:`seq1f1b.chunk_aware_attention` inside a unit context, K/V cache included). The
reference is one ``F.scaled_dot_product_attention(is_causal=True)`` call over the sequence.

``python -m benchmarks.step_time.segment_overhead [--device cpu|cuda] [--out DIR]``: the device is
CUDA when one is present (bf16, the CUDA flash kernels; lengths 4k-32k), else CPU (fp32, the CPU
flash kernel; 4k and 8k so that it runs in a few minutes). Prints a markdown table of
segmented / unsegmented time per length and K; ``--out`` also writes
``segment_overhead.json`` and ``segment_overhead.md`` there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from seq1f1b import SegmentInfo, chunk_aware_attention
from seq1f1b.attention.kv import StageKVState, UnitContext, activate
from seq1f1b.schedules.partition import segment_offsets, uniform_split

__all__ = ["Config", "measure", "segmented_run", "segmented_step", "unsegmented_step"]

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # out, dq, dk, dv


@dataclass(frozen=True)
class Config:
    """What to measure: sequence lengths, segment counts, one layer's shape, timing."""

    device: str
    lengths: tuple[int, ...]
    chunks: tuple[int, ...] = (1, 2, 4, 8)
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    repeats: int = 3  # timed runs per case (after one warm-up); the median is reported

    @staticmethod
    def default(device: str) -> Config:
        """The full set on CUDA; on CPU (one thread) a smaller one that takes minutes."""
        if device == "cuda":
            return Config(
                "cuda", (4096, 8192, 16384, 32768), heads=16, kv_heads=16, head_dim=128,
                dtype="bfloat16", repeats=10,
            )  # fmt: skip
        return Config("cpu", (4096, 8192), heads=4, kv_heads=4)


@dataclass
class Row:
    """One (length, K) case: median seconds of forward + backward, and the ratio."""

    seq_len: int
    chunks: int
    segmented_s: float
    unsegmented_s: float
    ratio: float
    segmented_cpu_s: float = 0.0  # process CPU time: immune to other jobs taking the cores
    unsegmented_cpu_s: float = 0.0
    cpu_ratio: float = 0.0
    segmented_all_s: list[float] = field(default_factory=list)
    unsegmented_all_s: list[float] = field(default_factory=list)


def _inputs(cfg: Config, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)

    def mk(h: int) -> torch.Tensor:
        t = torch.randn(cfg.batch, h, seq_len, cfg.head_dim, generator=g)
        return t.to(device=cfg.device, dtype=dtype)

    return mk(cfg.heads), mk(cfg.kv_heads), mk(cfg.kv_heads), mk(cfg.heads)


def unsegmented_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor) -> Grads:
    """One causal call over the whole sequence, forward and backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )
    out.backward(go)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def segmented_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, lengths: Sequence[int]
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """The same attention as the schedule runs it over ``lengths``: forwards 0..K-1 (each
    caching its K/V for the later ones), backwards K-1..0. Returns each segment's output and
    its (q, k, v) leaves, whose ``.grad`` hold the segment's gradients."""
    n, total = len(lengths), sum(lengths)
    starts = segment_offsets(lengths)
    bounds = (*starts, total)
    state = StageKVState(0, n)
    leaves, outs = [], []
    for seg, (a, m) in enumerate(zip(starts, lengths, strict=True)):
        qs, ks, vs = (t[:, :, a : a + m].detach().requires_grad_() for t in (q, k, v))
        leaves.append((qs, ks, vs))
        info = SegmentInfo(0, seg, n, a, m, total, bounds)
        state.begin_forward(0, seg)
        with activate(UnitContext(state, info, "forward", True)):
            outs.append(chunk_aware_attention(qs, ks, vs, layer="attn"))
        state.end_forward(0, seg, keep=True)
    for seg in reversed(range(n)):
        a, m = starts[seg], lengths[seg]
        info = SegmentInfo(0, seg, n, a, m, total, bounds)
        state.begin_backward(0, seg)
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(outs[seg], go[:, :, a : a + m])
        state.end_backward(0, seg)
    return outs, leaves


def segmented_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, go: torch.Tensor, lengths: Sequence[int]
) -> Grads:
    """:func:`segmented_run`'s outputs and gradients concatenated over the segments."""
    outs, leaves = segmented_run(q, k, v, go, lengths)
    grads = [torch.cat([leaf[i].grad for leaf in leaves], dim=2) for i in range(3)]  # type: ignore[misc]
    out = torch.cat([o.detach() for o in outs], dim=2)
    return out, grads[0], grads[1], grads[2]


def _timed(fn: Any, device: str) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call; on CUDA the wall time spans the kernels
    (synchronized before and after), the CPU time only the launches."""
    if device == "cuda":  # pragma: no cover - GPU only
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if device == "cuda":  # pragma: no cover - GPU only
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(cfg: Config, log: Any = None) -> list[Row]:
    """Every (length, K) case of ``cfg``; runs alternate segmented / unsegmented, so load
    from other jobs drifts over both alike."""
    rows: list[Row] = []
    for seq_len in cfg.lengths:
        q, k, v, go = _inputs(cfg, seq_len)
        for chunks in cfg.chunks:
            lengths = uniform_split(seq_len, chunks)
            seg_fn = functools.partial(segmented_run, q, k, v, go, lengths)  # timed: no cat
            ref_fn = functools.partial(unsegmented_step, q, k, v, go)
            seg_fn(), ref_fn()  # warm-up (kernel selection, allocator)
            seg_t, ref_t = [], []
            for _ in range(cfg.repeats):
                seg_t.append(_timed(seg_fn, cfg.device))
                ref_t.append(_timed(ref_fn, cfg.device))
            s, r = (statistics.median(t[0] for t in ts) for ts in (seg_t, ref_t))
            sc, rc = (statistics.median(t[1] for t in ts) for ts in (seg_t, ref_t))
            rows.append(
                Row(seq_len, chunks, s, r, s / r, sc, rc, sc / rc if rc > 0 else float("nan"),
                    [t[0] for t in seg_t], [t[0] for t in ref_t])
            )  # fmt: skip
            if log is not None:
                log(
                    f"{seq_len} tokens, K={chunks}: {s:.4f} s / {r:.4f} s = {s / r:.3f} "
                    f"(CPU time {sc / rc:.3f})"
                )
    return rows


def markdown(cfg: Config, rows: Sequence[Row], device_name: str) -> str:
    chunks = sorted({r.chunks for r in rows})
    lines = [
        f"Segmented / unsegmented time of one attention layer's forward + backward on "
        f"{device_name} ({cfg.dtype}, batch {cfg.batch}, {cfg.heads} heads, {cfg.kv_heads} K/V "
        f"heads, head dim {cfg.head_dim}; median of {cfg.repeats} runs each, alternating"
        + ("; in parentheses: the ratio of process CPU times" if cfg.device == "cpu" else "")
        + f"; load average {os.getloadavg()[0]:.1f}):",
        "",
        "| tokens | unsegmented (s) | " + " | ".join(f"K={k}" for k in chunks) + " |",
        "|---|---|" + "---|" * len(chunks),
    ]
    for seq_len in sorted({r.seq_len for r in rows}):
        by_k = {r.chunks: r for r in rows if r.seq_len == seq_len}
        ref = statistics.median(r.unsegmented_s for r in by_k.values())
        cells = " | ".join(_cell(by_k[k], cfg.device) if k in by_k else "—" for k in chunks)
        lines.append(f"| {seq_len} | {ref:.4f} | {cells} |")
    return "\n".join(lines)


def _cell(row: Row, device: str) -> str:
    """The wall ratio; on CPU also the CPU-time ratio (the one to trust on a busy machine)."""
    if device == "cpu":
        return f"{row.ratio:.3f} ({row.cpu_ratio:.3f})"
    return f"{row.ratio:.3f}"


def _device_name(device: str) -> str:
    if device == "cuda":  # pragma: no cover - GPU only
        return torch.cuda.get_device_name()
    return f"CPU ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_time.segment_overhead", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if any")
    ap.add_argument("--out", help="directory for segment_overhead.json / .md")
    ap.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default per device)")
    ap.add_argument("--chunks", type=int, nargs="+", help="segment counts (default 1 2 4 8)")
    ap.add_argument("--repeats", type=int, help="timed runs per case")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    cfg = Config.default(device)
    overrides: dict[str, Any] = {}
    if a.lengths:
        overrides["lengths"] = tuple(a.lengths)
    if a.chunks:
        overrides["chunks"] = tuple(a.chunks)
    if a.repeats:
        overrides["repeats"] = a.repeats
    cfg = Config(**{**asdict(cfg), **overrides})
    name = _device_name(device)
    rows = measure(cfg, log=lambda m: print(f"[segment_overhead] {m}", flush=True))
    table = markdown(cfg, rows, name)
    print(table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        result = {
            "device": name,
            "torch": torch.__version__,
            "load_average": os.getloadavg()[0],
            "config": asdict(cfg),
            "rows": [asdict(r) for r in rows],
        }
        with open(os.path.join(a.out, "segment_overhead.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "segment_overhead.md"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
