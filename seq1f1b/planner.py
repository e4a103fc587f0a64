"""Pick ``seq_chunks`` (K) and the split for a model, sequence length, pipeline and memory budget.

    python -m seq1f1b.planner --hidden 4096 --heads 32 --layers 32 --vocab 50304 \\
        --seq-len 32768 --pp 8 --microbatches 8 --memory-gb 40

Why: K trades bubble and activation memory (both shrink with K) against kernel efficiency
(shorter segments); the right K is the smallest one that fits the budget and gets close to the
best pipeline efficiency. Each candidate K is run through the cost-model simulator on the real
Seq1F1B order (:mod:`seq1f1b.simulate`), so bubble and per-stage peak memory come from the
schedule itself, not from a formula.

Memory model (per pipeline rank, bytes; documented so users can argue with it):

* activations per token per layer: ``(18*H + 4*F) * dtype_bytes / 2`` — Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", eq. (1) ``34*s*b*h``
  for FFN = 4H, without the ``5*a*s^2*b`` softmax term that flash attention does not store;
  divided by the tensor-parallel degree (sequence parallel);
* the last stage also keeps fp32 log-probabilities for the loss, ``4 * V`` bytes per token;
* model states: ``state_bytes_per_param`` (16 = bf16 weights and grads, fp32 master + Adam
  moments) times the stage's parameters ``L/pp * (4*H*h*d + 2*H*F)`` plus embedding / output
  layer on the first / last stage, divided by TP;
* a stage's activation peak = (peak tokens in flight on that stage, from the simulator) x
  per-token bytes. Cached K/V share storage with saved activations, so they add nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .order import OrderSpec, build_orders
from .partition import ModelShape, resolve_split
from .simulate import FlopsCosts, simulate

__all__ = ["Candidate", "MemoryModel", "Plan", "main", "plan"]

GB = 1e9
DEFAULT_CHUNKS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per token and per parameter; see the module docstring for the formulas."""

    dtype_bytes: int = 2
    state_bytes_per_param: float = 16.0
    tp: int = 1

    def activation_bytes_per_token(self, shape: ModelShape, layers: int, last: bool) -> float:
        ffn = shape.ffn_hidden or 4 * shape.hidden
        per_layer = (18 * shape.hidden + 4 * ffn) * self.dtype_bytes / 2
        logits = 4 * shape.vocab if last else 0
        return (layers * per_layer + logits) / self.tp

    def state_bytes(self, shape: ModelShape, layers: int, first: bool, last: bool) -> float:
        h, ffn, d = shape.hidden, shape.ffn_hidden or 4 * shape.hidden, shape.head_dim or 1
        params = layers * (4 * h * shape.n_heads * d + 2 * h * ffn)
        params += shape.vocab * h * (int(first) + int(last))
        return params * self.state_bytes_per_param / self.tp


@dataclass(frozen=True)
class Candidate:
    """Predictions for one K (``time_vs_1f1b``: simulated step time over K=1's)."""

    seq_chunks: int
    split: str
    segment_lengths: list[int]
    bubble_ratio: float
    makespan_flops: float
    time_vs_1f1b: float
    peak_bytes: list[float]  # per stage: model states + activation peak

    @property
    def max_bytes(self) -> float:
        return max(self.peak_bytes)

    @property
    def worst_stage(self) -> int:
        return self.peak_bytes.index(self.max_bytes)


@dataclass(frozen=True)
class Plan:
    """All candidates and the recommended one (None if no K fits the budget)."""

    candidates: list[Candidate]
    recommended: Candidate | None
    budget_bytes: float
    pp: int
    min_segment: int = 1
    tp: int = 1
    microbatches: int = 1
    seq_len: int = 0

    def toml(self) -> str:
        """Lines to paste into a torchtitan TOML (the recommended K, or the smallest-memory):
        every setting the plan assumed, so the pasted config reproduces it."""
        c = self.recommended or min(self.candidates, key=lambda c: c.max_bytes)
        note = [] if self.recommended else ["# no K fits the budget: this is the lowest-memory K"]
        return "\n".join(
            [
                *note,
                "[training]",
                f"seq_len = {self.seq_len}",
                f"local_batch_size = {self.microbatches}   # M microbatches of one sequence",
                "",
                "[parallelism]",
                f"pipeline_parallel_degree = {self.pp}",
                f"tensor_parallel_degree = {self.tp}",
                'pipeline_parallel_schedule = "Seq1F1B"',
                "pipeline_parallel_microbatch_size = 1",
                "",
                "[seq1f1b]",
                f"seq_chunks = {c.seq_chunks}",
                f'split = "{c.split}"',
            ]
        )


