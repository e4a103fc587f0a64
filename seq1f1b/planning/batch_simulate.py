"""Many simulations at once: each order compiled to arrays once, every (order, costs) pair
replayed together in numpy.

Why: the planner prices about two thousand settings, a few per pipeline order, each a replay of
up to 10^5 actions; :func:`seq1f1b.planning.simulate.simulate` walks every action in Python
(a minute and a half for the paper's 7B search). Here an order becomes its dependency graph
once (:class:`OrderGraph`), and the replay advances every rank of every pair by one action per
numpy step: the steps number the longest chain of actions, not the actions.

Same results as :func:`~seq1f1b.planning.simulate.simulate` (``comm_latency = 0``, no
``after_backward``), float for float: an action starts at the maximum of its rank's clock and
its dependencies' ends and ends ``cost`` later, as in :func:`seq1f1b._runtime.replay.replay`
(the maximum is exact, so the evaluation order does not matter); busy time is summed per rank
in program order with Python's ``sum``, and activations are accumulated per rank in program
order (``numpy.cumsum`` adds left to right, like the simulator's loop). A dependency on an
earlier action of the same rank is dropped: with costs ``>= 0`` the rank's clock is already
past its end.

What it does not take: an order whose stages share a rank with another's, a unit without an
index, an action twice, a dependency that never runs or comes later on its own rank
(:meth:`OrderGraph.build` returns None), negative or non-finite costs, and a cycle across ranks
(:func:`simulate_graphs` returns None for that pair): the caller runs ``simulate``, which
raises what it raises.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from .._runtime import ir as rt
from .._runtime.ir import Action
from .._runtime.replay import expand

__all__ = ["GraphTiming", "OrderGraph", "simulate_graphs"]

_KINDS = (rt.FORWARD, rt.FULL_BACKWARD, rt.BACKWARD_INPUT, rt.BACKWARD_WEIGHT)
_CODES = {k: i for i, k in enumerate(_KINDS)}
_F, _B, _I, _W = range(4)
_STAGE, _KIND, _UNIT = itemgetter(0), itemgetter(1), itemgetter(2)  # Action's fields
#: ``sum`` of floats adds left to right before Python 3.12 (as numpy's cumsum does), with
#: Neumaier's compensation from 3.12 on
_SEQUENTIAL_SUM = sys.version_info < (3, 12)


@dataclass(frozen=True, eq=False)
class OrderGraph:
    """One compute-only order as arrays, its actions rank by rank in program order.

    ``stage``, ``kind`` (F, B, I, W as 0..3), ``unit``: the actions; ``dep``: per action, the
    action on another rank it waits for (-1: none); ``classes``: per action, its cost class;
    ``representatives``: one action of each class (what a cost callback is asked about);
    ``act_index``: per action, where its activation change lies in ``[sizes, -sizes, 0]`` (a
    forward adds its class's size, the backward that frees the unit subtracts its forward's).
    """

    ranks: tuple[int, ...]
    rank_start: np.ndarray  # action offsets per rank, len(ranks) + 1
    stage: np.ndarray
    kind: np.ndarray
    unit: np.ndarray
    dep: np.ndarray
    classes: np.ndarray
    act_index: np.ndarray
    representatives: tuple[Action, ...]
    forward_classes: np.ndarray  # bool per class: a forward's (whose size matters)
    stage_to_rank: dict[int, int]
    replicas: int
    period: int
    stage_class: np.ndarray | None

    @property
    def n_actions(self) -> int:
        return int(self.rank_start[-1])

    @property
    def depth_hint(self) -> int:
        """The most actions one rank runs (a lower bound of the replay's steps)."""
        return int(np.diff(self.rank_start).max(initial=0))

    @classmethod
    def build(
        cls,
        pipeline_order: Mapping[int, Sequence[Action | None]],
        *,
        replicas: int = 1,
        period: int = 1,
        stage_class: Sequence[int] | None = None,
    ) -> OrderGraph | None:
        """Compile ``pipeline_order`` (rank -> torch's compute IR; other actions ignored and
        ``OVERLAP_F_B`` run as its parts, as :func:`~seq1f1b.planning.simulate.simulate`
        does); None where ``simulate`` must run.

        Actions share a class when they agree in ``stage_class[stage]`` (default: the stage),
        computation type and ``microbatch_index % period``; the caller promises that its cost
        and activation callbacks give them equal values. ``replicas`` as in ``simulate``.
        """
        ranks = tuple(sorted(pipeline_order))
        flat: list[Action] = []
        kinds: list[rt.ComputationType] = []
        starts = [0]
        for r in ranks:
            acts = pipeline_order[r]
            try:
                ks = list(map(_KIND, acts))
            except TypeError:  # idle slots (None)
                acts = [a for a in acts if a is not None]
                ks = list(map(_KIND, acts))
            present = set(ks)
            if rt.OVERLAP_F_B in present:
                acts = expand(acts)
                ks = list(map(_KIND, acts))
                present = set(ks)
            if not present <= _CODES.keys():
                keep = [i for i, k in enumerate(ks) if k in _CODES]
                acts, ks = [acts[i] for i in keep], [ks[i] for i in keep]
            flat.extend(acts)
            kinds.extend(ks)
            starts.append(len(flat))
        n = len(flat)
        try:
            stage = np.fromiter(map(_STAGE, flat), dtype=np.int64, count=n)
            unit = np.fromiter(map(_UNIT, flat), dtype=np.int64, count=n)
        except TypeError:  # a unit without an index
            return None
        kind = np.fromiter(map(_CODES.__getitem__, kinds), dtype=np.int64, count=n)
        stage_to_rank: dict[int, int] = {}
        stages = stage.tolist()
        for j, r in enumerate(ranks):
            for s in dict.fromkeys(stages[starts[j] : starts[j + 1]]):
                if stage_to_rank.setdefault(s, r) != r:
                    return None
        groups = None if stage_class is None else np.asarray(stage_class, dtype=np.int64)
        return cls._compile(
            ranks, np.array(starts, dtype=np.int64), stage, kind, unit, stage_to_rank,
            replicas, period, groups,
        )  # fmt: skip

    def split_backward(self) -> OrderGraph | None:
        """The graph of this order with every full backward of a stage but stage 0 run as its
        input half then its weight half (:func:`seq1f1b.orders.order.split_backward`:
        ZBSeq1F1B's order from Seq1F1B's), without building that order."""
        split = (self.kind == _B) & (self.stage != 0)
        count = 1 + split
        stage = np.repeat(self.stage, count)
        unit = np.repeat(self.unit, count)
        kind = np.repeat(self.kind, count)
        at = np.cumsum(count) - count  # where each old action starts
        kind[at[split]] = _I
        kind[at[split] + 1] = _W
        shift = np.concatenate([[0], np.cumsum(split)])
        rank_start = self.rank_start + shift[self.rank_start]
        return self._compile(
            self.ranks, rank_start, stage, kind, unit, dict(self.stage_to_rank), self.replicas,
            self.period, self.stage_class,
        )  # fmt: skip

    @classmethod
    def _compile(
        cls,
        ranks: tuple[int, ...],
        rank_start: np.ndarray,
        stage: np.ndarray,
        kind: np.ndarray,
        unit: np.ndarray,
        stage_to_rank: dict[int, int],
        replicas: int,
        period: int,
        stage_class: np.ndarray | None,
    ) -> OrderGraph | None:
        """The dependencies, classes and activation changes of the actions' arrays."""
        n = len(stage)
        if n == 0 or period < 1 or stage.min() < 0 or unit.min() < 0:
            return None
        n_stages = int(stage.max()) + 1
        if replicas < 1 or n_stages % replicas:
            return None
        if stage_class is not None and len(stage_class) < n_stages:
            return None
        per_chain = n_stages // replicas
        rank_pos = np.repeat(np.arange(len(ranks)), np.diff(rank_start))
        s_ids = np.arange(n_stages)
        prev_of = np.where(s_ids % per_chain == 0, -1, s_ids - 1)
        next_of = np.where((s_ids + 1) % per_chain == 0, -1, s_ids + 1)

        # the action that makes each (unit, stage) key: forward, input gradient (B or I), I
        key = unit * n_stages + stage
        size = int(key.max()) + 1
        idx = np.arange(n, dtype=np.int64)
        is_f, is_b, is_i, is_w = (kind == _F), (kind == _B), (kind == _I), (kind == _W)
        is_g = is_b | is_i
        makers = []
        for mask in (is_f, is_g, is_i):
            keys = key[mask]
            if np.bincount(keys, minlength=size).max(initial=0) > 1:
                return None  # an action twice: replay's "done" is the later one's
            table = np.full(size + 1, -1, dtype=np.int64)  # the last slot: "no such key"
            table[keys] = idx[mask]
            makers.append(table)
        made_f, made_g, made_i = makers

        def maker(table: np.ndarray, other_stage: np.ndarray) -> np.ndarray:
            """The maker of (unit, other_stage); -1 without one, -2 where none is needed."""
            k = np.minimum(np.where(other_stage >= 0, unit * n_stages + other_stage, size), size)
            return np.where(other_stage >= 0, table[k], -2)

        # data dependencies: F on the previous stage's F; B/I on the next stage's B or I and
        # on their own F; W on its I (these last two on the same rank, earlier)
        upstream = np.where(is_f, maker(made_f, prev_of[stage]), -2)
        downstream = np.where(is_g, maker(made_g, next_of[stage]), -2)
        own = np.where(is_w, made_i[key], np.where(is_g, made_f[key], -2))
        cross = np.where(is_f, upstream, downstream)
        if (cross == -1).any() or (own == -1).any() or (own > idx).any():
            return None  # waits for an action no rank runs, or a later one of its rank
        has = cross >= 0
        same = np.zeros(n, dtype=bool)
        same[has] = rank_pos[cross[has]] == rank_pos[has]
        if (cross[same] > idx[same]).any():
            return None
        # the rank's clock is past the end of its own earlier actions (costs >= 0)
        dep = np.where(has & ~same, cross, -1)

        # cost classes
        group = stage if stage_class is None else stage_class[stage]
        code = (group * 4 + kind) * period + unit % period
        uniq, first, classes = np.unique(code, return_index=True, return_inverse=True)
        representatives = tuple(
            Action(s, _KINDS[k], u)
            for s, k, u in zip(
                stage[first].tolist(), kind[first].tolist(), unit[first].tolist(), strict=True
            )
        )
        forward_classes = (uniq // period) % 4 == _F

        # activation changes: +size(F) at F, -size(F of the unit) at the B or W that frees it
        n_cls = len(uniq)
        act_index = np.full(n, 2 * n_cls, dtype=np.int64)
        act_index[is_f] = classes[is_f]
        frees = is_b | is_w
        act_index[frees] = n_cls + classes[made_f[key[frees]]]
        return cls(
            ranks, rank_start, stage, kind, unit, dep, classes.astype(np.int64), act_index,
            representatives, forward_classes, stage_to_rank, replicas, period, stage_class,
        )  # fmt: skip


@dataclass(frozen=True)
class GraphTiming:
    """What :func:`simulate_graphs` finds for one pair; fields as in ``SimResult``."""

    makespan: float
    busy: dict[int, float]
    peak_activation_rank: dict[int, float]
    stage_to_rank: dict[int, int]

    @property
    def bubble_ratio(self) -> float:
        """Idle fraction of all rank-time: ``1 - busy / (ranks * makespan)``."""
        total = len(self.busy) * self.makespan
        return 0.0 if total <= 0 else 1.0 - sum(self.busy.values()) / total


def simulate_graphs(
    jobs: Sequence[tuple[OrderGraph, Sequence[float], Sequence[float]]],
    *,
    max_cells: int = 1 << 22,
) -> list[GraphTiming | None]:
    """Replay each ``(graph, cost per class, activation size per class)``; None for a pair
    whose costs are negative or a value not finite, or whose order deadlocks.

    The pairs of one graph run side by side, a column each: which action a rank runs at each
    step depends on the order only, not on the costs. Graphs run together, deepest first, in
    batches of about ``max_cells`` action-columns (memory: a few arrays of that many floats).
    """
    out: list[GraphTiming | None] = [None] * len(jobs)
    columns: dict[int, list[int]] = {}  # id(graph) -> its valid jobs
    for i, (graph, costs, sizes) in enumerate(jobs):
        c, a = np.asarray(costs, dtype=np.float64), np.asarray(sizes, dtype=np.float64)
        shape = (len(graph.representatives),)
        if c.shape == a.shape == shape and np.isfinite([c, a]).all() and (c >= 0).all():
            columns.setdefault(id(graph), []).append(i)
    groups = sorted(columns.values(), key=lambda g: -jobs[g[0]][0].depth_hint)
    batch: list[list[int]] = []
    rows = width = 0
    for group in groups:
        graph = jobs[group[0]][0]
        if batch and (rows + graph.n_actions) * max(width, len(group)) > max_cells:
            _run_batch(jobs, batch, out)
            batch, rows, width = [], 0, 0
        batch.append(group)
        rows += graph.n_actions + len(graph.ranks)
        width = max(width, len(group))
    if batch:
        _run_batch(jobs, batch, out)
    return out


#: lock-step steps between checks for finished and stuck ranks
_CHECK_EVERY = 32


def _run_batch(
    jobs: Sequence[tuple[OrderGraph, Sequence[float], Sequence[float]]],
    batch: list[list[int]],
    out: list[GraphTiming | None],
) -> None:
    """Lock-step replay of the graphs in ``batch``, each with its jobs as columns: each step,
    every rank whose next action's dependency has ended runs that action.

    Rows: each rank's actions in order, then a terminal row that waits forever (a finished
    rank idles there), then two shared rows: ended at 0 (no dependency) and never ending.
    A rank that cannot run writes NaN over its next action's NaN, so a step needs no mask.
    """
    graphs = [jobs[group[0]][0] for group in batch]
    width = max(len(group) for group in batch)
    sizes = [g.n_actions + len(g.ranks) for g in graphs]
    offsets = np.cumsum([0, *sizes])
    total = int(offsets[-1])
    zero, never = total, total + 1
    dep = np.full(total, never, dtype=np.int64)
    cost = np.zeros((total, width), dtype=np.float64)
    rows: list[np.ndarray] = []  # per graph: the row of each action
    for g, group, off in zip(graphs, batch, offsets[:-1].tolist(), strict=True):
        counts = np.diff(g.rank_start)
        row = np.arange(g.n_actions) + np.repeat(np.arange(len(counts)), counts) + off
        rows.append(row)
        dep[row] = np.where(g.dep >= 0, row[np.maximum(g.dep, 0)], zero)
        table = np.zeros((len(g.representatives), width))
        table[:, : len(group)] = np.array([jobs[i][1] for i in group], dtype=np.float64).T
        cost[row] = table[g.classes]
    end = np.full((total + 2, width), np.nan)
    end[zero] = 0.0
    # a row of ``end`` as one item: numpy scatters the rows of a 2-d array element by element
    item = np.dtype((np.void, 8 * width))
    end_items = end.view(item).reshape(total + 2)
    first = [
        off + g.rank_start[:-1] + np.arange(len(g.ranks))
        for g, off in zip(graphs, offsets[:-1], strict=True)
    ]
    cur = np.concatenate(first)
    stop = np.concatenate([f + np.diff(g.rank_start) for f, g in zip(first, graphs, strict=True)])
    clock = np.zeros((len(cur), width))
    moved = -1
    while True:
        for _ in range(_CHECK_EVERY):
            ready_at = np.take(end, np.take(dep, cur), axis=0)
            e = np.maximum(clock, ready_at)  # NaN where the dependency has not ended
            e += np.take(cost, cur, axis=0)
            end_items[cur] = e.view(item).reshape(len(cur))
            np.fmax(clock, e, out=clock)  # e >= clock where it ran
            cur += ready_at[:, 0] == ready_at[:, 0]
        running = cur != stop
        if not running.any():
            break
        position = int(cur.sum())
        if position == moved:
            break  # the remaining ranks wait on each other
        moved = position
        if running.sum() * 2 < len(cur):
            cur, stop, clock = cur[running], stop[running], clock[running]
            moved = int(cur.sum())
    stuck = np.zeros(len(batch), dtype=bool)
    waiting = cur[cur != stop]
    if waiting.size:
        stuck[np.searchsorted(offsets, waiting, side="right") - 1] = True
    for b, (g, group, row) in enumerate(zip(graphs, batch, rows, strict=True)):
        if not stuck[b]:
            _timings(g, [jobs[i][2] for i in group], row, end, dep[row], zero, group, out)


def _timings(
    g: OrderGraph,
    sizes: list[Sequence[float]],
    row: np.ndarray,
    end: np.ndarray,
    dep: np.ndarray,
    zero: int,
    group: list[int],
    out: list[GraphTiming | None],
) -> None:
    """The GraphTiming of each column of a replayed graph (its actions at ``row`` of
    ``end``), as ``simulate`` finds them: busy time summed as ``sum`` does in each rank's
    order, activations accumulated in each rank's order."""
    w = len(group)
    previous = row - 1
    previous[g.rank_start[:-1][np.diff(g.rank_start) > 0]] = zero
    ended = np.take(end, row, axis=0)[:, :w]
    started = np.maximum(np.take(end, previous, axis=0), np.take(end, dep, axis=0))[:, :w]
    held = np.where(g.forward_classes[:, None], np.array(sizes, dtype=np.float64).T, 0.0)
    change = np.concatenate([held, -held, np.zeros((1, w))]).T  # column x act_index
    # per column, rank and position in the rank's order: the span, the activation change;
    # zeros after a rank's last action keep its running sums
    counts = np.diff(g.rank_start)
    ranks, longest = len(counts), max(int(counts.max(initial=0)), 1)
    if (counts == longest).all():
        table = np.empty((2 * w, ranks * longest))
        np.subtract(ended.T, started.T, out=table[:w])
        np.take(change, g.act_index, axis=1, out=table[w:])
        table = table.reshape(2 * w, ranks, longest)
    else:
        table = np.zeros((2 * w, ranks, longest))
        spans, deltas = (ended - started).T, change[:, g.act_index]
        for j, (lo, hi) in enumerate(itertools.pairwise(g.rank_start.tolist())):
            table[:w, j, : hi - lo] = spans[:, lo:hi]
            table[w:, j, : hi - lo] = deltas[:, lo:hi]
    sums = np.cumsum(table, axis=2)  # left to right, as simulate's loops add
    peaks = sums[w:].max(axis=2).T.tolist()
    if _SEQUENTIAL_SUM:
        busy = sums[:w, :, -1].T.tolist()
    else:  # sum() compensates: the same sum() over the same floats
        spans = (ended - started).T.tolist()
        busy = [
            [sum(s[lo:hi]) for s in spans] for lo, hi in itertools.pairwise(g.rank_start.tolist())
        ]
    makespans = ended.max(axis=0).tolist()
    for col, i in enumerate(group):
        out[i] = GraphTiming(
            makespans[col],
            {r: busy[j][col] for j, r in enumerate(g.ranks)},
            {r: max(0.0, peaks[j][col]) for j, r in enumerate(g.ranks)},
            dict(g.stage_to_rank),
        )
