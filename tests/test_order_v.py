"""ZBV-Seq1F1B's orders: torch's validators and comms simulator over a grid, the Seq1F1B rules,
ZB-V itself at K = 1, the memory bounds, and clear errors for a wrong placement."""

from __future__ import annotations

import itertools

import pytest
from tiers import fast_at

import seq1f1b._runtime as rt
from seq1f1b import ScheduleZBSeq1F1B, ScheduleZBVSeq1F1B
from seq1f1b._runtime import Action, StandInStage
from seq1f1b._runtime import reference as torch_ref
from seq1f1b.orders.order import OrderSpec
from seq1f1b.orders.order_rules import check_order_rules
from seq1f1b.orders.order_v import build_v_orders, rank_peak_units, v_stage_peak_units
from seq1f1b.planning.simulate import simulate
from seq1f1b.registry import lookup

F, B = rt.FORWARD, rt.FULL_BACKWARD
I, W = rt.BACKWARD_INPUT, rt.BACKWARD_WEIGHT  # noqa: E741
GRID = list(itertools.product(range(1, 9), range(1, 9)))  # (M, K) per pp
FSDP = {k for k in (rt.UNSHARD, rt.RESHARD, rt.REDUCE_GRAD, rt.WAIT_REDUCE_GRAD) if k is not None}


def v_stages(pp: int, rank: int) -> list[StandInStage]:
    return [StandInStage(s, 2 * pp, pp, rank) for s in (rank, 2 * pp - 1 - rank)]


def in_flight(actions: list[Action], stages: set[int]) -> int:
    """Most units of ``stages`` held at once by program order (forward to weight half)."""
    held = peak = 0
    for a in actions:
        if a.stage_index not in stages:
            continue
        if a.computation_type == F:
            held += 1
        elif a.computation_type in (W, B):
            held -= 1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp", fast_at(range(1, 9), 2))
def test_grid_passes_torch_validators_and_comms_simulator(pp: int) -> None:
    v_map = {s: min(s, 2 * pp - 1 - s) for s in range(2 * pp)}
    for m, k in GRID:
        sched = ScheduleZBVSeq1F1B(v_stages(pp, 0), n_microbatches=m, seq_chunks=k)
        order, n = sched.pipeline_order, 2 * pp
        assert torch_ref.validate_schedule(order, pp, n, m * k) == v_map
        check_order_rules(order, k)
        comms = torch_ref.add_send_recv({r: list(a) for r, a in order.items()}, v_map.get, n)
        torch_ref.simulate_comms_compute(comms, v_map.get, n)
        lowered = {
            r: [a for a in acts if a.computation_type not in FSDP]
            for r, acts in sched.pipeline_order_with_comms.items()
        }
        torch_ref.simulate_comms_compute(lowered, v_map.get, n)
        for r, acts in order.items():
            # every unit once per stage and kind; stage 0 runs full backwards, the rest I + W
            for s in (r, n - 1 - r):
                kinds = (F, B) if s == 0 else (F, I, W)
                for kind in kinds:
                    got = sorted(
                        a.microbatch_index
                        for a in acts
                        if a.stage_index == s and a.computation_type == kind
                    )
                    assert got == list(range(m * k)), (pp, m, k, r, s, kind)
            # each weight half comes after its input half
            seen_i = set()
            for a in acts:
                if a.computation_type == I:
                    seen_i.add((a.stage_index, a.microbatch_index))
                elif a.computation_type == W:
                    assert (a.stage_index, a.microbatch_index) in seen_i


@pytest.mark.fast
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_k1_is_torchs_zbv_order(pp: int) -> None:
    """At K = 1 the order is torch's ScheduleZBVZeroBubble (its first stage's I then W merged
    into one full backward at W's place), for every M that fills ZB-V's warm-up."""
    for m in range(2 * pp - 1, 2 * pp + 4):
        theirs = lookup("ZBVZeroBubble").compute_orders(pp, m)
        ours = build_v_orders(OrderSpec(pp, 2, m, 1, True, "v"))
        for r in range(pp):
            want = []
            for a in theirs[r]:
                if a is None or (a.stage_index == 0 and a.computation_type == I):
                    continue
                if a.stage_index == 0 and a.computation_type == W:
                    a = Action(0, B, a.microbatch_index)
                want.append(a)
            assert ours[r] == want, (pp, m, r)


