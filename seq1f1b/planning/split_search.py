"""The ``"memory_capped"`` split: the fastest segment lengths whose activation peak fits a cap.

Why: the uniform split keeps the fewest tokens in flight but its later segments cost more under
causal attention, so the pipeline waits on them; the compute-balanced split evens the cost out
by making the first segments long, which raises the activation peak. Which lengths are best
depends on the real order (its warm-up decides which units are in flight together), so this
module asks the simulator: it runs the schedule's own ``pipeline_order`` with
:class:`~seq1f1b.planning.simulate.FlopsCosts` and keeps the split with the smallest simulated step
time whose per-stage activation peak is at most ``cap`` times the uniform split's.

Memory of a stage = peak tokens in flight times that stage's bytes per token: the same for
every stage's layers, plus, on the last stage, the loss's fp32 log-probabilities (``4*V`` bytes
per token, :class:`~seq1f1b.planning.costmodel.MemoryModel`). That term matters: the last stage
holds one whole sample at some point under any split (a sample's last segment runs its forward
before any of that sample's backwards), so with a heavy output layer the last stage, not the first,
sets the peak.

Any split is exact (the equivalence tests cover uneven lengths), so this only picks lengths.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..orders.order import OrderSpec, build_orders
from ..orders.order_v import build_v_orders
from ..schedules.options import SequenceSplit
from ..schedules.partition import ModelShape, compute_balanced_split, uniform_split
from .costmodel import MemoryModel
from .simulate import FlopsCosts, simulate

__all__ = [
    "CappedSplit",
    "MemoryCappedSplit",
    "checked_cap",
    "memory_capped_split",
    "search_capped_split",
    "stage_token_bytes",
]

#: simulator calls one search may make: about 1 s at pp=2, M=2, K=8, about 20 s at pp=8,
#: M=16, K=8 (a deterministic count, not a clock, so every rank finds the same lengths)
MAX_EVALUATIONS = 800
#: coarsest and finest step of the local search: seq_len / (K * this)
_COARSEST = 16
_FINEST = 128


@dataclass(frozen=True)
class CappedSplit:
    """What the search found, with the uniform split it is measured against.

    ``peak``/``uniform_peak``: the largest per-stage activation peak in bytes per sample token
    (see :func:`stage_token_bytes`) times tokens in flight, divided by the sequence length;
    ``time``/``uniform_time``: simulated step time (FLOPs). ``fallback``: why the uniform split
    was kept, or None when the search found a faster split under the cap.
    """

    lengths: list[int]
    time: float
    peak: float
    uniform_time: float
    uniform_peak: float
    cap: float
    evaluations: int
    fallback: str | None


def stage_token_bytes(shape: ModelShape, num_stages: int, dtype_bytes: int = 2) -> list[float]:
    """Saved-activation bytes per token in flight on each stage (its share of the layers, the
    last stage's loss state on top), so the cap compares stages in bytes, not tokens."""
    model = MemoryModel(shape, dtype_bytes=dtype_bytes)
    layers = shape.n_layers / num_stages
    return [
        model.activation_bytes(1.0, 0, layers, s == num_stages - 1, True) for s in range(num_stages)
    ]


def checked_cap(cap: float) -> float:
    """``cap`` as a float if it is a number > 0, else a ValueError naming the fix."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(
            f"memory_cap must be a number > 0 (got {cap!r}): it is the allowed activation peak "
            "as a multiple of the uniform split's, e.g. 1.0 (the uniform split's memory) or 1.2"
        )
    return float(cap)


def search_capped_split(
    seq_len: int,
    k: int,
    shape: ModelShape,
    order: OrderSpec,
    *,
    multiple_of: int = 1,
    cap: float = 1.0,
    dtype_bytes: int = 2,
    max_evaluations: int = MAX_EVALUATIONS,
) -> CappedSplit:
    """Search segment lengths (multiples of ``multiple_of``) minimising the simulated step time
    of ``order``'s schedule subject to peak <= ``cap`` x the uniform split's peak.

    Start: the best of the uniform split, the compute-balanced split, points between them and
    symmetric splits that meet the cap; then move tokens between segments (see
    :func:`_moves`; steps from ``seq_len / (16 K)`` down to ``multiple_of``) while that lowers
    the time under the cap.
    Deterministic, so every rank gets the same lengths.
    """
    if not isinstance(shape, ModelShape):
        raise ValueError(
            "seq_split='memory_capped' needs the model shape to simulate step time: pass "
            "model_shape=ModelShape(hidden=..., n_heads=..., n_layers=..., vocab=...)"
        )
    cap = checked_cap(cap)
    if order.seq_chunks != k:
        raise ValueError(
            f"the order has seq_chunks={order.seq_chunks} but the split asks for {k} segments: "
            f"build the OrderSpec with seq_chunks={k}"
        )
    uniform = uniform_split(seq_len, k, multiple_of)
    weights = stage_token_bytes(shape, order.num_stages, dtype_bytes)
    orders = build_v_orders(order) if order.placement == "v" else build_orders(order)
    cache: dict[tuple[int, ...], tuple[float, float]] = {}

    def evaluate(lengths: Sequence[int]) -> tuple[float, float]:
        key = tuple(lengths)
        if key not in cache:
            costs = FlopsCosts(shape, key, order.num_stages, order.pp)
            res = simulate(orders, costs.cost, activation=costs.activation)
            # activation() is in samples of a rank's layers; weight each stage by its bytes
            peak = max(weights[s] * v for s, v in res.peak_activation_stage.items())
            cache[key] = (res.makespan, peak)
        return cache[key]

    u_time, u_peak = evaluate(uniform)
    limit = cap * u_peak * (1 + 1e-12)
    if k == 1:
        return CappedSplit(uniform, u_time, u_peak, u_time, u_peak, cap, 1, "seq_chunks=1")
    best, (b_time, b_peak) = list(uniform), (u_time, u_peak)

    def consider(lengths: list[int]) -> bool:
        nonlocal best, b_time, b_peak
        if len(cache) >= max_evaluations:
            return False
        t, p = evaluate(lengths)
        if p <= limit and t < b_time * (1 - 1e-12):
            best, b_time, b_peak = lengths, t, p
            return True
        return False

    for start in _start_points(seq_len, k, shape, multiple_of, uniform):
        consider(start)
    step = max(multiple_of, seq_len // (k * _COARSEST) // multiple_of * multiple_of)
    finest = max(multiple_of, seq_len // (k * _FINEST))
    while step >= finest and len(cache) < max_evaluations:
        improved = True
        while improved and len(cache) < max_evaluations:
            improved = False
            for moves in _moves(k):
                moved = list(best)
                for i, j in moves:
                    moved[i] += step
                    moved[j] -= step
                if min(moved) >= multiple_of:
                    improved = consider(moved) or improved
        step = step // 2 // multiple_of * multiple_of
    fallback = None
    if best == uniform:
        fallback = (
            f"no split is faster than the uniform one with an activation peak within {cap:g}x "
            "of it; raise memory_cap to trade memory for time"
        )
    return CappedSplit(best, b_time, b_peak, u_time, u_peak, cap, len(cache), fallback)


def _moves(k: int) -> list[tuple[tuple[int, int], ...]]:
    """Token moves (to ``i`` from ``j``) tried at each step: one pair; a pair with its mirror
    image (keeps a symmetric split symmetric: with pp=2 the last stage's peak stays at one
    sample only if every prefix of the split is no longer than the suffix of the same count);
    two donors to one segment (K <= 4: there are K**3 of them)."""
    pairs = [(i, j) for i in range(k) for j in range(k) if i != j]
    mirrored = [((i, j), (k - 1 - i, k - 1 - j)) for i, j in pairs if i + j != k - 1]
    donors = [((i, j), (i, h)) for i in range(k) for j in range(k) for h in range(j + 1, k)
              if i not in (j, h) and k <= 4]  # fmt: skip
    return [((i, j),) for i, j in pairs] + mirrored + donors


def _start_points(
    seq_len: int, k: int, shape: ModelShape, multiple_of: int, uniform: list[int]
) -> list[list[int]]:
    """The compute-balanced split, 9 splits between it and the uniform one, and symmetric
    splits short at both ends (cheap first and last segments, the uniform one's peak)."""
    compute = compute_balanced_split(seq_len, k, shape, multiple_of)
    out = [compute, *_symmetric(seq_len, k, multiple_of)]
    for tenth in range(1, 10):
        mixed = [
            round((u + (c - u) * tenth / 10) / multiple_of) * multiple_of
            for u, c in zip(uniform, compute, strict=True)
        ]
        mixed[0] += seq_len - sum(mixed)  # the first segment absorbs rounding
        if min(mixed) >= multiple_of:
            out.append(mixed)
    return out


def _symmetric(seq_len: int, k: int, multiple_of: int) -> list[list[int]]:
    """Palindromic splits whose lengths grow linearly towards the middle, by 5% to 50%."""
    out = []
    for pct in range(5, 55, 5):
        ramp = [1 + pct / 100 * min(i, k - 1 - i) / max(1, (k - 1) / 2) for i in range(k)]
        total = sum(ramp)
        lengths = [round(seq_len * r / total / multiple_of) * multiple_of for r in ramp]
        lengths[k // 2] += seq_len - sum(lengths)  # the middle absorbs rounding
        if min(lengths) >= multiple_of:
            out.append(lengths)
    return out


def memory_capped_split(
    seq_len: int,
    k: int,
    shape: ModelShape,
    order: OrderSpec,
    *,
    multiple_of: int = 1,
    cap: float = 1.0,
    dtype_bytes: int = 2,
    warn: Callable[[str], None] | None = None,
) -> list[int]:
    """Lengths of :func:`search_capped_split`; ``warn`` hears why when the uniform split is
    kept."""
    found = search_capped_split(
        seq_len, k, shape, order, multiple_of=multiple_of, cap=cap, dtype_bytes=dtype_bytes
    )
    if found.fallback and warn is not None and k > 1:
        warn(f"seq_split='memory_capped' keeps the uniform split {found.lengths}: {found.fallback}")
    return found.lengths


@dataclass(frozen=True)
class MemoryCappedSplit(SequenceSplit):
    """``seq_split="memory_capped"``: the lengths with the smallest simulated step time whose
    activation peak, on every stage, stays within ``memory_cap`` times the uniform split's
    (:func:`memory_capped_split`, on the schedule's own order). A :class:`SequenceSplit`
    resolved here, in the planning layer, and handed to the schedule, which never imports the
    simulator itself.

    Args (besides SequenceSplit's ``model_shape`` (needed), ``multiple_of``, ``seq_len``):
        memory_cap: allowed per-stage activation peak as a multiple of the uniform split's
            (1.0: the uniform split's memory, faster where possible).
        dtype_bytes: bytes of an activation element (2 for bf16, 4 for fp32); weighs the last
            stage's fp32 loss state against the layers'.
    """

    mode: str | tuple[int, ...] = "memory_capped"
    memory_cap: float = 1.0
    dtype_bytes: int = 2

    simulates_order = True

    def check(self, seq_chunks: int) -> None:
        if self.mode != "memory_capped":
            raise ValueError(
                f"MemoryCappedSplit has mode {self.mode!r}: it is the 'memory_capped' split; "
                "use SequenceSplit for the others"
            )
        super().check(seq_chunks)
        checked_cap(self.memory_cap)
        if self.dtype_bytes not in (1, 2, 4, 8) or isinstance(self.dtype_bytes, bool):
            raise ValueError(
                f"dtype_bytes must be 1, 2, 4 or 8 (got {self.dtype_bytes!r}): pass 2 "
                "for bf16/fp16 activations, 4 for fp32"
            )

    def _capped(
        self, seq_len: int, seq_chunks: int, multiple: int, order: OrderSpec | None
    ) -> list[int]:
        """The memory-capped search for the schedule's ``order`` (warns when it keeps uniform)."""
        if order is None:
            raise ValueError(
                "seq_split='memory_capped' simulates the schedule's order: hand this split to "
                "ScheduleSeq1F1B(..., seq_split=MemoryCappedSplit(...)), or call "
                "seq1f1b.planning.split_search.memory_capped_split with an OrderSpec"
            )
        assert self.model_shape is not None  # check() ran at construction
        return memory_capped_split(
            seq_len,
            seq_chunks,
            self.model_shape,
            order,
            multiple_of=multiple,
            cap=self.memory_cap,
            dtype_bytes=self.dtype_bytes,
            warn=lambda msg: warnings.warn(msg, stacklevel=4),
        )
