"""torch's schedule lowering (FSDP, REDUCE_GRAD, send/recv) in linear time, one rank at a time.

``_PipelineScheduleRuntime._prepare_schedule_with_comms`` lowers *every* rank's compute-only
schedule on every rank at start-up, with passes that do not scale: ``_add_unshard_reshard``
copies the rest of the list for each action (quadratic per rank) and ``_add_send_recv`` advances
all ranks one action per lock-step round with set look-ups. At pp=64 and 1024 units that takes
10 s to over a minute per rank, while the runtime only ever executes its own rank's list.

This module produces, for one rank, exactly the list torch's passes produce for it:

* :func:`add_unshard_reshard` is torch's pass with its look-ahead computed in one backward sweep;
* :class:`SendRecvLowering` computes the lock-step round in which torch's ``_add_send_recv``
  schedules each action of each rank, event-driven (work linear in the number of actions),
  then assembles one rank's list from those rounds.

Why rounds determine torch's output: in round ``t`` torch visits the ranks in ascending order
and each schedules at most its head action, once its dependency is in the rank's set of
previous actions. A RECV that sender ``q`` inserts into rank ``r``'s list in round ``t'`` is
seen by ``r`` in round ``t'`` when ``q < r`` (``q`` went first) and from ``t' + 1`` otherwise,
so ``round(r, i) = max(round(r, i - 1) + 1, round(q, j) + [q > r])``. The RECVs are appended
to ``r``'s list as the senders schedule; so within a round, ``r``'s list gets the RECVs from
lower ranks (ascending), then its own action and its SEND, then the RECVs from higher ranks.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _ComputationType,
)

from .order import paused_gc

__all__ = ["LoweredOrders", "SendRecvLowering", "add_unshard_reshard", "is_lowerable"]

_F = _ComputationType.FORWARD
_B = _ComputationType.FULL_BACKWARD
_I = _ComputationType.BACKWARD_INPUT
_W = _ComputationType.BACKWARD_WEIGHT
_UNSHARD = _ComputationType.UNSHARD
_RESHARD = _ComputationType.RESHARD
_SEND_F = _ComputationType.SEND_F
_RECV_F = _ComputationType.RECV_F
_SEND_B = _ComputationType.SEND_B
_RECV_B = _ComputationType.RECV_B

# torch's default for _add_unshard_reshard, which is what its runtime uses
_MAX_ACTIVE_STAGES = 3

_LOWERABLE = frozenset((_F, _B, _I, _W))


def is_lowerable(actions: Mapping[int, Sequence[_Action | None]]) -> bool:
    """True if every action is a plain F/B/I/W; anything else (OVERLAP_F_B, comms) is torch's."""
    return all(
        a is None or (a.computation_type in _LOWERABLE and a.sub_actions is None)
        for rank_actions in actions.values()
        for a in rank_actions
    )


def add_unshard_reshard(actions: Sequence[_Action | None]) -> list[_Action]:
    """torch's ``_add_unshard_reshard``, same output, in O(n * stages) instead of O(n^2).

    torch looks ahead from every action for the next 3 distinct stages by scanning (and
    copying) the rest of the list. The same look-ahead falls out of one backward sweep that
    keeps the distinct stages ordered by their next use. The forward pass then mirrors
    torch's set operations one for one, so even the set's iteration order (which decides the
    order of RESHARDs) is the same.
    """
    compute = [a for a in actions if a is not None]
    ahead: list[tuple[int, ...]] = [()] * len(compute)
    upcoming: list[int] = []  # distinct stages of compute[i:], by first use
    window: tuple[int, ...] = ()
    for i in range(len(compute) - 1, -1, -1):
        stage = compute[i].stage_index
        if not upcoming or upcoming[0] != stage:
            if stage in upcoming:
                upcoming.remove(stage)
            upcoming.insert(0, stage)
            window = tuple(upcoming[:_MAX_ACTIVE_STAGES])
        ahead[i] = window
    active: set[int] = set()
    out: list[_Action] = []
    previous: tuple[int, ...] | None = None
    for action, nxt in zip(compute, ahead, strict=True):
        # after each step ``active == set(nxt)``, so an unchanged window changes nothing
        if nxt is not previous:
            fetch = [s for s in nxt if s not in active]
            evict = [s for s in active if s not in nxt]
            for s in evict:
                active.remove(s)
                out.append(_Action(s, _RESHARD, None))
            for s in fetch:
                active.add(s)
                out.append(_Action(s, _UNSHARD, None))
            previous = nxt
        out.append(action)
    for s in list(active):
        out.append(_Action(s, _RESHARD, None))
    return out


