"""Per-rank compute orders for Seq1F1B, in torch.distributed.pipelining's action IR.

A *unit* is one (sample microbatch ``m``, sequence segment ``k``) pair; its index in the IR is
``u = m * K + k``. Every order built here obeys the Seq1F1B rules on every stage:

* forwards of a sample run segment 0..K-1, backwards run K-1..0 (later segments attend to the
  K/V of earlier ones, so their backward produces gradient the earlier segments still need);
* samples are FIFO;
* FORWARD and FULL_BACKWARD actions; with ``split_backward`` (ZBSeq1F1B), BACKWARD_INPUT then
  BACKWARD_WEIGHT instead of FULL_BACKWARD on every stage but the first (the attention
  accumulates the cached K/V gradients itself, so the input half keeps them exact).

The orders are plain data (no process group), so they can be built and checked anywhere.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ._runtime import ir as rt
from ._runtime.ir import Action
from .replay import replay
from .topology import StageTopology

F = rt.FORWARD
B = rt.FULL_BACKWARD
I = rt.BACKWARD_INPUT  # noqa: E741 - torch's letter for the action
W = rt.BACKWARD_WEIGHT

__all__ = [
    "OrderSpec",
    "backward_unit_order",
    "build_orders",
    "sample_groups",
    "seq1f1b_warmup",
    "split_backward",
]


@dataclass(frozen=True)
class OrderSpec:
    """Shape of a Seq1F1B problem: ranks, local stages per rank, samples, segments."""

    pp: int
    stages_per_rank: int
    n_microbatches: int
    seq_chunks: int
    split_backward: bool = False  # ZBSeq1F1B: I then W instead of B (see split_backward)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def n_units(self) -> int:
        return self.n_microbatches * self.seq_chunks

    def stage_to_rank(self, stage: int) -> int:
        """Looped placement: stage s lives on rank s % pp."""
        return stage % self.pp


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic GC while building large schedules (restoring its previous state).

    Orders at pp=64 hold ~10^5 live action tuples; every allocation burst then triggers
    collections that rescan them all, which doubles the build time. Nothing built here forms
    reference cycles, so the collector has nothing to find.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def seq1f1b_warmup(pp: int, rank: int, n_units: int, seq_chunks: int) -> int:
    """Warm-up forwards of single-stage Seq1F1B: 1F1B's ``pp - rank - 1`` plus ``K - 1``.

    The extra ``K - 1`` lets the last stage forward every segment of sample 0 before it runs
    that sample's first (last-segment) backward.
    """
    return min(pp - rank + seq_chunks - 2, n_units)


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
    """Split the samples into rounds of whole samples with at least ``pp`` units each.

    Interleaved schedules cycle through their local stages one round at a time; a round needs
    ``>= pp`` units to keep the ring busy, and it must hold whole samples so that the reversed
    segment order of a sample's backward stays inside one round. This is what makes the
    interleaved variant correct for every K and pp (not only when K divides pp).
    """
    k, m = spec.seq_chunks, spec.n_microbatches
    per_group = max(1, -(-spec.pp // k))  # ceil(pp / K) samples
    n_groups = max(1, m // per_group)
    base, extra = divmod(m, n_groups)
    groups: list[list[int]] = []
    sample = 0
    for g in range(n_groups):
        n = base + (1 if g < extra else 0)
        groups.append(list(range(sample * k, (sample + n) * k)))
        sample += n
    return groups


def _rank_sequences(spec: OrderSpec, rank: int) -> tuple[list[Action], list[Action]]:
    """The forward and the backward sequence of one rank (each in the order it runs them)."""
    v, p = spec.stages_per_rank, spec.pp
    fwd: list[Action] = []
    bwd: list[Action] = []
    if v == 1:
        units = list(range(spec.n_units))
        fwd = [Action(rank, F, u) for u in units]
        bwd = [Action(rank, B, u) for u in backward_unit_order(units, spec.seq_chunks)]
        return fwd, bwd
    for group in sample_groups(spec):
        back = backward_unit_order(group, spec.seq_chunks)
        for local in range(v):
            fwd.extend(Action(local * p + rank, F, u) for u in group)
        for local in reversed(range(v)):
            bwd.extend(Action(local * p + rank, B, u) for u in back)
    return fwd, bwd


def _initial_warmup(spec: OrderSpec, rank: int) -> int:
    n_local_units = spec.n_units * spec.stages_per_rank
    if spec.stages_per_rank == 1:
        return seq1f1b_warmup(spec.pp, rank, spec.n_units, spec.seq_chunks)
    round_units = len(sample_groups(spec)[0])
    warm = (spec.stages_per_rank - 1) * round_units + 2 * (spec.pp - rank - 1)
    return min(warm + spec.seq_chunks - 1, n_local_units)


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then forward/backward pairs, then the remaining backwards."""
    order = list(fwd[:warmup])
    f, b = warmup, 0
    while f < len(fwd):
        order.append(fwd[f])
        order.append(bwd[b])
        f += 1
        b += 1
    order.extend(bwd[b:])
    return order


def build_orders(spec: OrderSpec) -> dict[int, list[Action]]:
    """Compute-only Seq1F1B orders for every rank (single-stage or interleaved/looped).

    Single-stage ranks use the published warm-up ``min(pp - r + K - 2, M*K)``. Interleaved ranks
    start from ``(v-1)*R + 2*(pp-r-1) + K-1`` (R = units per round); if a data-dependency replay
    finds a rank waiting forever, that rank gets one more warm-up forward and the replay runs
    again. More warm-up only moves forwards earlier, so this ends at the latest in GPipe order,
    which always completes.
    """
    topology = StageTopology.chain([spec.stage_to_rank(s) for s in range(spec.num_stages)])
    with paused_gc():
        warm = {r: _initial_warmup(spec, r) for r in range(spec.pp)}
        seqs = {r: _rank_sequences(spec, r) for r in range(spec.pp)}
        while True:
            orders = {r: _one_f_one_b(*seqs[r], warm[r]) for r in range(spec.pp)}
            stuck = list(replay(orders, topology).stuck)
            if not stuck:
                if spec.split_backward:
                    return {r: split_backward(acts) for r, acts in orders.items()}
                return orders
            bumped = False
            for r in stuck:
                if warm[r] < len(seqs[r][0]):
                    warm[r] += 1
                    bumped = True
            if not bumped:  # pragma: no cover - GPipe order always completes
                raise RuntimeError(f"Seq1F1B could not build a deadlock-free order for {spec}")


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
