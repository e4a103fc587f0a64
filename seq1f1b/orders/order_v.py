"""Per-rank orders of ZBV-Seq1F1B: Seq1F1B's (sample, segment) units on the ZB-V placement.

Placement ("v", as torch's ``ScheduleZBVZeroBubble``): ``2p`` stages, rank ``r`` holds stage
``r`` (its chunk 0) and stage ``2p-1-r`` (its chunk 1), so rank 0 holds both the first and the
last stage and a microbatch's path goes down the ranks and back up. Every backward is split
into its input half (I, sent upstream at once) and its weight half (W), which fills the bubbles
(Qi et al., "Zero Bubble Pipeline Parallelism", section 6).

The order of one rank is the ZB-V order (:func:`zbv_slots`) over ``n = N + K - 1`` slots
(``N = M*K`` units), with its slots relabelled:

* forward slot ``i`` runs unit ``i`` (slots ``i >= N`` are dropped);
* backward slot ``j`` (its I and its W) runs the ``(j-K+1)``-th entry of the backward unit
  order (:func:`seq1f1b.orders.order.backward_unit_order`: samples FIFO, segments last-first); slots
  ``j < K-1`` and ``j >= N+K-1`` are dropped;
* on the first stage, which has no input gradient, the two halves are one full backward at the
  weight half's place (nothing waits for it, so it fills the cool-down).

Why the shift of ``K - 1``: a sample's first backward on the last stage runs its *last*
segment, so the last stage must have forwarded every segment of the sample before it; in the
ZB-V order backward slot ``j`` on the last stage follows forward slot ``j`` alone. Shifting the
backwards by ``K - 1`` slots makes backward slot ``j`` handle a unit ``<= j`` (the ``K - 1``
extra warm-up forwards of Seq1F1B, here in the V).

Why it cannot deadlock: the ZB-V order is deadlock-free (there is a global order of its actions
that keeps every rank's program order and every dependency). Relabelling keeps every cross-rank
dependency of the template (backward slot ``j`` of stage ``s`` needs backward slot ``j`` of the
next stage, forward slot ``i`` the previous stage's forward slot ``i``), dropping slots removes
actions on every stage alike, and the one new dependency, backward slot ``j`` on forward of a
unit ``<= j`` of the same stage, points backwards in that rank's program order (the template's
forward slot ``j`` precedes its backward slot ``j``). So the same global order still works.
``tests/test_order_v.py`` replays the grid as well.

Memory (units in flight, i.e. forwarded and not yet through their weight half), by program
order, so whatever the timing: at most ``min(N, 2p - 1 - s + K)`` on stage ``s``
(:func:`v_stage_peak_units`) and ``min(2N, 2p + 2K - 2)`` on a rank's two stages together
(:func:`rank_peak_units`). A unit is ``1/K`` of a sample on half of a rank's layers, so every
rank holds at most ``(p + K - 1) / K`` samples' activations: Seq1F1B's stage-0 peak, which
Seq1F1B reaches on its first rank only and ZBV-Seq1F1B on every rank (both bounds are reached
when ``M >= 2`` and ``N >= 2p + K``).
"""

from __future__ import annotations

from collections.abc import Iterator

from .._runtime import ir as rt
from .._runtime.ir import Action
from .order import OrderSpec, backward_unit_order

__all__ = ["build_v_orders", "rank_peak_units", "v_rank_order", "v_stage_peak_units", "zbv_slots"]

F = rt.FORWARD
B = rt.FULL_BACKWARD
I = rt.BACKWARD_INPUT  # noqa: E741 - torch's letter for the action
W = rt.BACKWARD_WEIGHT


