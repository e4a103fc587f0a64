"""The batched replay (seq1f1b/planning/batch_simulate.py) finds what the simulator finds, float
for float, on every registry schedule; and hands back what it does not take (simulate raises
there)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from seq1f1b._runtime import Action, ComputationType
from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning import batch_simulate
from seq1f1b.planning.batch_simulate import OrderGraph, simulate_graphs
from seq1f1b.planning.simulate import simulate
from seq1f1b.registry import REGISTRY, lookup

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
I, W = ComputationType.BACKWARD_INPUT, ComputationType.BACKWARD_WEIGHT  # noqa: E741


def grid() -> list[tuple[str, int, int, int, int]]:
    """(schedule, pp, stages per rank, M, K) for every registry entry, small sizes."""
    points = []
    for entry in REGISTRY:
        for v in (1, 2, 4):
            hi = entry.max_stages_per_rank
            if v < entry.min_stages_per_rank or (hi is not None and v > hi):
                continue
            for pp, m in ((2, 4), (4, 8)):
                for k in (2, 3) if entry.seq_chunked else (1,):
                    points.append((entry.name, pp, v, m, k))
    return points


def random_costs(graph: OrderGraph, seed: int) -> tuple[list[float], list[float]]:
    """Seconds and activation bytes per action class, drawn at random (no two alike)."""
    rng = random.Random(seed)
    n = len(graph.representatives)
    return [rng.uniform(0.1, 3.0) for _ in range(n)], [rng.uniform(1.0, 9.0) for _ in range(n)]


def by_class(graph: OrderGraph, values: list[float], period: int):
    """A simulate callback giving each action its class's value (classes: stage, kind, unit %
    period, as OrderGraph.build makes them without ``stage_class``)."""
    table = {
        (a.stage_index, a.computation_type, a.microbatch_index % period): x
        for a, x in zip(graph.representatives, values, strict=True)
    }
    return lambda a: table[(a.stage_index, a.computation_type, a.microbatch_index % period)]


def expected(order, graph: OrderGraph, costs, sizes, period: int, replicas: int):
    res = simulate(
        order,
        by_class(graph, costs, period),
        activation=by_class(graph, sizes, period),
        replicas=replicas,
    )
    busy = {r: sum(iv.end - iv.start for iv in tl) for r, tl in res.timelines.items()}
    return res.makespan, res.bubble_ratio, busy, res.peak_activation_rank, res.stage_to_rank


def found(timing) -> tuple:
    return (
        timing.makespan,
        timing.bubble_ratio,
        timing.busy,
        timing.peak_activation_rank,
        timing.stage_to_rank,
    )


def test_every_registry_schedule_replays_exactly_as_simulate() -> None:
    jobs, cases = [], []
    for i, (name, pp, v, m, k) in enumerate(grid()):
        entry = lookup(name)
        order = entry.compute_orders(pp, m, k, v)
        graph = OrderGraph.build(order, replicas=entry.replicas, period=k)
        assert graph is not None, name
        for seed in (2 * i, 2 * i + 1):  # two settings of one order run as two columns
            costs, sizes = random_costs(graph, seed)
            jobs.append((graph, costs, sizes))
            cases.append(expected(order, graph, costs, sizes, k, entry.replicas))
    # small batches: several batches, graphs of different widths side by side
    for cells in (1 << 22, 5000):
        timings = simulate_graphs(jobs, max_cells=cells)
        assert [found(t) for t in timings] == cases


def test_compensated_sum_gives_the_same_busy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.12's sum() compensates: then busy time is summed by sum() itself."""
    entry = lookup("ZBSeq1F1B")
    order = entry.compute_orders(4, 8, 4, 2)
    graph = OrderGraph.build(order, period=4)
    assert graph is not None
    costs, sizes = random_costs(graph, 7)
    monkeypatch.setattr(batch_simulate, "_SEQUENTIAL_SUM", False)
    (timing,) = simulate_graphs([(graph, costs, sizes)])
    assert found(timing) == expected(order, graph, costs, sizes, 4, 1)


@pytest.mark.parametrize("pp,v,m,k", [(2, 1, 4, 2), (4, 2, 8, 4), (4, 4, 8, 3)])
def test_split_graph_is_the_graph_of_the_split_order(pp: int, v: int, m: int, k: int) -> None:
    """ZBSeq1F1B's graph from the order without split backwards (what the planner builds
    once for it and Seq1F1B / InterleavedSeq1F1B) is the graph of its own order."""
    zb = lookup("ZBSeq1F1B")
    spec = replace(zb.order_spec(pp, m, k, v), split_backward=False)
    plain = OrderGraph.build(build_orders(spec), period=k)
    split = OrderGraph.build(zb.compute_orders(pp, m, k, v), period=k)
    assert plain is not None and split is not None
    derived = plain.split_backward()
    assert derived is not None
    for field in ("rank_start", "stage", "kind", "unit", "dep", "classes", "act_index"):
        assert (getattr(derived, field) == getattr(split, field)).all(), field
    assert derived.representatives == split.representatives
    assert derived.stage_to_rank == split.stage_to_rank


def test_classes_follow_stage_class_and_period() -> None:
    order = build_orders(OrderSpec(4, 1, 8, 4))
    graph = OrderGraph.build(order, period=4, stage_class=[1, 0, 0, 2])
    assert graph is not None
    # first, middle and last stage x F and B x 4 segments
    assert len(graph.representatives) == 3 * 2 * 4
    assert {(a.stage_index, a.microbatch_index) for a in graph.representatives} >= {(0, 0), (3, 3)}


def test_orders_it_does_not_take_are_the_simulators_errors() -> None:
    two_ranks = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(0, F, 1), Action(0, B, 1)]}
    no_unit = {0: [Action(0, F, None), Action(0, B, None)]}
    missing = {0: [Action(0, F, 0), Action(0, B, 0)], 1: [Action(1, F, 0)]}  # no B(1, 0)
    late = {0: [Action(0, B, 0), Action(0, F, 0)]}  # its own forward comes later
    twice = {0: [Action(0, F, 0), Action(0, F, 0), Action(0, B, 0)]}
    for order in (two_ranks, missing, late):
        assert OrderGraph.build(order) is None
        with pytest.raises(ValueError):
            simulate(order, lambda a: 1.0)
    assert OrderGraph.build(no_unit) is None
    assert OrderGraph.build(twice) is None


def test_a_cycle_across_ranks_and_bad_costs_are_handed_back() -> None:
    # rank 0's B(0, 0) waits for rank 1's B(1, 0), behind F(1, 1), which waits for F(0, 1),
    # behind B(0, 0)
    cycle = {
        0: [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        1: [Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)],
    }
    with pytest.raises(ValueError, match="cannot finish"):
        simulate(cycle, lambda a: 1.0)
    graph = OrderGraph.build(cycle)
    plain = build_orders(OrderSpec(2, 1, 2, 1))
    good = OrderGraph.build(plain)
    assert graph is not None and good is not None
    n, g = len(graph.representatives), len(good.representatives)
    timings = simulate_graphs(
        [
            (graph, [1.0] * n, [1.0] * n),
            (good, [1.0] * g, [1.0] * g),  # in the same batch, unharmed
            (good, [-1.0] * g, [1.0] * g),
            (good, [float("nan")] * g, [1.0] * g),
        ]
    )
    assert timings[0] is None and timings[2] is None and timings[3] is None
    assert timings[1] is not None
    assert timings[1].makespan == simulate(plain, lambda a: 1.0).makespan