class SendRecvLowering:
    """torch's compute-only lowering for all ranks, computed once, assembled per rank.

    Construction runs the FSDP and REDUCE_GRAD passes for every rank and finds the round of
    every action (all linear in the number of actions); :meth:`lower` then builds one rank's
    list from its own actions and those of the ranks that send to it.
    """

    def __init__(
        self,
        actions: Mapping[int, Sequence[_Action | None]],
        stage_to_rank: Callable[[int], int],
        num_stages: int,
        n_microbatches: int,
        defer_recv: bool = False,
    ) -> None:
        self.ranks = list(actions)
        self._defer_recv = defer_recv
        rank_of = [stage_to_rank(s) for s in range(num_stages)]
        self._stage_rank = rank_of
        # per stage, torch's rules: the stage an F / a B-or-I sends to on another rank (-1: none)
        self._send_f = [
            s + 1 if s + 1 < num_stages and rank_of[s + 1] != rank_of[s] else -1
            for s in range(num_stages)
        ]
        self._send_b = [
            s - 1 if s > 0 and rank_of[s - 1] != rank_of[s] else -1 for s in range(num_stages)
        ]
        with paused_gc():
            self._lists: dict[int, list[_Action]] = {
                r: _add_reduce_grad(add_unshard_reshard(a), n_microbatches)  # type: ignore[misc]
                for r, a in actions.items()
            }
            self._rounds = self._schedule_rounds()

    def _schedule_rounds(self) -> dict[int, list[int]]:
        """The lock-step round of every action in torch's ``_add_send_recv``.

        Event-driven: a rank runs until its head action waits for a RECV not yet produced,
        and is queued again when the sender produces it, so each action is handled once.
        """
        rank_of, send_f, send_b = self._stage_rank, self._send_f, self._send_b
        n = len(rank_of)
        # F(s) waits for a RECV_F when its previous stage is elsewhere, else for its own F(s-1)
        recv_f = [s > 0 and rank_of[s - 1] != rank_of[s] for s in range(n)]
        recv_b = [s < n - 1 and rank_of[s + 1] != rank_of[s] for s in range(n)]
        local_f = [s > 0 and not recv_f[s] for s in range(n)]
        local_b = [s < n - 1 and not recv_b[s] for s in range(n)]
        # own F / B-or-I to remember: only when the next consumer is on the same rank (pp=1, V)
        keep_f = [s < n - 1 and local_f[s + 1] for s in range(n)]
        keep_b = [s > 0 and local_b[s - 1] for s in range(n)]
        rounds = {r: [0] * len(acts) for r, acts in self._lists.items()}
        # keys are ``unit * n + stage`` (ints: smaller and faster than tuples at 10^5 entries)
        seen_f: dict[int, int] = {}  # RECV_F key -> first round its receiver sees it
        seen_b: dict[int, int] = {}
        waiting_f: dict[int, int] = {}  # RECV key -> the rank waiting for it
        waiting_b: dict[int, int] = {}
        own_f: set[int] = set()
        own_b: set[int] = set()
        pos = dict.fromkeys(self.ranks, 0)
        last_round = dict.fromkeys(self.ranks, -1)
        queue = deque(sorted(self.ranks))
        while queue:
            rank = queue.popleft()
            acts, rank_rounds = self._lists[rank], rounds[rank]
            i, t = pos[rank], last_round[rank]
            while i < len(acts):
                s, ct, u, _ = acts[i]
                if ct is _F:
                    if recv_f[s]:
                        seen = seen_f.get(u * n + s)
                        if seen is None:
                            waiting_f[u * n + s] = rank
                            break
                        t = seen if seen > t else t + 1
                    elif local_f[s] and u * n + s - 1 not in own_f:
                        break  # waits for its own later action: torch's malformed case
                    else:
                        t += 1
                    if keep_f[s]:
                        own_f.add(u * n + s)
                    peer = send_f[s]
                    if peer >= 0:
                        key = u * n + peer
                        seen_f.setdefault(key, t + 1 if rank > rank_of[peer] else t)
                        if key in waiting_f:
                            queue.append(waiting_f.pop(key))
                elif ct is _B or ct is _I:
                    if recv_b[s]:
                        seen = seen_b.get(u * n + s)
                        if seen is None:
                            waiting_b[u * n + s] = rank
                            break
                        t = seen if seen > t else t + 1
                    elif local_b[s] and u * n + s + 1 not in own_b:
                        break
                    else:
                        t += 1
                    if keep_b[s]:
                        own_b.add(u * n + s)
                    peer = send_b[s]
                    if peer >= 0:
                        key = u * n + peer
                        seen_b.setdefault(key, t + 1 if rank > rank_of[peer] else t)
                        if key in waiting_b:
                            queue.append(waiting_b.pop(key))
                else:
                    t += 1
                rank_rounds[i] = t
                i += 1
            pos[rank], last_round[rank] = i, t
        if any(pos[r] < len(self._lists[r]) for r in self.ranks):
            raise AssertionError("Malformed compute schedule, can't schedule sends/recvs")
        return rounds

    def _send_of(self, action: _Action) -> _Action | None:
        """The SEND torch puts right after ``action``, if any."""
        s, ct, u, _ = action
        if ct is _F and self._send_f[s] >= 0:
            return _Action(s, _SEND_F, u)
        if (ct is _B or ct is _I) and self._send_b[s] >= 0:
            return _Action(s, _SEND_B, u)
        return None

    def _incoming(self, rank: int) -> list[tuple[int, int, _Action]]:
        """(round, sender rank, RECV) of every RECV other ranks insert into ``rank``'s list."""
        rank_of = self._stage_rank
        senders = {
            rank_of[peer]
            for s, r in enumerate(rank_of)
            if r == rank
            for peer in (s - 1, s + 1)
            if 0 <= peer < len(rank_of) and rank_of[peer] != rank
        }
        out: list[tuple[int, int, _Action]] = []
        for q in senders:
            for a, t in zip(self._lists[q], self._rounds[q], strict=True):
                s, ct, u, _ = a
                if ct is _F:
                    peer = self._send_f[s]
                    if peer >= 0 and rank_of[peer] == rank:
                        out.append((t, q, _Action(peer, _RECV_F, u)))
                elif ct is _B or ct is _I:
                    peer = self._send_b[s]
                    if peer >= 0 and rank_of[peer] == rank:
                        out.append((t, q, _Action(peer, _RECV_B, u)))
        out.sort(key=lambda item: item[:2])  # one action per sender per round: keys are unique
        return out

    def lower(self, rank: int) -> list[_Action]:
        """Rank ``rank``'s lowered list, equal to torch's ``_prepare_schedule_with_comms``."""
        incoming = self._incoming(rank)
        out: list[_Action] = []
        j = 0
        for a, t in zip(self._lists[rank], self._rounds[rank], strict=True):
            # RECVs of earlier rounds, and of this round from lower ranks (they went first)
            while j < len(incoming) and (
                incoming[j][0] < t or (incoming[j][0] == t and incoming[j][1] < rank)
            ):
                out.append(incoming[j][2])
                j += 1
            out.append(a)
            send = self._send_of(a)
            if send is not None:
                out.append(send)
        out.extend(item[2] for item in incoming[j:])
        if self._defer_recv:
            # imported here: a newer torch API than the rest, needed only with defer_pp_recv
            from torch.distributed.pipelining.schedules import _defer_recv_ops

            rank_of = self._stage_rank
            out = _defer_recv_ops({rank: out}, lambda s: rank_of[s])[rank]
        return out


