"""The one replay of pipeline orders: run every rank's list against its data dependencies.

Used to prove an order cannot deadlock while it is built (Seq1F1B, BitPipe), to time it with
a cost model (:mod:`seq1f1b.planning.simulate`), and to check a lowered order with its SEND/RECV
actions (the replica-aware counterpart of torch's ``simulate_comms_compute``). Dependencies
follow a :class:`~seq1f1b._runtime.topology.StageTopology`:

* ``F(s, u)`` needs ``F(prev, u)``; in a lowered order, from another rank, ``RECV_F(s, u)``;
* ``B``/``I(s, u)`` need ``F(s, u)`` and the input gradient of ``next`` (its ``B`` or ``I``),
  from another rank ``RECV_B(s, u)`` in a lowered order; ``W(s, u)`` needs ``I(s, u)``;
* ``SEND_F`` needs its ``F``, ``SEND_B`` its ``B``/``I``; ``RECV_F(s)`` needs ``SEND_F(prev)``,
  ``RECV_B(s)`` needs ``SEND_B(next)``; ``WAIT_SEND_*`` needs its send and the peer's receive;
* ``OVERLAP_F_B`` runs its parts in order; every other action (FSDP, REDUCE_GRAD) is free.

Event-driven in each rank's program order: a rank runs until its next action waits, and is
queued again when that dependency completes, so the work is linear in the number of actions.
An action starts when its rank is free and its dependencies have ended (plus ``comm_latency``
across ranks); with unit costs the finish time is the number of lock-step rounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import ir as rt
from .ir import Action
from .topology import StageTopology

__all__ = ["ReplayResult", "expand", "replay"]

_F, _B, _I, _W = rt.FORWARD, rt.FULL_BACKWARD, rt.BACKWARD_INPUT, rt.BACKWARD_WEIGHT
_COMPUTE = (_F, _B, _I, _W)
_SENDS = {rt.SEND_F, rt.SEND_B}
_RECVS = {rt.RECV_F, rt.RECV_B}
_WAITS = {k for k in (rt.WAIT_SEND_F, rt.WAIT_SEND_B) if k is not None}
# key kinds: what an action makes available
_KF, _KG, _KI, _KSF, _KSB, _KRF, _KRB, _KW = range(8)


@dataclass
class ReplayResult:
    """Per rank: the actions run with (start, end); ``stuck``: where each unfinished rank waits."""

    timelines: dict[int, list[tuple[float, float, Action]]]
    stuck: dict[int, Action]

    @property
    def finished(self) -> bool:
        return not self.stuck

    @property
    def makespan(self) -> float:
        return max((iv[1] for tl in self.timelines.values() for iv in tl), default=0.0)


def expand(actions: Sequence[Action | None]) -> list[Action]:
    """One rank's actions in order, ``None`` dropped and ``OVERLAP_F_B`` split into its parts."""
    out: list[Action] = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type == rt.OVERLAP_F_B:
            out.extend(expand(a.sub_actions or ()))
        else:
            out.append(a)
    return out


