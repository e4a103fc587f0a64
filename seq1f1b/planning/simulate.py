"""Cost-model simulation of any pipeline order in torch.distributed.pipelining's action IR.

Why: bubble and activation memory of a schedule follow from its per-rank action order and the
cost of each action, not from its name. Simulating the *real* ``pipeline_order`` of torch's
schedules and of ``ScheduleSeq1F1B`` side by side, with costs from a FLOPs model, shows what
sequence segments and the compute-balanced split buy at sizes no machine here can run.

Model (no processes, pure Python, event-driven in each rank's program order):

* a rank runs its actions in order, one at a time; an action starts when the rank is free and
  its data dependencies are done (plus ``comm_latency`` when the producer is on another rank);
* dependencies as in torch's ``simulate_comms_compute``: ``F(s, u)`` needs ``F(s-1, u)``;
  ``B``/``I(s, u)`` need ``F(s, u)`` and the input gradient of stage ``s+1`` (its ``B`` or
  ``I``); ``W(s, u)`` needs ``I(s, u)``;
* ``OVERLAP_F_B`` runs its sub-actions one after the other (what torch's runtime does on one
  device stream; the communication overlap it exists for is not modelled);
* ``None`` slots, communication and ``REDUCE_GRAD``/``UNSHARD``/``RESHARD`` cost nothing here;
* memory: a forward adds ``activation(action)`` to its stage, and the action that finishes the
  unit's backward frees it (``B``, or ``W`` for a split backward — conservative for ``I``),
  then adds ``after_backward(action)`` (default 0; what a trainer keeps across a
  microbatch's units, e.g. a K/V prefix freed only with the microbatch's last backward).

``bubble_ratio`` is idle rank-time over total rank-time, ``1 - busy / (ranks * makespan)``. For
1F1B with equal costs that is ``(p-1)/(M+p-1)``, for Seq1F1B ``(p-1)/(K*M+p-1)``; the README's
"bubble / compute" is ``bubble_over_compute = idle / busy``, i.e. ``(p-1)/(K*M)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .._runtime import ir as rt
from .._runtime.ir import Action
from .._runtime.replay import expand, replay
from .._runtime.topology import StageTopology
from ..schedules.partition import ModelShape, segment_flops

__all__ = [
    "FlopsCosts",
    "Interval",
    "SimResult",
    "compute_actions",
    "simulate",
    "simulate_blocking",
]

_F = rt.FORWARD
_B = rt.FULL_BACKWARD
_I = rt.BACKWARD_INPUT
_W = rt.BACKWARD_WEIGHT
_OVERLAP = rt.OVERLAP_F_B
_COMPUTE = (_F, _B, _I, _W)


@dataclass(frozen=True)
class Interval:
    """One compute action on one rank, from ``start`` to ``end`` in cost units."""

    start: float
    end: float
    action: Action


@dataclass
class SimResult:
    """What a schedule costs: per-rank timelines, makespan, bubble, peak activations."""

    timelines: dict[int, list[Interval]]
    makespan: float
    busy: dict[int, float]
    peak_activation_stage: dict[int, float]
    peak_activation_rank: dict[int, float]
    stage_to_rank: dict[int, int] = field(default_factory=dict)

    @property
    def n_ranks(self) -> int:
        return len(self.timelines)

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all rank-time: ``1 - busy / (ranks * makespan)``."""
        total = self.n_ranks * self.makespan
        return 0.0 if total <= 0 else 1.0 - sum(self.busy.values()) / total

    @property
    def bubble_over_compute(self) -> float:
        """Idle rank-time over busy rank-time (the paper's "bubble / compute")."""
        busy = sum(self.busy.values())
        return 0.0 if busy <= 0 else (self.n_ranks * self.makespan - busy) / busy


def compute_actions(actions: Iterable[Action | None]) -> list[Action]:
    """The compute actions of one rank in order; ``OVERLAP_F_B`` expanded into its parts."""
    return [a for a in expand(list(actions)) if a.computation_type in _COMPUTE]