class LoweredOrders(MutableMapping[int, list[_Action]]):
    """``pipeline_order_with_comms`` that lowers a rank on first access.

    The runtime only reads its own rank; CSV dumps, ``_simulate`` and error messages that read
    every rank still get torch's lists, computed when asked for.
    """

    def __init__(self, lowering: SendRecvLowering) -> None:
        self._lowering = lowering
        self._ranks = list(lowering.ranks)
        self._lowered: dict[int, list[_Action]] = {}

    def __getitem__(self, rank: int) -> list[_Action]:
        if rank not in self._lowered:
            if rank not in self._ranks:
                raise KeyError(rank)
            self._lowered[rank] = self._lowering.lower(rank)
        return self._lowered[rank]

    def __setitem__(self, rank: int, actions: list[_Action]) -> None:
        if rank not in self._ranks:
            self._ranks.append(rank)
        self._lowered[rank] = actions

    def __delitem__(self, rank: int) -> None:
        self._ranks.remove(rank)
        self._lowered.pop(rank, None)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._ranks))

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._ranks

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[int, list[_Action]]:
        # torch's _format_pipeline_order deep-copies and then edits the copy as a plain dict
        return {r: copy.deepcopy(self[r], memo) for r in self}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self._ranks}, lowered={sorted(self._lowered)})"