def replay(
    orders: Mapping[int, Sequence[Action | None]],
    topology: StageTopology,
    cost: Callable[[Action], float] | None = None,
    *,
    comm_latency: float = 0.0,
    compute_only: bool = False,
) -> ReplayResult:
    """Replay ``orders``; with ``compute_only`` drop every non-compute action first.

    ``cost`` gives the duration of a compute action (default 1); communication and other
    actions take no time. Never raises for a deadlock: see ``ReplayResult.stuck``.
    """
    n, rank_of = topology.num_stages, topology.rank_of
    ops = {r: expand(orders[r]) for r in sorted(orders)}
    if compute_only:
        ops = {r: [a for a in acts if a.computation_type in _COMPUTE] for r, acts in ops.items()}
    lowered = any(a.computation_type in _RECVS for acts in ops.values() for a in acts)

    plan = {r: _dependencies(acts, r, topology, lowered) for r, acts in ops.items()}
    done: dict[int, float] = {}
    waiting: dict[int, list[int]] = {}
    pos = dict.fromkeys(ops, 0)
    clock = dict.fromkeys(ops, 0.0)
    timelines: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in ops}
    queue = deque(ops)
    queued = set(ops)
    while queue:
        r = queue.popleft()
        queued.discard(r)
        acts = ops[r]
        i = pos[r]
        rank_plan = plan[r]
        while i < len(acts):
            a = acts[i]
            deps, made, is_compute = rank_plan[i]
            start = clock[r]
            blocked = -1
            for d in deps:
                t = done.get(d)
                if t is None:
                    blocked = d
                    break
                if comm_latency and rank_of[(d // 8) % n] != r:
                    t += comm_latency
                if t > start:
                    start = t
            if blocked >= 0:
                waiting.setdefault(blocked, []).append(r)
                break
            end = start
            if is_compute:
                end += float(cost(a)) if cost is not None else 1.0
                timelines[r].append((start, end, a))
            clock[r] = end
            i += 1
            for m in made:
                done[m] = end
                for w in waiting.pop(m, ()):
                    if w not in queued:
                        queue.append(w)
                        queued.add(w)
        pos[r] = i
    stuck = {r: ops[r][pos[r]] for r in ops if pos[r] < len(ops[r])}
    return ReplayResult(timelines, stuck)


def _dependencies(
    acts: Sequence[Action], rank: int, topology: StageTopology, lowered: bool
) -> list[tuple[tuple[int, ...], tuple[int, ...], bool]]:
    """Per action of one rank: (keys it waits for, keys it makes available, is compute).

    A key is ``(unit * num_stages + stage) * 8 + kind`` (ints: cheap at 10^5 actions).
    """
    n = topology.num_stages
    prev_of, next_of, rank_of = topology.prev_of, topology.next_of, topology.rank_of
    f, b, i_, w = _F, _B, _I, _W
    send_f, send_b, recv_f, recv_b = rt.SEND_F, rt.SEND_B, rt.RECV_F, rt.RECV_B
    wait_f, wait_b = rt.WAIT_SEND_F, rt.WAIT_SEND_B
    out: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
    for a in acts:
        s, t, u = a.stage_index, a.computation_type, a.microbatch_index
        if u is None:
            out.append(((), (), t in _COMPUTE))
            continue
        base = (u * n + s) * 8
        if t is f:
            p = prev_of[s]
            if p < 0:
                deps: tuple[int, ...] = ()
            elif lowered and rank_of[p] != rank:
                deps = (base + _KRF,)
            else:
                deps = ((u * n + p) * 8 + _KF,)
            out.append((deps, (base + _KF,), True))
        elif t is b or t is i_:
            q = next_of[s]
            if q < 0:
                deps = (base + _KF,)
            elif lowered and rank_of[q] != rank:
                deps = (base + _KF, base + _KRB)
            else:
                deps = (base + _KF, (u * n + q) * 8 + _KG)
            made = (base + _KG, base + _KI) if t is i_ else (base + _KG,)
            out.append((deps, made, True))
        elif t is w:
            out.append(((base + _KI,), (base + _KW,), True))
        elif t is send_f:
            out.append(((base + _KF,), (base + _KSF,), False))
        elif t is send_b:
            out.append(((base + _KG,), (base + _KSB,), False))
        elif t is recv_f:
            out.append((((u * n + prev_of[s]) * 8 + _KSF,), (base + _KRF,), False))
        elif t is recv_b:
            out.append((((u * n + next_of[s]) * 8 + _KSB,), (base + _KRB,), False))
        elif t is not None and t is wait_f:
            out.append(((base + _KSF, (u * n + next_of[s]) * 8 + _KRF), (), False))
        elif t is not None and t is wait_b:
            out.append(((base + _KSB, (u * n + prev_of[s]) * 8 + _KRB), (), False))
        else:
            out.append(((), (), False))
    return out