def _candidate(
    shape: ModelShape,
    seq_len: int,
    pp: int,
    m: int,
    k: int,
    split: str,
    memory: MemoryModel,
    base_makespan: float | None,
) -> Candidate:
    lengths = resolve_split(split, seq_len, k, shape=shape, multiple_of=memory.tp)
    costs = FlopsCosts(shape, tuple(lengths), pp, pp)
    res = simulate(build_orders(OrderSpec(pp, 1, m, k)), costs.cost, activation=costs.activation)
    layers = shape.n_layers // pp
    peaks = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        tokens = res.peak_activation_stage.get(s, 0.0) * seq_len  # peak is in samples (A)
        act = tokens * memory.activation_bytes_per_token(shape, layers, last)
        peaks.append(memory.state_bytes(shape, layers, first, last) + act)
    base = base_makespan or res.makespan
    return Candidate(
        k,
        split if k > 1 else "uniform",
        lengths,
        res.bubble_ratio,
        res.makespan,
        res.makespan / base,
        peaks,
    )


def plan(
    shape: ModelShape,
    seq_len: int,
    pp: int,
    microbatches: int,
    budget_bytes: float,
    *,
    chunks: Sequence[int] = DEFAULT_CHUNKS,
    split: str = "compute",
    memory: MemoryModel | None = None,
    min_segment: int = 4096,
    tolerance: float = 0.02,
) -> Plan:
    """Evaluate each K; recommend the smallest fitting K within ``tolerance`` of the best time.

    The FLOPs model does not price what short segments cost on real hardware (GEMMs and
    attention kernels below full efficiency, one more p2p round trip and kernel launches per
    unit), so it always favours more segments. Hence two heuristics: K is only recommended if
    segments average at least ``min_segment`` tokens, and among those that fit the budget the
    fewest segments within ``tolerance`` (2%) of the fastest are taken.
    """
    if shape.n_layers % pp:
        raise ValueError(
            f"layers={shape.n_layers} is not divisible by pp={pp}: the planner assumes equal "
            "stages; pick a pp that divides the layer count"
        )
    memory = memory or MemoryModel()
    ks = sorted({1, *(k for k in chunks if 1 <= k <= seq_len // memory.tp)})
    base = _candidate(shape, seq_len, pp, microbatches, 1, split, memory, None)
    cands = [base] + [
        _candidate(shape, seq_len, pp, microbatches, k, split, memory, base.makespan_flops)
        for k in ks
        if k > 1
    ]
    fitting = [
        c
        for c in cands
        if c.max_bytes <= budget_bytes
        and (c.seq_chunks == 1 or seq_len / c.seq_chunks >= min_segment)
    ]
    rec = None
    if fitting:
        best = min(c.time_vs_1f1b for c in fitting)
        rec = min(
            (c for c in fitting if c.time_vs_1f1b <= best * (1 + tolerance)),
            key=lambda c: c.seq_chunks,
        )
    return Plan(cands, rec, budget_bytes, pp, min_segment, memory.tp, microbatches, seq_len)


def format_plan(p: Plan, seq_len: int) -> str:
    """Human-readable table, recommendation and TOML lines."""
    lines = [
        f"{'K':>3}  {'split':8} {'bubble':>7} {'time vs 1F1B':>12} {'peak GB':>8} {'stage':>5}"
        "  fits  segment lengths"
    ]
    for c in p.candidates:
        seg = str(c.segment_lengths) if len(c.segment_lengths) <= 8 else f"{c.segment_lengths[:4]}…"
        fits = "yes" if c.max_bytes <= p.budget_bytes else "no"
        if c.seq_chunks > 1 and seq_len / c.seq_chunks < p.min_segment:
            fits += "*"
        lines.append(
            f"{c.seq_chunks:>3}  {c.split:8} {c.bubble_ratio:>7.3f} {c.time_vs_1f1b:>12.3f} "
            f"{c.max_bytes / GB:>8.1f} {c.worst_stage:>5}  {fits:4}  {seg}"
        )
    lines.append(f"(* segments shorter than --min-segment {p.min_segment} tokens: not recommended)")
    lines.append("")
    if p.recommended is not None:
        r = p.recommended
        lines.append(
            f"Recommendation: seq_chunks = {r.seq_chunks}, split = {r.split!r}: predicted bubble "
            f"{r.bubble_ratio:.3f} (1F1B {p.candidates[0].bubble_ratio:.3f}), step time "
            f"{r.time_vs_1f1b:.2f}x 1F1B, peak {r.max_bytes / GB:.1f} GB on stage "
            f"{r.worst_stage} (budget {p.budget_bytes / GB:.1f} GB)."
        )
    else:
        low = min(p.candidates, key=lambda c: c.max_bytes)
        lines.append(
            f"No K fits {p.budget_bytes / GB:.1f} GB at seq_len {seq_len}: the lowest is "
            f"{low.max_bytes / GB:.1f} GB with K={low.seq_chunks} (min segment "
            f"{p.min_segment} tokens). Add activation "
            "checkpointing, tensor parallelism or more pipeline stages, or shorten the sequence."
        )
    lines += ["", "TOML:", p.toml()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m seq1f1b.planner",
        description="Pick seq_chunks (K) and the split for a model, sequence length, pipeline "
        "degree and memory budget; prints the simulated candidates and TOML lines.",
    )
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--ffn-hidden", type=int, default=None, help="default 4*hidden")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True, help="M per step")
    ap.add_argument("--memory-gb", type=float, required=True, help="per-GPU budget (1e9 bytes)")
    ap.add_argument(
        "--chunks",
        default=",".join(map(str, DEFAULT_CHUNKS)),
        help="comma-separated K values to try (segments per sample)",
    )
    ap.add_argument("--split", choices=("compute", "uniform"), default="compute")
    ap.add_argument(
        "--min-segment", type=int, default=4096, help="shortest average segment to recommend"
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor/sequence parallel degree")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="activation dtype size")
    ap.add_argument("--state-bytes-per-param", type=float, default=16.0, help="0: activations only")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    try:
        shape = ModelShape(a.hidden, a.heads, a.layers, a.vocab, ffn_hidden=a.ffn_hidden)
        memory = MemoryModel(a.dtype_bytes, a.state_bytes_per_param, a.tp)
        chunks = [int(x) for x in a.chunks.split(",") if x.strip()]
        p = plan(
            shape,
            a.seq_len,
            a.pp,
            a.microbatches,
            a.memory_gb * GB,
            chunks=chunks,
            split=a.split,
            memory=memory,
            min_segment=a.min_segment,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(
            json.dumps(
                {
                    "candidates": [asdict(c) for c in p.candidates],
                    "recommended": asdict(p.recommended) if p.recommended else None,
                    "toml": p.toml(),
                },
                indent=2,
            )
        )
        return 0
    ffn = shape.ffn_hidden
    per_tok = memory.activation_bytes_per_token(shape, 1, False)
    print(
        f"model H={shape.hidden} heads={shape.n_heads} layers={shape.n_layers} "
        f"vocab={shape.vocab} ffn={ffn}; seq_len {a.seq_len}, pp {a.pp}, M {a.microbatches}, "
        f"budget {a.memory_gb:g} GB\nmemory model: {per_tok / 1e3:.1f} KB activations per "
        f"token per layer, {a.state_bytes_per_param:g} B of model state per parameter\n"
    )
    print(format_plan(p, a.seq_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
