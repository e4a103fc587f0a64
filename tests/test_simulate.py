"""The cost-model simulator against closed forms, torch's orders, and its own error paths."""

from __future__ import annotations

import pytest
from mockstages import MockStage, mock_stages
from torch.distributed.pipelining.schedules import (
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from seq1f1b._runtime import Action, ComputationType
from seq1f1b.bitpipe import build_bitpipe_orders
from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning.simulate import FlopsCosts, compute_actions, simulate, simulate_blocking
from seq1f1b.registry import lookup
from seq1f1b.schedules.partition import ModelShape, resolve_split

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
BI, BW = ComputationType.BACKWARD_INPUT, ComputationType.BACKWARD_WEIGHT
SHAPE_7B = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=50304)


def unit_cost(k: int = 1, v: int = 1):
    """Equal costs: F = 1/(v*k), B = 2F, I = W = F (a sample's work is the same for any K)."""

    def cost(a: Action) -> float:
        base = 1.0 / (k * v)
        return 2 * base if a.computation_type == B else base

    return cost


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_1f1b_bubble_and_memory_match_closed_form(pp: int, m: int) -> None:
    res = simulate(build_orders(OrderSpec(pp, 1, m, 1)), unit_cost())
    assert res.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))
    assert res.bubble_over_compute == pytest.approx((pp - 1) / m)
    assert res.peak_activation_stage[0] == min(pp, m)
    assert res.peak_activation_stage[pp - 1] == 1


@pytest.mark.parametrize("pp,m,k", [(2, 2, 4), (4, 8, 2), (4, 8, 4), (8, 8, 8), (8, 16, 4)])
def test_seq1f1b_equal_cost_bubble_matches_formula(pp: int, m: int, k: int) -> None:
    res = simulate(build_orders(OrderSpec(pp, 1, m, k)), unit_cost(k))
    # the simulator is exact: equal-cost units give the formula to rounding error
    assert res.bubble_ratio == pytest.approx((pp - 1) / (k * m + pp - 1), rel=1e-9)
    assert res.makespan == pytest.approx((k * m + pp - 1) * 3 / k)  # F + B = 3 per sample
    # stage 0 holds the published warm-up plus one: (pp + K - 1) units of 1/K sample each
    assert res.peak_activation_stage[0] == min(pp + k - 1, m * k)


def test_interleaved_seq1f1b_bubble() -> None:
    pp, m, k, v = 4, 8, 4, 2
    res = simulate(build_orders(OrderSpec(pp, v, m, k)), unit_cost(k, v))
    assert res.bubble_ratio == pytest.approx((pp - 1) / (v * k * m + pp - 1), rel=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (6, 12), (8, 16)])
def test_bitpipe_orders_match_published_bubble(pp: int, m: int) -> None:
    """Two replicas in one stage id space: with t_b = t_f, (pp-2)/(4M+pp-2) exactly."""
    order = build_bitpipe_orders(pp, m)
    equal = simulate(order, lambda a: 1.0, replicas=2)
    assert equal.bubble_ratio == pytest.approx((pp - 2) / (4 * m + pp - 2))
    assert equal.makespan == 4 * m + pp - 2
    # every rank peaks at 2*pp chunk passes (M/2 per replica runs out first below M = pp)
    assert max(equal.peak_activation_rank.values()) == min(2 * pp, 2 * m)
    # read as one pipeline, replica B's first stage would wait on replica A's last
    with pytest.raises(ValueError, match="cannot finish"):
        simulate(order, lambda a: 1.0)
    with pytest.raises(ValueError, match="2 pipelines"):
        simulate({0: [Action(0, F, 0)], 1: [Action(2, F, 0)]}, lambda a: 1.0, replicas=2)


def test_comm_latency_on_cross_rank_edges_only() -> None:
    order = build_orders(OrderSpec(2, 1, 1, 1))  # F0 -> F1 -> B1 -> B0
    res = simulate(order, unit_cost(), comm_latency=0.5)
    assert res.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    starts = [iv.start for iv in res.timelines[1]]
    assert starts == [pytest.approx(1.5), pytest.approx(2.5)]  # B1 follows F1 with no latency


