"""Seq1F1B orders: torch's validators and the ordering rules over a grid, with mock stages."""

from __future__ import annotations

import itertools

import pytest
from mockstages import mock_stages
from tiers import fast_at

import seq1f1b._runtime as rt
from seq1f1b import ScheduleInterleavedSeq1F1B, ScheduleSeq1F1B, ScheduleZBSeq1F1B
from seq1f1b._runtime import Action, ComputationType
from seq1f1b._runtime import reference as torch_ref
from seq1f1b.orders.order import OrderSpec, build_orders, seq1f1b_warmup

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD


def _fmt(a: Action, k: int) -> str:
    m, s = divmod(a.microbatch_index, k)
    return f"{a.computation_type.value}{m}.{s}"


@pytest.mark.fast
def test_published_example_p4_m3_k2() -> None:
    sched = ScheduleSeq1F1B(mock_stages(4, 1), n_microbatches=3, seq_chunks=2)
    order = sched.pipeline_order
    assert " ".join(_fmt(a, 2) for a in order[0]) == (
        "F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0 B1.1 B1.0 B2.1 B2.0"
    )
    assert " ".join(_fmt(a, 2) for a in order[3]) == (
        "F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 F2.0 B1.0 F2.1 B2.1 B2.0"
    )


def _check_rules(order: dict[int, list[Action]], spec: OrderSpec) -> None:
    k = spec.seq_chunks
    for rank, actions in order.items():
        assert all(a.computation_type in (F, B) for a in actions)
        last_sample_f: dict[int, int] = {}
        next_f: dict[tuple[int, int], int] = {}
        next_b: dict[tuple[int, int], int] = {}
        for a in actions:
            m, seg = divmod(a.microbatch_index, k)
            key = (a.stage_index, m)
            assert spec.stage_to_rank(a.stage_index) == rank
            if a.computation_type == F:
                assert seg == next_f.get(key, 0), f"forward segment order {a}"
                next_f[key] = seg + 1
                # samples FIFO per stage
                assert m >= last_sample_f.get(a.stage_index, 0)
                last_sample_f[a.stage_index] = m
            else:
                assert seg == next_b.get(key, k - 1), f"backward segment order {a}"
                assert next_f.get(key, 0) > seg
                next_b[key] = seg - 1
        if spec.stages_per_rank == 1:
            warm = seq1f1b_warmup(spec.pp, rank, spec.n_units, k)
            first_b = next(i for i, a in enumerate(actions) if a.computation_type == B)
            assert first_b == min(warm + 1, spec.n_units), (rank, first_b, warm)
            # samples FIFO in backward: sample index never decreases
            ms = [a.microbatch_index // k for a in actions if a.computation_type == B]
            assert ms == sorted(ms)


# FSDP and gradient-reduction actions (torch's replay knows none of them), and send waits
FSDP = {
    k
    for k in (
        ComputationType.UNSHARD,
        ComputationType.RESHARD,
        ComputationType.REDUCE_GRAD,
        rt.WAIT_REDUCE_GRAD,
    )
    if k is not None
}
NOT_IN_SEND_RECV = FSDP | {k for k in (rt.WAIT_SEND_F, rt.WAIT_SEND_B) if k is not None}
GRID = list(itertools.product(range(1, 9), range(1, 4), range(1, 9), range(1, 9)))


# pp = 7, 8: the same rules at the largest sizes (a quarter of the time), on the default release
LARGEST = [pytest.param(pp, marks=pytest.mark.default_release_only) for pp in (7, 8)]


@pytest.mark.parametrize("pp", [*fast_at(range(1, 7), 2, 4), *LARGEST])
def test_grid_passes_torch_validators_and_rules(pp: int) -> None:
    for _, spr, m, k in (g for g in GRID if g[0] == pp):
        sched = ScheduleSeq1F1B(mock_stages(pp, spr), n_microbatches=m, seq_chunks=k)
        spec = sched.order_spec
        order = sched.pipeline_order
        assert sched.n_units == m * k
        torch_ref.validate_schedule(order, pp, pp * spr, m * k)
        comms = torch_ref.add_send_recv(
            {r: list(a) for r, a in order.items()}, spec.stage_to_rank, spec.num_stages
        )
        torch_ref.simulate_comms_compute(comms, spec.stage_to_rank, spec.num_stages)
        _check_rules(order, spec)
        # ours, fully lowered on every rank (with 2.15's WAIT_SEND), passes torch's replay, and
        # its SEND/RECV placement is torch's
        lowered = {
            r: [a for a in acts if a.computation_type not in FSDP]
            for r, acts in sched.pipeline_order_with_comms.items()
        }
        torch_ref.simulate_comms_compute(lowered, spec.stage_to_rank, spec.num_stages)
        p2p = [a for a in lowered[0] if a.computation_type not in NOT_IN_SEND_RECV]
        assert p2p == comms[0]


@pytest.mark.parametrize("pp", [*fast_at(range(1, 7), 2), *LARGEST])
def test_zero_bubble_grid_passes_torch_validators(pp: int) -> None:
    """ZBSeq1F1B over the grid: torch's validator and comms simulator accept it, each split
    backward is I then W at once (the first stage keeps B), and merging them gives back the
    Seq1F1B order exactly."""
    I, W = ComputationType.BACKWARD_INPUT, ComputationType.BACKWARD_WEIGHT  # noqa: E741
    for _, spr, m, k in (g for g in GRID if g[0] == pp):
        sched = ScheduleZBSeq1F1B(mock_stages(pp, spr), n_microbatches=m, seq_chunks=k)
        spec, order = sched.order_spec, sched.pipeline_order
        torch_ref.validate_schedule(order, pp, pp * spr, m * k)
        comms = torch_ref.add_send_recv(
            {r: list(a) for r, a in order.items()}, spec.stage_to_rank, spec.num_stages
        )
        torch_ref.simulate_comms_compute(comms, spec.stage_to_rank, spec.num_stages)
        lowered = {
            r: [a for a in acts if a.computation_type not in FSDP]
            for r, acts in sched.pipeline_order_with_comms.items()
        }
        torch_ref.simulate_comms_compute(lowered, spec.stage_to_rank, spec.num_stages)
        plain = build_orders(OrderSpec(pp, spr, m, k))
        for r, acts in order.items():
            merged = []
            for a in acts:
                if a.computation_type == W:
                    assert merged[-1] == Action(a.stage_index, I, a.microbatch_index)
                    merged[-1] = Action(a.stage_index, B, a.microbatch_index)
                else:
                    assert a.computation_type != B or a.stage_index == 0
                    merged.append(a)
            assert merged == plain[r]


@pytest.mark.fast
def test_interleaved_when_k_does_not_divide_pp() -> None:
    # the published interleaved code silently needs K | pp; here K=3, pp=4 must work
    for pp, k in ((4, 3), (3, 2), (6, 4), (2, 5)):
        sched = ScheduleInterleavedSeq1F1B(mock_stages(pp, 2), n_microbatches=4, seq_chunks=k)
        _check_rules(sched.pipeline_order, sched.order_spec)


def test_bubble_shrinks_with_k() -> None:
    # unit-cost replay: more segments -> fewer idle steps relative to work
    def idle_ratio(k: int) -> float:
        order = build_orders(OrderSpec(4, 1, 4, k))
        comms = torch_ref.add_send_recv({r: list(a) for r, a in order.items()}, lambda s: s, 4)
        sim = torch_ref.simulate_comms_compute(comms, lambda s: s, 4)
        compute = [[a for a in sim[r] if a is None or a.computation_type in (F, B)] for r in sim]
        steps = max(len(s) for s in sim.values())
        busy = sum(1 for r in compute for a in r if a is not None)
        return (4 * steps - busy) / busy

    assert idle_ratio(4) < idle_ratio(2) < idle_ratio(1)


@pytest.mark.fast
def test_csv_round_trip(tmp_path) -> None:
    sched = ScheduleSeq1F1B(mock_stages(4, 2, rank=1), n_microbatches=3, seq_chunks=4)
    path = tmp_path / "order.csv"
    sched.dump_csv(str(path), format="compute_only")
    other = ScheduleSeq1F1B(mock_stages(4, 2, rank=1), n_microbatches=3, seq_chunks=4)
    other.pipeline_order = {}
    other.load_csv(str(path))
    assert other.pipeline_order == sched.pipeline_order
    assert other.pipeline_order_with_comms == sched.pipeline_order_with_comms
    # torch's plain runtime loads the same file too
    plain = torch_ref.plain_runtime(mock_stages(4, 2, rank=1), n_microbatches=12)
    torch_ref.load_csv(plain, str(path))
    assert plain.pipeline_order == sched.pipeline_order


def test_csv_with_wrong_segment_order_is_refused(tmp_path) -> None:
    sched = ScheduleSeq1F1B(mock_stages(2, 1), n_microbatches=1, seq_chunks=2)
    path = tmp_path / "order.csv"

    def load(codes: str) -> None:
        """The same actions on every rank, e.g. "F0 F1 I1 W1 B0"."""
        acts = [(ComputationType.from_str(c[0]), int(c[1:])) for c in codes.split()]
        rows = [",".join(str(Action(r, t, u)) for t, u in acts) for r in sched.pipeline_order]
        path.write_text("\n".join(rows) + "\n")
        sched.load_csv(str(path))

    with pytest.raises(ValueError, match="backward out of order"):
        load("F0 F1 B0 B1")  # GPipe-style ascending backward
    load("F0 F1 I1 W1 B0")  # a split backward keeps the K/V gradients (in segment order)
    with pytest.raises(ValueError, match="backward out of order"):
        load("F0 F1 I0 I1 W0 W1")
