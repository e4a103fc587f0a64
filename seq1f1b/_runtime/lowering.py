"""torch's schedule lowering (FSDP, REDUCE_GRAD, send/recv) in linear time, one rank at a time.

``ScheduleRuntime._prepare_schedule_with_comms`` lowers *every* rank's compute-only
schedule on every rank at start-up, with passes that do not scale: ``torch_add_unshard_reshard``
copies the rest of the list for each action (quadratic per rank) and ``add_send_recv`` advances
all ranks one action per lock-step round with set look-ups. At pp=64 and 1024 units that takes
10 s to over a minute per rank, while the runtime only ever executes its own rank's list.

This module produces, for one rank, exactly the list torch's passes produce for it:

* :func:`add_unshard_reshard` is torch's pass with its look-ahead computed in one backward sweep;
* :class:`SendRecvLowering` computes the lock-step round in which torch's ``add_send_recv``
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
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from . import ir as rt
from .ir import Action
from .topology import StageTopology

__all__ = [
    "LoweredOrders",
    "SendRecvLowering",
    "add_unshard_reshard",
    "check_backward_send_waits",
    "fast_path_supported",
    "is_lowerable",
]

_F = rt.FORWARD
_B = rt.FULL_BACKWARD
_I = rt.BACKWARD_INPUT
_W = rt.BACKWARD_WEIGHT
_UNSHARD = rt.UNSHARD
_RESHARD = rt.RESHARD
_SEND_F = rt.SEND_F
_RECV_F = rt.RECV_F
_SEND_B = rt.SEND_B
_RECV_B = rt.RECV_B
_WAIT_SEND_B = rt.WAIT_SEND_B

# torch's default for torch_add_unshard_reshard, which is what its runtime uses
_MAX_ACTIVE_STAGES = 3

_LOWERABLE = frozenset((_F, _B, _I, _W))

DEFAULT_OPTIONS: dict[str, Any] = {
    "defer_recv": False,
    "max_active_stages": _MAX_ACTIVE_STAGES,
    "unshard_lookahead": "full",
    "defer_reduce_grad_wait": False,
    "max_outstanding_sends": None,
    # not torch's: "end" is its placement of a backward send's wait (the step's end),
    # "consumed" waits once the peer provably received it (:meth:`SendRecvLowering.lower`)
    "backward_send_waits": "end",
}

#: where a backward send's wait goes (``backward_send_waits``)
BACKWARD_SEND_WAITS = ("end", "consumed")


def check_backward_send_waits(value: str) -> str:
    """``value`` if it names a placement of the backward sends' waits, else a ValueError."""
    if value not in BACKWARD_SEND_WAITS:
        raise ValueError(
            f"backward_send_waits={value!r}: one of {BACKWARD_SEND_WAITS} ('end': torch's, "
            "each backward send waited at the step's end; 'consumed': once the peer provably "
            "received it)"
        )
    return value


def fast_path_supported(
    actions: Mapping[int, Sequence[Action | None]], options: Mapping[str, Any]
) -> bool:
    """True if this module reproduces torch's lowering for these actions and options.

    Other cases (OVERLAP_F_B, a partial ``unshard_lookahead``, a send budget) go to torch.
    """
    return (
        is_lowerable(actions)
        and options.get("unshard_lookahead", "full") == "full"
        and options.get("max_outstanding_sends") is None
    )


def is_lowerable(actions: Mapping[int, Sequence[Action | None]]) -> bool:
    """True if every action is a plain F/B/I/W; anything else (OVERLAP_F_B, comms) is torch's."""
    return all(
        a is None or (a.computation_type in _LOWERABLE and a.sub_actions is None)
        for rank_actions in actions.values()
        for a in rank_actions
    )


