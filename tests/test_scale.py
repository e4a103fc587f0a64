"""Linear-time lowering (seq1f1b._runtime.lowering) equals torch's, and large schedules build and
run.

Build times are measured by benchmarks/scale/build_time.py (no timed unit tests).
"""

from __future__ import annotations

import copy
import itertools
import random
from collections import deque

import pytest
from lowering_checks import unproven_send_waits
from mockstages import MockStage, mock_stages
from tiers import fast_at
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

import seq1f1b._runtime as rt
import seq1f1b._runtime.lowering as lowering
import seq1f1b._runtime.replay as replay_mod
from seq1f1b import ScheduleSeq1F1B, ScheduleZBSeq1F1B, ScheduleZBVSeq1F1B
from seq1f1b._runtime import WAIT_REDUCE_GRAD, Action, ComputationType
from seq1f1b._runtime import reference as torch_ref
from seq1f1b._runtime.lowering import (
    LoweredOrders,
    SendRecvLowering,
    add_unshard_reshard,
    is_lowerable,
)
from seq1f1b._runtime.topology import StageTopology
from seq1f1b.orders.order import OrderSpec, build_orders

C = ComputationType
FSDP = tuple(k for k in (C.UNSHARD, C.RESHARD, C.REDUCE_GRAD, WAIT_REDUCE_GRAD) if k is not None)


#: torch's placement of each backward send's wait (the step's end), which these tests compare
TORCH_WAITS = {"backward_send_waits": "end"}


def _torch_lowering(
    order: dict[int, list[Action | None]], stages: list[MockStage], n_units: int, defer: bool
) -> dict[int, list[Action]]:
    """torch's own lowering (all ranks), on a plain runtime."""
    return torch_ref.lowering(stages, order, n_units, defer_pp_recv=defer)


@pytest.mark.parametrize("pp", fast_at(range(1, 9), 3))
def test_every_rank_equals_torch_lowering(pp: int) -> None:
    # grid pp 1..8 x stages/rank 1..3 x M 1..6 x K 1..4, every rank, with and without defer
    for spr, m, k in itertools.product(range(1, 4), range(1, 7), range(1, 5)):
        expected = _torch_lowering(
            build_orders(OrderSpec(pp, spr, m, k)), mock_stages(pp, spr), m * k, False
        )
        for rank in range(pp):  # torch's placement of the backward sends' waits
            sched = ScheduleSeq1F1B(mock_stages(pp, spr, rank=rank), m, k, **TORCH_WAITS)
            assert isinstance(sched.pipeline_order_with_comms, LoweredOrders)
            assert sched.pipeline_order_with_comms[rank] == expected[rank], (spr, m, k, rank)
        # the other ranks, lowered on access, equal torch's too
        assert dict(sched.pipeline_order_with_comms) == expected
        deferred = ScheduleSeq1F1B(mock_stages(pp, spr), m, k, defer_pp_recv=True,
                                   **TORCH_WAITS)  # fmt: skip
        expected = _torch_lowering(deferred.pipeline_order, mock_stages(pp, spr), m * k, True)
        assert dict(deferred.pipeline_order_with_comms) == expected, (spr, m, k)


def _v_stages(pp: int) -> list[MockStage]:
    return [MockStage(0, 2 * pp, pp, 0), MockStage(2 * pp - 1, 2 * pp, pp, 0)]


def _held_sends(actions: list[Action]) -> int:
    """Backward sends held, summed over the list's compute actions (a proxy for bytes x
    time: each is one unit's input gradient)."""
    pending = total = 0
    for a in actions:
        if a.computation_type == C.SEND_B:
            pending += 1
        elif a.computation_type == C.WAIT_SEND_B:
            pending -= 1
        elif a.computation_type in (C.FORWARD, C.FULL_BACKWARD, C.BACKWARD_INPUT):
            total += pending
    return total