def test_memory_bounds_per_stage_and_per_rank() -> None:
    """Program-order peaks equal the formulas when M >= 2 and M*K >= 2p + K, and never exceed
    them; every rank holds at most Seq1F1B's first-stage peak, (p + K - 1) / K samples."""
    for pp, m, k in itertools.product(range(1, 7), range(1, 7), range(1, 7)):
        order = build_v_orders(OrderSpec(pp, 2, m, k, True, "v"))
        full = m >= 2 and m * k >= 2 * pp + k
        for r, acts in order.items():
            both = in_flight(acts, {r, 2 * pp - 1 - r})
            bound = rank_peak_units(pp, m, k)
            assert both <= bound and (both == bound or not full), (pp, m, k, r)
            for s in (r, 2 * pp - 1 - r):
                got, want = in_flight(acts, {s}), v_stage_peak_units(pp, m, k, s)
                assert got == want, (pp, m, k, s, got, want)
        # in units of one sample's activations on a rank: Seq1F1B's stage-0 formula
        entry = lookup("ZBVSeq1F1B")
        assert entry.memory_formula is not None
        seq = lookup("Seq1F1B").memory_formula
        assert seq is not None
        assert entry.memory_formula(pp, m, k, 2) == pytest.approx(seq(pp, m, k, 1))


def test_fewer_bubbles_than_zbseq1f1b_with_equal_costs() -> None:
    """Equal-cost units (F = I = W, B = I + W): the V order idles less than ZBSeq1F1B's, and
    approaches the bubble-free limit M / (M + p - 1) of 1F1B's time as K grows."""

    def cost(a: Action) -> float:
        return 2.0 if a.computation_type == B else 1.0

    for pp, m in ((2, 2), (4, 4), (8, 8)):
        one_f_one_b = simulate(lookup("1F1B").compute_orders(pp, m), lambda a: 2 * cost(a))
        ratios = []
        for k in (2, 4, 8):
            v = simulate(
                build_v_orders(OrderSpec(pp, 2, m, k, True, "v")), lambda a, k=k: cost(a) / k
            )
            zb = ScheduleZBSeq1F1B(
                [StandInStage(0, pp, pp, 0)], n_microbatches=m, seq_chunks=k
            ).pipeline_order
            zbs = simulate(zb, lambda a, k=k: 2 * cost(a) / k)
            assert v.makespan < zbs.makespan, (pp, m, k)
            ratios.append(v.makespan / one_f_one_b.makespan)
        assert ratios == sorted(ratios, reverse=True)
        assert ratios[-1] < m / (m + pp - 1) + 0.03, (pp, m, ratios)


@pytest.mark.fast
def test_wrong_placement_is_refused_with_the_fix() -> None:
    looped = [StandInStage(s, 4, 2, 0) for s in (0, 2)]
    with pytest.raises(ValueError, match=r"V placement.*must hold exactly \[0, 3\]"):
        ScheduleZBVSeq1F1B(looped, n_microbatches=2, seq_chunks=2)
    with pytest.raises(ValueError, match="must hold exactly"):
        ScheduleZBVSeq1F1B([StandInStage(0, 4, 2, 0)], n_microbatches=2, seq_chunks=2)
    with pytest.raises(ValueError, match="V placement holds exactly 2 stages"):
        OrderSpec(2, 3, 2, 2, True, "v")
    with pytest.raises(ValueError, match="placement must be"):
        OrderSpec(2, 1, 2, 2, placement="zigzag")


def test_memory_bound_per_stage_with_one_stage_per_rank() -> None:
    """Seq1F1B and ZBSeq1F1B (one stage per rank): every stage's program-order peak equals
    ``min(M*K, p - s + K - 1)`` (the weight half frees a unit right after its input half)."""
    from seq1f1b.orders.order import build_orders
    from seq1f1b.orders.order import looped_stage_peak_units as looped_peak

    for pp, m, k in itertools.product(range(1, 7), range(1, 7), range(1, 7)):
        for split in (False, True):
            order = build_orders(OrderSpec(pp, 1, m, k, split))
            for r, acts in order.items():
                assert in_flight(acts, {r}) == looped_peak(pp, m, k, r), (pp, m, k, r, split)
