"""BitPipe compute orders in torch's action IR (FORWARD / FULL_BACKWARD only).

Each rank runs four stages (two per replica), each over its replica's ``M/2`` microbatches
(global ids: replica A the first half, B the second). The orders come from a unit-time list
schedule (forward = backward = one step, a result usable one step later) in which every rank,
at every step, runs the best *ready* action:

* a backward if one is ready, except during the rank's warm-up ``pp + pp/2 + min(r, pp-1-r)``
  (the published BitPipe warm-up) + 1, when forwards go first;
* forwards by ideal arrival time within groups of ``pp/2`` microbatches per replica (stage
  ``s`` gets the group's ``i``-th microbatch at ``s + i``; at a tie the stage further along
  first), backwards likewise (``2pp-1-s + i``) -- the order of the published example;
* a forward that brings a new microbatch onto the rank (the first of the two stages a replica
  has there) waits while the rank holds ``warm-up + 2`` live stage activations; the peak was
  ``2*pp`` stage passes per rank in every case checked.

For pp = 4, M = 4 this is the published order; for pp <= 10 and M divisible by pp it takes
``4M + pp - 2`` steps, the published bubble ``(pp-2)/(4M+pp-2)`` (a few steps more beyond).
The timeline is a witness that each rank's list can run against its data dependencies, so the
lists cannot deadlock.

The rule depends only on a stage's position ``s`` within its replica and the schedule is
synchronous, so rank ``pp-1-r``'s order is rank ``r``'s with A and B swapped: partner ranks
finish their twin chunks in the same sequence, which lets each chunk's gradient all-reduce
start right after its last backward on both sides in the same collective order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from .. import _runtime as rt
from .._runtime import Action
from .layout import BitPipeLayout

__all__ = ["bitpipe_warmup", "build_bitpipe_orders"]

F = rt.FORWARD
B = rt.FULL_BACKWARD

_Pass = tuple[int, int]  # (global stage id, global microbatch id)


def bitpipe_warmup(pp: int, rank: int) -> int:
    """Warm-up forwards (in stage passes) of the published BitPipe schedule."""
    return pp + pp // 2 + min(rank, pp - 1 - rank)


class _Timeline:
    """The unit-time list schedule above; ``run`` returns per-rank orders or stuck ranks."""

    def __init__(self, layout: BitPipeLayout, n_microbatches: int) -> None:
        self.layout = layout
        self.half = n_microbatches // 2
        self.group = max(1, layout.pp // 2)

    def _local(self, g: int, mb: int) -> int:
        return mb - self.layout.replica(g) * self.half

    def fkey(self, g: int, mb: int) -> tuple[int, int, int]:
        s, j = self.layout.chunk(g), self._local(g, mb)
        return (j // self.group, s + j % self.group, -s)

    def bkey(self, g: int, mb: int) -> tuple[int, int, int]:
        s, j = self.layout.chunk(g), self._local(g, mb)
        last = self.layout.replica_stages - 1
        return (j // self.group, last - s + j % self.group, s)

    def run(self, limits: Mapping[int, int]) -> tuple[dict[int, list[Action]], list[int]]:
        lay, pp = self.layout, self.layout.pp
        # per rank: ready first-visit forwards, ready second-visit forwards, ready backwards
        ready: dict[int, tuple[list, list, list]] = {r: ([], [], []) for r in range(pp)}
        for replica in (0, 1):
            g0 = lay.stage_id(replica, 0)
            for mb in lay.microbatches(replica, 2 * self.half):
                heapq.heappush(ready[lay.rank_of(g0)][0], (self.fkey(g0, mb), g0, mb))
        fwd_done: set[_Pass] = set()
        bwd_done: set[_Pass] = set()
        live = dict.fromkeys(range(pp), 0)
        n_fwd = dict.fromkeys(range(pp), 0)
        orders: dict[int, list[Action]] = {r: [] for r in range(pp)}
        total = 2 * self.half * lay.replica_stages * 2
        done = 0
        while done < total:
            picks: list[tuple[int, Action]] = []
            for r in range(pp):
                first_f, second_f, bwds = ready[r]
                warm = n_fwd[r] < limits[r] - 1
                can_start = live[r] < limits[r]
                fwd_heaps = [h for h in (first_f if can_start else None, second_f) if h]
                best_f = min((h[0] for h in fwd_heaps), default=None)
                if bwds and (not warm or best_f is None):
                    _, g, mb = heapq.heappop(bwds)
                    picks.append((r, Action(g, B, mb)))
                elif best_f is not None:
                    heap = first_f if first_f and first_f[0] == best_f else second_f
                    _, g, mb = heapq.heappop(heap)
                    picks.append((r, Action(g, F, mb)))
            if not picks:
                return orders, [r for r in range(pp) if len(orders[r]) < total // pp]
            for r, a in picks:  # results become usable at the next step
                orders[r].append(a)
                done += 1
                self._complete(r, a, ready, fwd_done, bwd_done, live, n_fwd)
        return orders, []

    def _complete(self, r, a, ready, fwd_done, bwd_done, live, n_fwd) -> None:
        lay = self.layout
        g, mb = a.stage_index, a.microbatch_index
        if a.computation_type == F:
            fwd_done.add((g, mb))
            live[r] += 1
            n_fwd[r] += 1
            nxt = lay.next_stage(g)
            if nxt is not None:
                second = lay.chunk(nxt) >= lay.pp  # the replica's second stage on that rank
                heap = ready[lay.rank_of(nxt)][1 if second else 0]
                heapq.heappush(heap, (self.fkey(nxt, mb), nxt, mb))
            if nxt is None or (nxt, mb) in bwd_done:
                heapq.heappush(ready[r][2], (self.bkey(g, mb), g, mb))
        else:
            bwd_done.add((g, mb))
            live[r] -= 1
            prev = lay.prev_stage(g)
            if prev is not None and (prev, mb) in fwd_done:
                heapq.heappush(ready[lay.rank_of(prev)][2], (self.bkey(prev, mb), prev, mb))


def build_bitpipe_orders(pp: int, n_microbatches: int) -> dict[int, list[Action]]:
    """Compute-only BitPipe orders of every rank (see the module docstring).

    If the list schedule ever stalls, the stalled ranks and their partners (to keep partners
    mirrored) may hold one more activation and it runs again; with no limit it is plain
    data-driven order, which always completes.
    """
    layout = BitPipeLayout(pp)
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
        raise ValueError(f"n_microbatches must be an integer (got {n_microbatches!r})")
    if n_microbatches < 2 or n_microbatches % 2:
        raise ValueError(f"BitPipe needs an even n_microbatches >= 2 (got {n_microbatches})")
    timeline = _Timeline(layout, n_microbatches)
    n_fwd = 2 * n_microbatches  # 4 stages x M/2 per rank
    limits = {r: min(bitpipe_warmup(pp, r) + 2, n_fwd + 1) for r in range(pp)}
    while True:
        orders, stuck = timeline.run(limits)
        if not stuck:
            return orders
        for r in {x for s in stuck for x in (s, layout.partner(s))}:  # pragma: no cover
            limits[r] = n_fwd + 1