@pytest.mark.fast
@pytest.mark.skipif(not rt.HAS_SEND_WAITS, reason="torch 2.15's WAIT_SEND actions")
def test_backward_send_waits_move_only_where_the_gradient_was_received() -> None:
    """``backward_send_waits="consumed"``: each backward send's wait moves from
    the step's end to where the peer has provably received the gradient (vector clocks over
    every rank's run), nothing else changes, and the sent gradients are held for less."""
    cases = [(ScheduleSeq1F1B, pp, spr, m, k) for pp, spr, m, k in itertools.product(
        (2, 3, 4), (1, 2), (1, 2, 5), (1, 2, 4))]  # fmt: skip
    cases += [(ScheduleZBSeq1F1B, pp, 1, m, 4) for pp, m in itertools.product((2, 4), (1, 3))]
    cases += [(ScheduleZBVSeq1F1B, pp, 2, m, 2) for pp, m in itertools.product((2, 3), (2, 4))]
    fewer = 0
    for cls, pp, spr, m, k in cases:
        stages = _v_stages(pp) if cls is ScheduleZBVSeq1F1B else mock_stages(pp, spr)
        ours, torchs = (dict(cls(stages, m, k, backward_send_waits=w).pipeline_order_with_comms)
                        for w in ("consumed", "end"))  # fmt: skip
        topology = StageTopology.chain(_stage_ranks(cls, pp, spr))
        unproven = unproven_send_waits(ours, topology)  # and no deadlock
        for rank, acts in ours.items():
            tail = [a for a in torchs[rank] if a.computation_type == C.WAIT_SEND_B]
            not_waits = [a for a in acts if a.computation_type != C.WAIT_SEND_B]
            assert not_waits == [a for a in torchs[rank] if a.computation_type != C.WAIT_SEND_B]
            moved = [a for a in acts if a.computation_type == C.WAIT_SEND_B and a not in
                     acts[len(acts) - len(unproven[rank]):]]  # fmt: skip
            assert not set(moved) & set(unproven[rank]), (cls, pp, m, k, rank)
            assert len(moved) + len(unproven[rank]) == len(tail)
            assert acts[len(acts) - len(unproven[rank]):] == unproven[rank]  # left at the end
            assert _held_sends(acts) <= _held_sends(torchs[rank])
            fewer += _held_sends(acts) < _held_sends(torchs[rank])
    assert fewer > len(cases)  # more than one rank a case, on average, holds fewer


def _stage_ranks(cls: type, pp: int, spr: int) -> list[int]:
    if cls is ScheduleZBVSeq1F1B:  # V: stage s on rank min(s, 2pp-1-s)
        return [min(s, 2 * pp - 1 - s) for s in range(2 * pp)]
    return [s % pp for s in range(pp * spr)]


@pytest.mark.fast
def test_torch_schedules_lower_identically() -> None:
    # orders with bubbles (None), split backward (I/W) and V placement (neighbouring stages on
    # one rank): the lowering is torch's for any lowerable order, not only Seq1F1B's
    cases = [
        (ScheduleInterleaved1F1B, spr, pp, m)
        for spr, pp, m in itertools.product((1, 2, 3), (2, 3, 4, 6), (1, 2, 4, 8, 12))
    ]
    cases += [(ScheduleLoopedBFS, 2, pp, m) for pp, m in itertools.product((2, 4), (2, 5))]
    cases += [
        (ScheduleInterleavedZeroBubble, 2, pp, m) for pp, m in itertools.product((2, 4), (4, 8))
    ]
    cases += [(ScheduleZBVZeroBubble, 2, pp, m) for pp, m in itertools.product((2, 3, 4), (4, 8))]
    checked = 0
    for cls, spr, pp, m in cases:
        stages = _v_stages(pp) if cls is ScheduleZBVZeroBubble else mock_stages(pp, spr)
        for defer in (False, True):
            try:
                sched = cls(stages, m, defer_pp_recv=defer)
            except ValueError:
                continue  # a combination torch's schedule refuses
            assert is_lowerable(sched.pipeline_order)
            n_stages = stages[0].num_stages
            topology = StageTopology.chain(
                [sched.stage_index_to_group_rank[s] for s in range(n_stages)]
            )
            low = SendRecvLowering(sched.pipeline_order, topology, m, {"defer_recv": defer})
            for rank in sched.pipeline_order:
                assert low.lower(rank) == sched.pipeline_order_with_comms[rank], (cls, pp, m)
            checked += 1
    assert checked > 60


@pytest.mark.fast
def test_add_unshard_reshard_equals_torch() -> None:
    rng = random.Random(0)
    for n_stages in (1, 2, 3, 4, 6):
        for length in (0, 1, 5, 40):
            acts: list[Action | None] = [
                None
                if rng.random() < 0.1
                else Action(rng.randrange(n_stages), rng.choice((C.FORWARD, C.FULL_BACKWARD)), i)
                for i in range(length)
            ]
            assert add_unshard_reshard(acts) == torch_ref.add_unshard_reshard(list(acts))