def add_unshard_reshard(
    actions: Sequence[Action | None], max_active_stages: int = _MAX_ACTIVE_STAGES
) -> list[Action]:
    """torch's ``torch_add_unshard_reshard``, same output, in O(n * stages) instead of O(n^2).

    torch looks ahead from every action for the next ``max_active_stages`` distinct stages by
    scanning (and copying) the rest of the list. The same look-ahead falls out of one backward
    sweep that keeps the distinct stages ordered by their next use. The forward pass then
    mirrors torch's container operations one for one, so even the iteration order of its
    active-stage container (which decides the order of RESHARDs) is the same: a set up to
    2.14, a dict in insertion order from 2.15.
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
            window = tuple(upcoming[:max_active_stages])
        ahead[i] = window
    active: dict[int, None] | set[int] = {} if rt.UNSHARD_KEEPS_INSERTION_ORDER else set()
    out: list[Action] = []
    previous: tuple[int, ...] | None = None
    for action, nxt in zip(compute, ahead, strict=True):
        # after each step ``active == set(nxt)``, so an unchanged window changes nothing
        if nxt is not previous:
            fetch = [s for s in nxt if s not in active]
            evict = [s for s in active if s not in nxt]
            for s in evict:
                _discard(active, s)
                out.append(Action(s, _RESHARD, None))
            for s in fetch:
                _insert(active, s)
                out.append(Action(s, _UNSHARD, None))
            previous = nxt
        out.append(action)
    for s in list(active):
        out.append(Action(s, _RESHARD, None))
    return out


def _insert(active: dict[int, None] | set[int], stage: int) -> None:
    if isinstance(active, dict):
        active[stage] = None
    else:
        active.add(stage)


def _discard(active: dict[int, None] | set[int], stage: int) -> None:
    if isinstance(active, dict):
        del active[stage]
    else:
        active.remove(stage)


class SendRecvLowering:
    """torch's compute-only lowering for all ranks, computed once, assembled per rank.

    Construction runs the FSDP and REDUCE_GRAD passes for every rank and finds the round of
    every action (all linear in the number of actions); :meth:`lower` then builds one rank's
    list from its own actions and those of the ranks that send to it.
    """

    def __init__(
        self,
        actions: Mapping[int, Sequence[Action | None]],
        topology: StageTopology,
        n_microbatches: int,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        opts = {**DEFAULT_OPTIONS, **(options or {})}
        self.ranks = list(actions)
        self.topology = topology
        self._defer_recv = bool(opts["defer_recv"])
        check_backward_send_waits(opts["backward_send_waits"])
        self._early_waits = opts["backward_send_waits"] == "consumed" and rt.HAS_SEND_WAITS
        self._stage_rank = list(topology.rank_of)
        # per stage: the stage an F / a B-or-I sends to on another rank (-1: none)
        self._send_f = [topology.sends_forward(s) for s in range(topology.num_stages)]
        self._send_b = [topology.sends_backward(s) for s in range(topology.num_stages)]
        reduce_kwargs = {"defer_reduce_grad_wait": True} if opts["defer_reduce_grad_wait"] else {}
        self._lists: dict[int, list[Action]] = {
            r: rt.add_reduce_grad(  # type: ignore[misc]
                add_unshard_reshard(a, opts["max_active_stages"]),
                n_microbatches,
                **reduce_kwargs,
            )
            for r, a in actions.items()
        }
        self._rounds = self._schedule_rounds()

    def _schedule_rounds(self) -> dict[int, list[int]]:
        """The lock-step round of every action in torch's ``add_send_recv``.

        Event-driven: a rank runs until its head action waits for a RECV not yet produced,
        and is queued again when the sender produces it, so each action is handled once.
        """
        rank_of, send_f, send_b = self._stage_rank, self._send_f, self._send_b
        prev_of, next_of = self.topology.prev_of, self.topology.next_of
        n = len(rank_of)
        # F(s) waits for a RECV_F when its previous stage is elsewhere, else for its own F(prev)
        recv_f = [prev_of[s] >= 0 and rank_of[prev_of[s]] != rank_of[s] for s in range(n)]
        recv_b = [next_of[s] >= 0 and rank_of[next_of[s]] != rank_of[s] for s in range(n)]
        local_f = [prev_of[s] >= 0 and not recv_f[s] for s in range(n)]
        local_b = [next_of[s] >= 0 and not recv_b[s] for s in range(n)]
        # own F / B-or-I to remember: only when the next consumer is on the same rank (pp=1, V)
        keep_f = [next_of[s] >= 0 and local_f[next_of[s]] for s in range(n)]
        keep_b = [prev_of[s] >= 0 and local_b[prev_of[s]] for s in range(n)]
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
                    elif local_f[s] and u * n + prev_of[s] not in own_f:
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
                    elif local_b[s] and u * n + next_of[s] not in own_b:
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

    def _send_of(self, action: Action) -> Action | None:
        """The SEND torch puts right after ``action``, if any."""
        s, ct, u, _ = action
        if ct is _F and self._send_f[s] >= 0:
            return Action(s, _SEND_F, u)
        if (ct is _B or ct is _I) and self._send_b[s] >= 0:
            return Action(s, _SEND_B, u)
        return None

    def _incoming(self, rank: int) -> list[tuple[int, int, Action]]:
        """(round, sender rank, RECV) of every RECV other ranks insert into ``rank``'s list."""
        rank_of = self._stage_rank
        topo = self.topology
        senders = {
            rank_of[peer]
            for s, r in enumerate(rank_of)
            if r == rank
            for peer in (topo.prev_of[s], topo.next_of[s])
            if peer >= 0 and rank_of[peer] != rank
        }
        out: list[tuple[int, int, Action]] = []
        for q in senders:
            for a, t in zip(self._lists[q], self._rounds[q], strict=True):
                s, ct, u, _ = a
                if ct is _F:
                    peer = self._send_f[s]
                    if peer >= 0 and rank_of[peer] == rank:
                        out.append((t, q, Action(peer, _RECV_F, u)))
                elif ct is _B or ct is _I:
                    peer = self._send_b[s]
                    if peer >= 0 and rank_of[peer] == rank:
                        out.append((t, q, Action(peer, _RECV_B, u)))
        out.sort(key=lambda item: item[:2])  # one action per sender per round: keys are unique
        return out

    def lower(self, rank: int) -> list[Action]:
        """Rank ``rank``'s lowered list, equal to torch's ``_prepare_schedule_with_comms``."""
        incoming = self._incoming(rank)
        out: list[Action] = []
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
        out = rt.add_wait_send(out)  # 2.15: every SEND retired by a WAIT_SEND (torch's pass)
        if self._early_waits:
            out = self._backward_send_waits_moved(rank, out)
        if self._defer_recv:
            out = rt.defer_recv_ops(rank, out, self.topology.stage_to_rank)
        rt.validate_send_waits({rank: out})
        return out

    def _consumed_after(self, rank: int) -> dict[tuple[int, int], tuple[int, Any, int]]:
        """For each backward send of ``rank`` (stage, unit): the compute action of ``rank``
        after which the peer has provably received it, where one exists.

        The peer's backward of that unit waits for the gradient before it runs; any message
        the peer posts after that backward, once ``rank`` has waited for it (at the action
        that consumes it), proves the gradient was received, so a wait there cannot stall.
        Sends to one peer also complete in the order posted on one NCCL stream, so the wait
        is free on a GPU as well. Sends with no such message keep torch's wait at the end."""
        rank_of = self._stage_rank
        mine = self._lists[rank]
        my_pos = _first_positions(mine)
        peers: dict[int, list[tuple[int, int, int]]] = {}  # rank -> (index, stage, peer stage)
        for i, a in enumerate(mine):
            key = _compute_key(a)
            if key is not None and not key[1] and self._send_b[a.stage_index] >= 0:
                peer = self._send_b[a.stage_index]
                peers.setdefault(rank_of[peer], []).append((i, a.stage_index, peer))
        out: dict[tuple[int, int], tuple[int, Any, int]] = {}
        for q, sends in peers.items():
            theirs = self._lists[q]
            q_pos = _first_positions(theirs)
            # from each index of q's list: the index in mine of the action that consumes the
            # next message q sends to me (-1: none comes)
            next_msg = [-1] * (len(theirs) + 1)
            for j in range(len(theirs) - 1, -1, -1):
                next_msg[j] = next_msg[j + 1]
                key = _compute_key(theirs[j])
                if key is None:
                    continue
                x, fwd, u = key
                dst = self._send_f[x] if fwd else self._send_b[x]
                if dst >= 0 and rank_of[dst] == rank:
                    next_msg[j] = my_pos.get((dst, fwd, u), -1)
            for i, stage, peer in sends:
                u = mine[i].microbatch_index
                j = q_pos.get((peer, False, u))
                k = next_msg[j + 1] if j is not None else -1
                if k > i:
                    a = mine[k]
                    out[(stage, u)] = (a.stage_index, a.computation_type, a.microbatch_index)
        return out

    def _backward_send_waits_moved(self, rank: int, out: list[Action]) -> list[Action]:
        """``out`` with each backward send's wait moved from the step's end (torch's
        ``_add_wait_send``) to just after the action of :meth:`_consumed_after`: the sent
        gradient is freed there, not held to the step's end (a unit's input gradient on
        every stage but the first; upstream: ``_add_wait_send`` placing them so)."""
        after = self._consumed_after(rank)
        if not after:
            return out
        waits: dict[tuple[int, Any, int], list[Action]] = {}
        for (stage, u), key in after.items():
            waits.setdefault(key, []).append(Action(stage, _WAIT_SEND_B, u))
        moved: list[Action] = []
        for a in out:
            ct = a.computation_type
            if ct is _WAIT_SEND_B and (a.stage_index, a.microbatch_index) in after:
                continue
            moved.append(a)
            if ct is _F or ct is _B or ct is _I:
                moved.extend(waits.pop((a.stage_index, ct, a.microbatch_index), ()))
        return moved