def simulate(
    pipeline_order: Mapping[int, Sequence[Action | None]],
    cost: Callable[[Action], float],
    *,
    activation: Callable[[Action], float] | None = None,
    comm_latency: float = 0.0,
    replicas: int = 1,
    after_backward: Callable[[Action], float] | None = None,
) -> SimResult:
    """Run ``pipeline_order`` against its data dependencies with per-action ``cost``.

    Args:
        pipeline_order: rank -> actions (torch's compute-only IR; ``None`` = idle slot).
        cost: duration of one ``F``/``B``/``I``/``W`` action, in any unit.
        activation: activation size a forward leaves on its stage until its backward
            (default 1 per forward: "units in flight").
        comm_latency: added to a dependency whose producer runs on another rank.
        replicas: the stage ids form this many independent pipelines of equal length, one
            after the other (BitPipe: 2, stage ``g`` feeds ``g+1`` only inside a replica).
        after_backward: bytes a unit's backward adds to its stage once it has freed the
            unit's activation (negative: frees more); default 0.

    Raises ValueError if the order cannot finish (deadlock or a missing action).
    """
    act = activation or (lambda _a: 1.0)
    ops = {r: compute_actions(pipeline_order[r]) for r in sorted(pipeline_order)}
    stage_to_rank: dict[int, int] = {}
    for r, acts in ops.items():
        for a in acts:
            if stage_to_rank.setdefault(a.stage_index, r) != r:
                raise ValueError(
                    f"stage {a.stage_index} has actions on ranks "
                    f"{stage_to_rank[a.stage_index]} and {r}"
                )
    n_stages = max(stage_to_rank, default=0) + 1
    if replicas < 1 or n_stages % replicas:
        raise ValueError(f"{n_stages} stages cannot form {replicas} pipelines of equal length")
    topology = StageTopology.chains(
        n_stages, lambda s: stage_to_rank.get(s, -1), n_stages // replicas
    )
    result = replay(ops, topology, cost, comm_latency=comm_latency)
    if result.stuck:
        detail = ", ".join(f"rank {r} at {a}" for r, a in sorted(result.stuck.items()))
        raise ValueError(f"pipeline order cannot finish: {detail} wait forever")
    timelines = {
        r: [Interval(start, end, a) for start, end, a in tl] for r, tl in result.timelines.items()
    }
    peak_stage, peak_rank = _peak_activations(timelines, act, after_backward)
    makespan = max((iv.end for tl in timelines.values() for iv in tl), default=0.0)
    busy = {r: sum(iv.end - iv.start for iv in tl) for r, tl in timelines.items()}
    return SimResult(timelines, makespan, busy, peak_stage, peak_rank, stage_to_rank)


@dataclass(frozen=True)
class _Sync:
    """A batched send/receive: transfers as (is forward, producing stage, unit)."""

    sends: list[tuple[int, int, int]]
    recvs: list[tuple[int, int, int]]