@pytest.mark.fast
def test_deadlock_is_reported_like_torch() -> None:
    f, b = C.FORWARD, C.FULL_BACKWARD
    # rank 0 waits for B(0) before its F(0) reached rank 1: torch's lowering cannot schedule it
    bad = {0: [Action(0, b, 0), Action(0, f, 0)], 1: [Action(1, f, 0), Action(1, b, 0)]}
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        SendRecvLowering(bad, StageTopology.chain([0, 1]), 1)


def test_fallback_to_torch_for_other_formats(tmp_path) -> None:
    sched = ScheduleSeq1F1B(mock_stages(4, 2, rank=3), 3, 2)
    path = tmp_path / "comms.csv"
    sched.dump_csv(str(path), format="compute_comms")  # reads every rank
    other = ScheduleSeq1F1B(mock_stages(4, 2, rank=3), 3, 2)
    other.load_csv(str(path), format="compute_comms")  # torch's path: a plain dict
    assert not isinstance(other.pipeline_order_with_comms, LoweredOrders)
    assert other.pipeline_order_with_comms == sched.pipeline_order_with_comms
    # compute-only input with comms in it: torch's error
    bad = {r: list(a) for r, a in sched.pipeline_order.items()}
    bad[0].append(Action(0, C.SEND_F, 0))
    with pytest.raises(ValueError, match="compute-only"):
        sched.lower(bad)


def test_lowered_orders_mapping() -> None:
    sched = ScheduleSeq1F1B(mock_stages(4, 1, rank=2), 2, 2)
    lowered = sched.pipeline_order_with_comms
    assert isinstance(lowered, LoweredOrders)
    assert list(lowered) == [0, 1, 2, 3] and len(lowered) == 4 and 3 in lowered
    assert "lowered=[2]" in repr(lowered)  # only this rank at construction
    plain = copy.deepcopy(lowered)
    assert type(plain) is dict and plain == lowered
    assert "Rank 3" in torch_ref.format_pipeline_order(lowered, error_step_number=1)
    with pytest.raises(KeyError):
        lowered[4]
    lowered[4] = []
    assert lowered[4] == [] and len(lowered) == 5
    del lowered[4]
    assert 4 not in lowered


@pytest.mark.parametrize(("pp", "spr", "m", "k"), [(64, 1, 64, 16), (32, 2, 32, 8)])
def test_large_schedules_validate_and_run_in_simulation(pp: int, spr: int, m: int, k: int) -> None:
    sched = ScheduleSeq1F1B(mock_stages(pp, spr, rank=pp - 1), m, k)
    torch_ref.validate_schedule(sched.pipeline_order, pp, pp * spr, m * k)
    comms = {
        r: [a for a in sched.pipeline_order_with_comms[r] if a.computation_type not in FSDP]
        for r in sched.pipeline_order_with_comms
    }
    # each of this rank's units: F and B per stage, and a RECV and a SEND at each rank border
    mine = comms[pp - 1]
    n_units = m * k
    assert sum(a.computation_type == C.FORWARD for a in mine) == spr * n_units
    assert sum(a.computation_type == C.RECV_F for a in mine) == spr * n_units
    assert sum(a.computation_type == C.SEND_B for a in mine) == spr * n_units
    torch_ref.simulate_comms_compute(comms, sched.order_spec.stage_to_rank, pp * spr)


class _CountingDeque(deque):
    pops = 0

    def popleft(self):  # type: ignore[override]
        _CountingDeque.pops += 1
        return super().popleft()


def test_replays_are_event_driven(monkeypatch: pytest.MonkeyPatch) -> None:
    # a rank is re-run only when something it waits for completes: at most one run per rank
    # plus one per wait, however many ranks (round-robin passes would be ranks x passes)
    monkeypatch.setattr(replay_mod, "deque", _CountingDeque)
    monkeypatch.setattr(lowering, "deque", _CountingDeque)
    for pp, spr, m, k in ((16, 1, 16, 8), (16, 2, 8, 4)):
        _CountingDeque.pops = 0
        orders = build_orders(OrderSpec(pp, spr, m, k))
        n_actions = sum(len(a) for a in orders.values())
        assert _CountingDeque.pops <= pp + n_actions
        _CountingDeque.pops = 0
        SendRecvLowering(orders, StageTopology.chain([s % pp for s in range(pp * spr)]), m * k)
        assert _CountingDeque.pops <= pp + n_actions