def _compute_key(a: Action) -> tuple[int, bool, int] | None:
    """(stage, forward?, unit) of an F, B or I; None for any other action."""
    ct = a.computation_type
    if ct is _F:
        return (a.stage_index, True, a.microbatch_index)
    if ct is _B or ct is _I:
        return (a.stage_index, False, a.microbatch_index)
    return None


def _first_positions(actions: Sequence[Action]) -> dict[tuple[int, bool, int], int]:
    """Each compute key's first index in ``actions`` (a unit's first backward half, B or I,
    is the one that consumes the gradient it receives)."""
    pos: dict[tuple[int, bool, int], int] = {}
    for i, a in enumerate(actions):
        key = _compute_key(a)
        if key is not None:
            pos.setdefault(key, i)
    return pos


class LoweredOrders(MutableMapping[int, list[Action]]):
    """``pipeline_order_with_comms`` that lowers a rank on first access.

    The runtime only reads its own rank; CSV dumps, ``_simulate`` and error messages that read
    every rank still get torch's lists, computed when asked for.
    """

    def __init__(self, lowering: SendRecvLowering) -> None:
        self._lowering = lowering
        self._ranks = list(lowering.ranks)
        self._lowered: dict[int, list[Action]] = {}

    def __getitem__(self, rank: int) -> list[Action]:
        if rank not in self._lowered:
            if rank not in self._ranks:
                raise KeyError(rank)
            self._lowered[rank] = self._lowering.lower(rank)
        return self._lowered[rank]

    def __setitem__(self, rank: int, actions: list[Action]) -> None:
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

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[int, list[Action]]:
        # torch's format_pipeline_order deep-copies and then edits the copy as a plain dict
        return {r: copy.deepcopy(self[r], memo) for r in self}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self._ranks}, lowered={sorted(self._lowered)})"