def simulate_blocking(
    pipeline_order: Mapping[int, Sequence[Action | None]],
    cost: Callable[[Action], float],
    *,
    activation: Callable[[Action], float] | None = None,
    pair_steady: bool = False,
    transfer: Callable[[Action], float] | None = None,
    after_backward: Callable[[Action], float] | None = None,
) -> SimResult:
    """Run ``pipeline_order`` with Megatron-LM's blocking point-to-point communication.

    Why: Megatron's pipeline schedules (what the Seq1F1B paper measured) do not post a
    receive ahead and move on: after each compute group a rank waits, in one batched
    send/receive, for the sends of the group it ran and the receives of its next group, and a
    send completes only when its receiver has posted the matching receive. A rank that sends
    early therefore waits for a neighbour that is behind; :func:`simulate` (data dependencies
    only) misses that wait.

    A group is one action, or with ``pair_steady`` (Megatron's interleaved schedule, whose
    steady phase runs ``send_forward_backward_recv_forward_backward`` once per forward-backward
    pair) a forward and the full backward right after it. A transfer starts once both ends
    have posted it and takes ``transfer(producer)`` seconds (default 0), which both ends wait
    for. Only ``F`` and ``B`` actions. ValueError on a deadlock. ``activation`` and
    ``after_backward`` as in :func:`simulate`.
    """
    xfer_of = transfer or (lambda _a: 0.0)
    act = activation or (lambda _a: 1.0)
    ops = {r: compute_actions(pipeline_order[r]) for r in sorted(pipeline_order)}
    rank_of = {a.stage_index: r for r, acts in ops.items() for a in acts}
    n = max(rank_of, default=0) + 1
    if any(a.computation_type not in (_F, _B) for acts in ops.values() for a in acts):
        raise ValueError("blocking communication is modelled for F and B actions only")

    def edge(a: Action, incoming: bool) -> tuple[int, int, int] | None:
        """(kind, producing stage, unit) of a transfer into (or out of) ``a`` that crosses
        ranks; None when there is none."""
        s, u = a.stage_index, a.microbatch_index or 0
        fwd = a.computation_type == _F
        if incoming:
            src = s - 1 if fwd else s + 1
        else:
            src, dst = s, (s + 1 if fwd else s - 1)
            if not 0 <= dst < n or rank_of[dst] == rank_of[s]:
                return None
            return (int(fwd), src, u)
        if not 0 <= src < n or rank_of[src] == rank_of[s]:
            return None
        return (int(fwd), src, u)

    # per rank: compute actions and sync points (keys sent, keys received), alternating
    programs: dict[int, list[Action | _Sync]] = {}
    for r, acts in ops.items():
        groups: list[list[Action]] = []
        i = 0
        while i < len(acts):
            pair = (
                pair_steady
                and acts[i].computation_type == _F
                and i + 1 < len(acts)
                and acts[i + 1].computation_type == _B
            )
            groups.append(acts[i : i + 2] if pair else acts[i : i + 1])
            i += 2 if pair else 1
        prog: list[Action | _Sync] = []
        sent: list = []
        for g in [*groups, []]:
            recv = [k for a in g if (k := edge(a, True)) is not None]
            prog.append(_Sync(sent, recv))
            prog.extend(g)
            sent = [k for a in g if (k := edge(a, False)) is not None]
        programs[r] = prog

    send_post: dict[tuple[int, int, int], float] = {}
    recv_post: dict[tuple[int, int, int], float] = {}
    end_of: dict[tuple[int, int, int], float] = {}
    seconds: dict[tuple[int, int, int], float] = {}  # of the transfer out of each action
    pos = dict.fromkeys(ops, 0)
    clock = dict.fromkeys(ops, 0.0)
    timelines: dict[int, list[Interval]] = {r: [] for r in ops}
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pos[r] < len(prog):
                item = prog[pos[r]]
                if isinstance(item, _Sync):
                    sends, recvs = item.sends, item.recvs
                    for keys, posted in ((sends, send_post), (recvs, recv_post)):
                        for key in keys:
                            progress |= key not in posted
                            posted.setdefault(key, clock[r])
                    keys = [*sends, *recvs]
                    if any(k not in recv_post or k not in send_post for k in keys):
                        break
                    clock[r] = max(
                        [clock[r]] + [max(send_post[k], recv_post[k]) + seconds[k] for k in keys]
                    )
                else:
                    s, u = item.stage_index, item.microbatch_index or 0
                    fwd = item.computation_type == _F
                    deps = [(1, s - 1, u)] if fwd and s > 0 else []
                    if not fwd:
                        deps = [(1, s, u)] + ([(0, s + 1, u)] if s < n - 1 else [])
                    ready = [end_of.get(d) for d in deps]
                    if any(t is None for t in ready):
                        break
                    start = max([clock[r], *ready])  # type: ignore[list-item]
                    clock[r] = start + float(cost(item))
                    end_of[(int(fwd), s, u)] = clock[r]
                    seconds[(int(fwd), s, u)] = float(xfer_of(item))
                    timelines[r].append(Interval(start, clock[r], item))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(prog) for r, prog in programs.items()):
        stuck = ", ".join(
            f"rank {r} at {programs[r][pos[r]]}" for r in ops if pos[r] < len(programs[r])
        )
        raise ValueError(f"pipeline order deadlocks under blocking communication: {stuck}")
    peak_stage, peak_rank = _peak_activations(timelines, act, after_backward)
    makespan = max(clock.values(), default=0.0)
    busy = {r: sum(iv.end - iv.start for iv in tl) for r, tl in timelines.items()}
    return SimResult(timelines, makespan, busy, peak_stage, peak_rank, dict(rank_of))


