"""Per-rank compute orders for Seq1F1B, in torch.distributed.pipelining's action IR.

A *unit* is one (sample microbatch ``m``, sequence segment ``k``) pair; its index in the IR is
``u = m * K + k``. Every order built here obeys the Seq1F1B rules on every stage:

* forwards of a sample run segment 0..K-1, backwards run K-1..0 (later segments attend to the
  K/V of earlier ones, so their backward produces gradient the earlier segments still need);
* samples are FIFO;
* FORWARD and FULL_BACKWARD actions; with ``split_backward`` (ZBSeq1F1B), BACKWARD_INPUT then
  BACKWARD_WEIGHT instead of FULL_BACKWARD on every stage but the first (the attention
  accumulates the cached K/V gradients itself, so the input half keeps them exact).

Each rank's list is computed on its own in closed form (:func:`rank_order`), as torch's
``_calculate_single_rank_operations`` does: 1F1B with a fixed warm-up (Seq1F1B's for one
stage per rank, torch's interleaved one plus ``K - 1`` for several), which provably cannot
deadlock, so no search and no replay are needed. The orders are plain data (no process
group), so they can be built and checked anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._runtime import ir as rt
from .._runtime.ir import Action
from .upstream import _get_seq1f1b_rank_ops, _get_seq1f1b_rounds, _get_seq1f1b_warmup_ops

F = rt.FORWARD
B = rt.FULL_BACKWARD
I = rt.BACKWARD_INPUT  # noqa: E741 - torch's letter for the action
W = rt.BACKWARD_WEIGHT

__all__ = [
    "OrderSpec",
    "backward_unit_order",
    "build_orders",
    "looped_stage_peak_units",
    "rank_order",
    "sample_groups",
    "seq1f1b_warmup",
    "split_backward",
    "whole_backwards",
]


@dataclass(frozen=True)
class OrderSpec:
    """Shape of a Seq1F1B problem: ranks, local stages per rank, samples, segments."""

    pp: int
    stages_per_rank: int
    n_microbatches: int
    seq_chunks: int
    split_backward: bool = False  # ZBSeq1F1B: I then W instead of B (see split_backward)
    placement: str = "looped"  # or "v": rank r holds stages r and 2*pp-1-r (ZBV-Seq1F1B)

    def __post_init__(self) -> None:
        if self.placement not in ("looped", "v"):
            raise ValueError(f"placement must be 'looped' or 'v' (got {self.placement!r})")
        if self.placement == "v" and self.stages_per_rank != 2:
            raise ValueError(
                f"the V placement holds exactly 2 stages per rank (got {self.stages_per_rank})"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def n_units(self) -> int:
        return self.n_microbatches * self.seq_chunks

    def stage_to_rank(self, stage: int) -> int:
        """Looped placement: stage s lives on rank s % pp; V: on ``min(s, 2*pp-1-s)``."""
        if self.placement == "v":
            return min(stage, 2 * self.pp - 1 - stage)
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in increasing order."""
        if self.placement == "v":
            return [rank, 2 * self.pp - 1 - rank]
        return list(range(rank, self.num_stages, self.pp))


def seq1f1b_warmup(pp: int, rank: int, n_units: int, seq_chunks: int) -> int:
    """Warm-up forwards of single-stage Seq1F1B: 1F1B's ``pp - rank - 1`` plus ``K - 1``.

    The extra ``K - 1`` lets the last stage forward every segment of sample 0 before it runs
    that sample's first (last-segment) backward.
    """
    return _get_seq1f1b_warmup_ops(rank, 1, 0, pp, n_units, seq_chunks)


def looped_stage_peak_units(pp: int, n_microbatches: int, seq_chunks: int, stage: int) -> int:
    """Most units stage ``stage`` holds at once with one stage per rank (Seq1F1B, ZBSeq1F1B):
    the warm-up plus one, ``min(M*K, pp - stage + K - 1)``.

    By program order: the rank forwards ``W + 1`` units before its first backward, then
    alternates one forward with one backward (ZBSeq1F1B's weight half, which frees the unit,
    follows its input half at once). Stage 0 holds ``(p + K - 1) / K`` samples, stage
    ``pp - 1`` ``K / K = 1``: a whole sample, as 1F1B's last stage.
    """
    return min(n_microbatches * seq_chunks, pp - stage + seq_chunks - 1)