def test_causal_costs_compute_split_beats_uniform() -> None:
    pp, m, k, seq = 4, 8, 4, 32768
    order = build_orders(OrderSpec(pp, 1, m, k))
    bubbles = {}
    for split in ("uniform", "compute"):
        lengths = resolve_split(split, seq, k, shape=SHAPE_7B)
        costs = FlopsCosts(SHAPE_7B, tuple(lengths), pp, pp)
        bubbles[split] = simulate(order, costs.cost, activation=costs.activation).bubble_ratio
    assert bubbles["compute"] < bubbles["uniform"]
    # equal FLOPs up to whole-token segment lengths: the formula to 0.1%
    assert bubbles["compute"] == pytest.approx((pp - 1) / (k * m + pp - 1), rel=1e-3)


def test_flops_costs_later_uniform_segments_cost_more() -> None:
    costs = FlopsCosts(SHAPE_7B, (8192,) * 4, 4, 4)
    c = costs.segment_costs
    assert c == sorted(c) and c[-1] > 1.2 * c[0]
    f = Action(0, F, 3)
    assert costs.cost(Action(0, B, 3)) == pytest.approx(2 * costs.cost(f))
    assert costs.activation(f) == pytest.approx(0.25)


def test_split_backward_frees_at_w_and_w_waits_for_i() -> None:
    stages = [MockStage(0, 4, 2, 0), MockStage(3, 4, 2, 0)]
    order = ScheduleZBVZeroBubble(stages, 4).pipeline_order
    res = simulate(order, unit_cost(1, 2))
    for tl in res.timelines.values():
        end_i = {
            (iv.action.stage_index, iv.action.microbatch_index): iv.end
            for iv in tl
            if iv.action.computation_type == BI
        }
        for iv in tl:
            if iv.action.computation_type == BW:
                assert iv.start >= end_i[(iv.action.stage_index, iv.action.microbatch_index)]
    # every forward's activation is released by the end
    ranks = {r: compute_actions(a) for r, a in order.items()}
    assert sum(len(a) for a in ranks.values()) == sum(len(t) for t in res.timelines.values())


def test_overlap_f_b_is_expanded_into_its_sub_actions() -> None:
    stages = [MockStage(0, 8, 4, 0), MockStage(7, 8, 4, 0)]
    order = ScheduleDualPipeV(stages, 8).pipeline_order
    assert any(
        a is not None and a.computation_type == ComputationType.OVERLAP_F_B for a in order[0]
    )
    res = simulate(order, unit_cost(1, 2))
    n_f = sum(iv.action.computation_type == F for tl in res.timelines.values() for iv in tl)
    assert n_f == 8 * 8  # 8 stages x 8 microbatches, none lost inside OVERLAP_F_B


def test_torch_interleaved_order_matches_formula() -> None:
    pp, m, v = 4, 8, 2
    order = ScheduleInterleaved1F1B(mock_stages(pp, v), m).pipeline_order
    res = simulate(order, unit_cost(1, v))
    assert res.bubble_ratio == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_deadlock_and_missing_actions_raise() -> None:
    order = {0: [Action(0, B, 0), Action(0, F, 0)], 1: [Action(1, F, 0), Action(1, B, 0)]}
    with pytest.raises(ValueError, match="cannot finish"):
        simulate(order, unit_cost())
    with pytest.raises(ValueError, match="cannot finish"):
        simulate({0: [Action(0, F, 0)], 1: [Action(1, F, 1)]}, unit_cost())


def test_large_pipeline_simulates_exactly() -> None:
    order = build_orders(OrderSpec(64, 1, 128, 8))  # 1024 units on 64 ranks
    res = simulate(order, unit_cost(8))
    assert res.bubble_ratio == pytest.approx(63 / (1024 + 63), rel=1e-9)


def test_torch_1f1b_order_is_repaired_and_matches_formula() -> None:
    order = lookup("1F1B").compute_orders(4, 6)
    res = simulate(order, unit_cost())
    assert res.bubble_ratio == pytest.approx(3 / 9)


def test_after_backward_keeps_memory_across_a_microbatchs_units() -> None:
    """What a backward leaves (``after_backward``) counts from that backward on, on its stage,
    in both simulators; without it each backward frees exactly its forward's activation."""
    F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
    order = {0: [Action(0, F, 0), Action(0, F, 1), Action(0, B, 1), Action(0, B, 0)]}
    kept = {1: 5.0, 0: -5.0}  # unit 1's backward keeps 5, unit 0's frees them

    def after(a: Action) -> float:
        return kept[a.microbatch_index or 0]

    cost = unit_cost(1, 2)
    assert simulate(order, cost).peak_activation_rank[0] == 2.0
    assert simulate(order, cost, after_backward=after).peak_activation_rank[0] == 6.0
    blocking = simulate_blocking(order, cost, after_backward=after)
    assert blocking.peak_activation_rank[0] == 6.0
