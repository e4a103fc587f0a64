"""Context parallelism with Seq1F1B: memory and ring traffic per rank (measured), the bytes
formula, and the longest sequence a memory budget allows (simulated, 8B shape).

Why: CP and Seq1F1B both cut the sequence; the question a user has is what the combination
costs in communication and what it buys in memory and sequence length, against plain CP and
plain Seq1F1B at the same length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning.costmodel import PRESETS as SHAPES
from seq1f1b.planning.costmodel import Hardware, MemoryModel
from seq1f1b.planning.simulate import FlopsCosts, simulate
from seq1f1b.schedules.partition import ModelShape, uniform_split
from seq1f1b.testing import TinyConfig

from ..harness.measured import RunSpec, Setting, measure
from ..harness.presets import Preset

__all__ = ["cp_bytes", "longest_sequences", "measure_cp"]


def cp_bytes(
    cfg: TinyConfig,
    lengths: Sequence[int],
    cp: int,
    prefix: str,
    samples: int,
    rows_per_sample: int,
    layers: int,
    dtype_bytes: int = 4,
    wide_bytes: int = 4,
) -> dict[str, int]:
    """Bytes one CP rank sends per step for ``layers`` attention layers, as implemented
    (:mod:`seq1f1b.attention.context_parallel`): per segment of ``l = L/c`` local tokens, with a
    visible prefix of ``p = P/c`` local tokens, ``h``/``g`` query/K-V heads of width ``d``, ``c -
    1`` hops each way:

    * own K/V ring: forward ``2 l g d b``, backward ``2 l g d (b + w)`` (blocks, then their
      gradient accumulators, which return home);
    * pass-Q: forward Q, then the partial output and LSE, ``l h (d b + d w + w)``; backward
      Q, dO, O, LSE and the returning dQ, ``l h (3 d b + w + d w)``;
    * pass-KV: forward ``2 p g d b``, backward ``2 p g d (b + w)``.

    ``prefix`` "auto" picks per segment as the schedule does (``l h <= p g``: pass-Q).
    """
    h, g = cfg.n_heads, cfg.n_kv_heads
    d = cfg.dim // h
    b, w, hops = dtype_bytes, wide_bytes, cp - 1
    out = {"own_kv": 0, "prefix": 0}
    for k, seg in enumerate(lengths):
        loc, pre = seg // cp, sum(lengths[:k]) // cp
        out["own_kv"] += hops * (2 * loc * g * d * b + 2 * loc * g * d * (b + w))
        if not pre:
            continue
        by_q = prefix == "pass_q" or (prefix == "auto" and seg * h <= sum(lengths[:k]) * g)
        if by_q:
            fwd = loc * h * (d * b + d * w + w)
            bwd = loc * h * (3 * d * b + w + d * w)
        else:
            fwd, bwd = 2 * pre * g * d * b, 2 * pre * g * d * (b + w)
        out["prefix"] += hops * (fwd + bwd)
    scale = samples * rows_per_sample * layers
    return {key: v * scale for key, v in out.items()}


def measure_cp(preset: Preset, timed_steps: int | None = None) -> dict[str, Any]:
    """pp=2 x cp=2 (4 ranks) against pp=2 alone, M=2, the preset's first length: Seq1F1B K=4
    with each prefix mode, and CP without Seq1F1B (K=1)."""
    seq_len = preset.seq_lens[0]
    steps = preset.timed_steps if timed_steps is None else timed_steps
    cp_specs = (
        RunSpec("Seq1F1B", 4, "uniform", cp_prefix="pass_q"),
        RunSpec("Seq1F1B", 4, "uniform", cp_prefix="pass_kv"),
        RunSpec("Seq1F1B", 4, "uniform"),
        RunSpec("Seq1F1B", 1, "uniform"),
    )
    pp_specs = (RunSpec("Seq1F1B", 4, "uniform"), RunSpec("Seq1F1B", 1, "uniform"))
    runs = []
    for cp, specs in ((2, cp_specs), (1, pp_specs)):
        setting = Setting(2, 2, seq_len, preset.model, specs, steps, keep_trace=False, cp=cp)
        runs += measure(setting)
    cfg = preset.model
    layers = cfg.n_layers // 2  # stage 0 of 2
    for r in runs:
        r.pop("trace", None)
        r.pop("step_traces", None)
        if r["cp"] > 1:
            mode = "auto" if "pass_" not in r["label"] else r["label"].rsplit(", ", 1)[1]
            lengths = uniform_split(seq_len, r["seq_chunks"])
            r["cp_formula_bytes"] = cp_bytes(cfg, lengths, r["cp"], mode, 2, 1, layers)
    return {"seq_len": seq_len, "pp": 2, "microbatches": 2, "runs": runs}


def longest_sequences(
    shape: ModelShape = SHAPES["llama3-8b"],
    gpus: int = 8,
    memory_gb: float = 80.0,
    settings: Sequence[tuple[int, int, int]] = (
        (8, 1, 1),
        (8, 1, 8),
        (1, 8, 1),
        (4, 2, 1),
        (4, 2, 4),
        (4, 2, 8),
        (2, 4, 4),
        (2, 4, 8),
    ),
    recompute: Sequence[bool] = (False, True),
    granule: int = 1024,
) -> list[dict[str, Any]]:
    """Longest sequence (multiple of ``granule``) whose peak per-GPU memory fits, for each
    (pp, cp, K) on ``gpus`` GPUs; M = pp microbatches (1 without PP: one sample at a time).

    Per rank, CP divides every activation and the K/V cache by ``cp``; FSDP over the CP ranks
    (torchtitan's mesh) divides the model state by ``cp`` as well; the ring adds one received
    K/V block of a segment shard per layer in flight (a transient, counted).
    """
    hw = Hardware(gpus, memory_gb)
    rows = []
    for pp, cp, k in settings:
        if pp * cp != gpus or shape.n_layers % pp:
            raise ValueError(f"pp={pp} x cp={cp} must be {gpus} GPUs and divide the layers")
        layers = shape.n_layers // pp
        m = pp if pp > 1 else 1
        if pp > 1:
            costs = FlopsCosts(shape, tuple(uniform_split(k * 64, k)), pp, pp)
            orders = build_orders(OrderSpec(pp, 1, m, k))
            res = simulate(orders, lambda a: 1.0, activation=costs.activation)
            in_flight = [res.peak_activation_stage.get(s, 0.0) for s in range(pp)]
        else:
            in_flight = [1.0]
        for rc in recompute:
            memory = MemoryModel(shape, 1, cp, rc)
            best = None
            for s in range(pp):
                first, last = s == 0, s == pp - 1
                state = memory.state_bytes(layers, first, last)
                # per sequence token, per rank: activations of the tokens in flight and one
                # unit's transient (1/K of the sequence), all divided by cp
                act = memory.activation_bytes(in_flight[s], 1 / k, layers, last, k > 1) / cp
                ring = 2 * 2 * shape.n_kv_heads * shape.head_dim / (k * cp)  # K, V, bf16
                free = hw.budget_bytes - state
                tokens = free / (act + ring) if free > 0 else 0.0
                best = tokens if best is None else min(best, tokens)
            step = math.lcm(granule, 2 * cp * k)
            longest = int((best or 0.0) // step * step)
            rows.append(
                {
                    "pp": pp,
                    "cp": cp,
                    "seq_chunks": k,
                    "recompute": rc,
                    "longest_tokens": longest,
                    "label": _label(pp, cp, k),
                }
            )
    return rows


def _label(pp: int, cp: int, k: int) -> str:
    if pp == 1:
        return f"plain CP (cp={cp})"
    parts = [f"pp={pp}"] + ([f"cp={cp}"] if cp > 1 else [])
    name = f"Seq1F1B K={k}" if k > 1 else "1F1B"
    return f"{name}, {' x '.join(parts)}"