def backward_unit_order(units: Sequence[int], seq_chunks: int) -> list[int]:
    """Reorder forward-ordered units so that, per sample, segments come last-first."""
    by_sample: dict[int, list[int]] = {}
    for u in units:
        by_sample.setdefault(u // seq_chunks, []).append(u)
    out: list[int] = []
    for m in sorted(by_sample):
        out.extend(sorted(by_sample[m], reverse=True))
    return out


def sample_groups(spec: OrderSpec) -> list[list[int]]:
    """The rounds of the interleaved order, as unit lists: whole samples, ``>= pp`` units each.

    Interleaved schedules cycle through their local stages one round at a time; a round needs
    ``>= pp`` units to keep the ring busy, and it must hold whole samples so that the reversed
    segment order of a sample's backward stays inside one round. This is what makes the
    interleaved variant correct for every K and pp (not only when K divides pp).
    """
    k = spec.seq_chunks
    rounds = _get_seq1f1b_rounds(spec.n_microbatches, k, spec.pp)
    return [list(range(r.start * k, r.stop * k)) for r in rounds]


def rank_order(spec: OrderSpec, rank: int) -> list[Action]:
    """The compute-only Seq1F1B order of one rank, in closed form (no other rank is built).

    The code is torch's proposed ``_get_seq1f1b_rank_ops`` (:mod:`.upstream`): 1F1B over the
    rank's forward list (per round of :func:`sample_groups`: each local stage forwards the
    round's units) and backward list (per round: local stages in reverse, each sample's
    segments last-first): ``W[r]`` forwards (``_get_seq1f1b_warmup_ops``: Seq1F1B's
    :func:`seq1f1b_warmup` for one stage per rank; for several, torch's interleaved warm-up
    ``(v-1)*R + 2*(pp-r-1)`` over the first round's ``R`` units plus ``K - 1``, capped at
    ``v*M*K``), then forward/backward pairs, then the remaining backwards; with
    ``split_backward``, :func:`split_backward`.

    Why no rank waits forever (``W[r] >= W[r+1]``: the warm-up shrinks downstream).
    Entry ``i`` of every rank's forward (backward) list is the same (local stage, unit), so a
    forward ``i`` waits only for forward ``i`` of rank ``r-1`` (on rank 0, local ``l > 0``:
    forward ``i - R_g`` of rank ``pp-1``, the previous local stage, one round earlier) and a
    backward ``j`` for backward ``j`` of rank ``r+1`` (on rank ``pp-1``, ``l < v-1``: backward
    ``j - R_g`` of rank 0) and for its own forward. That forward lies at most
    ``(v-1)*R + K-1 <= W[pp-1] <= W[r]`` entries after ``j``, and the rank has run forwards
    ``0..W[r]+j`` before backward ``j``: the warm-up covers the forwards that must precede each
    backward. So a deadlock needs a cycle of stuck ranks, each waiting on a neighbour:

    * ``r`` at backward ``j``, ``r+1`` at forward ``i``: ``r`` has run forward ``i`` unless
      ``i > W[r] + j``, ``r+1`` has run backward ``j`` unless ``j >= i - W[r+1]``; both need
      ``W[r+1] > W[r]``;
    * the same across the wrap (``pp-1`` at a backward, 0 at a forward) needs
      ``W[0] - W[pp-1] > R_g + R_g'``, but ``W[0] - W[pp-1] <= 2*(pp-1)`` and every round holds
      ``>= pp`` units (a lone round of ``R < pp`` units caps ``W[0] - W[pp-1]`` at ``R``);
    * every rank stuck in one direction round the ring: each hop keeps the index or lowers it
      and the wrap lowers it by a round, so a rank would be stuck before its own position.

    The ``2`` per hop (torch's interleaved ``multiply_factor``) is there for the bubble, not
    for correctness: with equal costs a rank's gradient comes back just as it needs it.
    """
    order = _get_seq1f1b_rank_ops(
        rank, spec.pp, spec.stages_per_rank, spec.n_microbatches, spec.seq_chunks
    )
    return split_backward(order) if spec.split_backward else order


def build_orders(spec: OrderSpec) -> dict[int, list[Action]]:
    """Compute-only Seq1F1B orders for every rank (single-stage or interleaved/looped).

    Each rank's list is :func:`rank_order`, computed on its own in closed form as torch's
    ``_calculate_single_rank_operations`` does: no search, no replay (its docstring shows
    why the warm-ups cannot deadlock).
    """
    return {r: rank_order(spec, r) for r in range(spec.pp)}


def whole_backwards(order: Sequence[Action | None]) -> list[Action | None]:
    """A compute order with each BACKWARD_INPUT run as a FULL_BACKWARD and no BACKWARD_WEIGHT
    (the same gradient sends, at the same places): what a zero-bubble order runs on stages
    whose backward cannot be split (compiled or checkpointed blocks,
    :func:`seq1f1b.schedules.sequence_schedule.unsplittable`), and how the planner prices it."""
    out: list[Action | None] = []
    for action in order:
        if action is not None and action.computation_type == W:
            continue
        if action is not None and action.computation_type == I:
            action = Action(action.stage_index, B, action.microbatch_index)
        out.append(action)
    return out


def split_backward(actions: Sequence[Action]) -> list[Action]:
    """ZBSeq1F1B: every full backward of a stage with an input gradient becomes its input
    half (BACKWARD_INPUT, which sends the gradient upstream) immediately followed by its
    weight half (BACKWARD_WEIGHT); the first stage keeps full backwards (it has no input
    gradient, so nothing upstream waits for it).

    Why W right away and not deferred into the cool-down as ZB-H1 does: the upstream rank
    waits for I only, so the critical path loses every W; the cool-down gaps Seq1F1B leaves are
    K times shorter than a unit's W, so deferring W into them only delays it (simulated: pp=8,
    M=8, K=8 at the 8B shape, 0.572x of 1F1B with W right away, 0.583x deferring the last
    p-1-r, 0.586x deferring by p-1-r). Memory: a unit's activations are freed by its W, one
    action after I, so the peak equals Seq1F1B's; W's saved intermediates are released with it.
    """
    out: list[Action] = []
    for a in actions:
        if a.computation_type == B and a.stage_index != 0:
            out.append(Action(a.stage_index, I, a.microbatch_index))
            out.append(Action(a.stage_index, W, a.microbatch_index))
        else:
            out.append(a)
    return out