def zbv_slots(pp: int, rank: int, n: int) -> Iterator[tuple[int, object, int]]:
    """The ZB-V order of one rank as ``(chunk, kind, slot)``; ``kind`` is F, I or W.

    Phases (with ``F0``/``F1`` a forward of chunk 0/1, ``I``/``W`` the backward halves):
    ``2(p-r)-1`` F0; ``r`` times F1 F0; ``p-r`` times F1 I1 W1; then F0 I0 W0 F1 I1 W1 until
    both chunks have forwarded all ``n`` slots; the cool-down runs the remaining I's, W1's
    deferred to the end (they fill the bubbles), W0 after each I0 for the last ``p-r``.
    ``n`` is at least ``2p - 1`` (the warm-up's length).
    """
    f, b, w = [0, 0], [0, 0], [0, 0]

    def forward(c: int) -> tuple[int, object, int]:
        f[c] += 1
        return c, F, f[c] - 1

    def inputs(c: int) -> tuple[int, object, int]:
        b[c] += 1
        return c, I, b[c] - 1

    def weights(c: int) -> tuple[int, object, int]:
        w[c] += 1
        return c, W, w[c] - 1

    p, r = pp, rank
    for _ in range(2 * (p - r) - 1):
        yield forward(0)
    for _ in range(r):
        yield forward(1)
        yield forward(0)
    for _ in range(p - r):
        yield forward(1)
        yield inputs(1)
        yield weights(1)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            yield forward(0)
        yield inputs(0)
        yield weights(0)
        yield forward(1)
        yield inputs(1)
        yield weights(1)
    for _ in range(r):
        yield inputs(0)
        yield inputs(1)
    for _ in range(p - r):
        yield inputs(0)
        yield weights(0)
    while w[1] < b[1]:
        yield weights(1)
    while w[0] < b[0]:
        yield weights(0)


def v_rank_order(spec: OrderSpec, rank: int) -> list[Action]:
    """The compute-only ZBV-Seq1F1B order of one rank (see the module docstring); ``spec``
    has the V placement (``OrderSpec(..., stages_per_rank=2, placement="v")``)."""
    p, k, n_units = spec.pp, spec.seq_chunks, spec.n_units
    shift = k - 1
    slots = max(2 * p - 1, n_units + shift)
    back = backward_unit_order(range(n_units), k)
    stages = spec.stages_of(rank)
    out: list[Action] = []
    for chunk, kind, slot in zbv_slots(p, rank, slots):
        stage = stages[chunk]
        if kind == F:
            if slot < n_units:
                out.append(Action(stage, F, slot))
            continue
        j = slot - shift
        if not 0 <= j < n_units:
            continue
        if stage == 0:  # no input gradient: one full backward where the weight half was
            if kind == W:
                out.append(Action(stage, B, back[j]))
            continue
        out.append(Action(stage, kind, back[j]))
    return out


def build_v_orders(spec: OrderSpec) -> dict[int, list[Action]]:
    """ZBV-Seq1F1B orders for every rank (two stages per rank, V placement)."""
    if spec.placement != "v":
        raise ValueError(f"ZBV-Seq1F1B orders need the V placement (got {spec.placement!r})")
    return {r: v_rank_order(spec, r) for r in range(spec.pp)}


def v_stage_peak_units(pp: int, n_microbatches: int, seq_chunks: int, stage: int) -> int:
    """Most units stage ``stage`` holds at once in ZBV-Seq1F1B: ``min(N, 2p - 1 - s + K)``.

    A unit is held from its forward to its weight half (the full backward on stage 0). By
    program order: stage ``s``'s first backward slot comes after ``2p - 1 - s`` forward slots
    of the template plus Seq1F1B's ``K - 1``, and from then on every forward is followed by one
    backward; the bound is reached when ``N`` allows (``tests/test_order_v.py``).
    """
    return min(n_microbatches * seq_chunks, 2 * pp - 1 - stage + seq_chunks)


def rank_peak_units(pp: int, n_microbatches: int, seq_chunks: int) -> int:
    """Most units one rank's two stages hold at once: ``min(2N, 2p + 2K - 2)`` (``N = M*K``).

    Units of ``1/K`` sample on half of the rank's layers, so ``(p + K - 1) / K`` samples of
    the rank's activations: Seq1F1B's first-stage peak, on every rank.
    """
    n = n_microbatches * seq_chunks
    return min(2 * n, 2 * pp + 2 * seq_chunks - 2)