def _peak_activations(
    timelines: Mapping[int, list[Interval]],
    act: Callable[[Action], float],
    after_backward: Callable[[Action], float] | None = None,
) -> tuple[dict[int, float], dict[int, float]]:
    """Peak in-flight activations per stage and per rank, along each rank's own order."""
    peak_stage: dict[int, float] = {}
    peak_rank: dict[int, float] = {}
    for r, tl in timelines.items():
        live: dict[int, float] = {}
        held: dict[tuple[int, int], float] = {}
        split: set[tuple[int, int]] = set()
        total = best = 0.0
        for iv in tl:
            a = iv.action
            s, t, u = a.stage_index, a.computation_type, a.microbatch_index
            key = (s, u if u is not None else -1)
            if t == _F:
                size = float(act(a))
                held[key] = size
                delta = size
            elif t == _I:
                split.add(key)
                delta = 0.0
            elif t == _B or (t == _W and key in split):
                delta = -held.pop(key, 0.0)
                if after_backward is not None:
                    delta += float(after_backward(a))
            else:
                delta = 0.0
            live[s] = live.get(s, 0.0) + delta
            total += delta
            best = max(best, total)
            peak_stage[s] = max(peak_stage.get(s, 0.0), live[s])
        peak_rank[r] = best
    return peak_stage, peak_rank


@dataclass(frozen=True)
class FlopsCosts:
    """Per-action cost and activation size of one sample cut into ``lengths`` segments.

    Why: under causal attention a later segment of a uniform split costs more than an earlier
    one; costing each unit with :func:`seq1f1b.schedules.partition.segment_flops` makes the
    simulator show the imbalance and what the compute-balanced split buys.

    A unit ``u`` is segment ``u % len(lengths)`` (one entry = unchunked, torch's schedules).
    The model's FLOPs are spread evenly over ``num_stages`` stages (a balanced partition); a
    full backward costs ``backward_factor`` forwards, and ``I`` and ``W`` half of that each.
    ``activation`` is in units of A = one whole sample's activations on one rank's layers
    (``num_stages / ranks`` stages per rank), proportional to the unit's tokens.
    """

    shape: ModelShape
    lengths: tuple[int, ...]
    num_stages: int
    ranks: int
    backward_factor: float = 2.0
    #: per-position forward FLOPs under a mask (:func:`seq1f1b.schedules.partition.profile_flops`);
    #: None: plain causal attention over the whole sequence
    position_flops: tuple[float, ...] | None = None

    @cached_property
    def segment_costs(self) -> list[float]:
        """Forward FLOPs of each segment on one stage."""
        out, end = [], 0
        for s in self.lengths:
            if self.position_flops is None:
                out.append(segment_flops(s, end + s, self.shape) / self.num_stages)
            else:
                out.append(math.fsum(self.position_flops[end : end + s]) / self.num_stages)
            end += s
        return out

    def cost(self, a: Action) -> float:
        """Duration of ``a`` in FLOPs (callback for :func:`simulate`)."""
        f = self.segment_costs[(a.microbatch_index or 0) % len(self.lengths)]
        t = a.computation_type
        if t == _F:
            return f
        if t == _B:
            return self.backward_factor * f
        return self.backward_factor * f / 2

    def activation(self, a: Action) -> float:
        """Activation a forward of ``a`` leaves on its stage, in units of A."""
        k = (a.microbatch_index or 0) % len(self.lengths)
        return self.lengths[k] / sum(self.lengths) * self.ranks / self.num_stages
