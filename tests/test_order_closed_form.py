"""Seq1F1B orders in closed form: every rank on its own, no search, no replay while building.

Over the grid pp 1..8 x stages/rank 1..3 x M 1..8 x K 1..8: the data-dependency replay finds
no rank stuck (every point), torch's validator and comms simulator accept the orders (a
sample), each rank's list is ``rank_order`` alone, and the orders are those of the search
``build_orders`` used to run (re-implemented here: bump a stuck rank's warm-up and replay).
"""

from __future__ import annotations

import ast
import inspect
import itertools

import pytest

import seq1f1b._runtime.replay as replay_mod
import seq1f1b.orders.order as order_mod
from seq1f1b._runtime import Action, ComputationType
from seq1f1b._runtime import reference as torch_ref
from seq1f1b._runtime.replay import replay
from seq1f1b._runtime.topology import StageTopology
from seq1f1b.orders.order import (
    OrderSpec,
    backward_unit_order,
    build_orders,
    rank_order,
    sample_groups,
    seq1f1b_warmup,
    split_backward,
)

F, B = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
GRID = list(itertools.product(range(1, 9), range(1, 4), range(1, 9), range(1, 9)))


def _topology(spec: OrderSpec) -> StageTopology:
    return StageTopology.chain([spec.stage_to_rank(s) for s in range(spec.num_stages)])


def _sequences(spec: OrderSpec, rank: int) -> tuple[list[Action], list[Action]]:
    """One rank's forwards and backwards in the order it runs them (rounds of whole samples;
    per round, local stages up for the forwards, down for the backwards)."""
    p, v, k = spec.pp, spec.stages_per_rank, spec.seq_chunks
    groups = [list(range(spec.n_units))] if v == 1 else sample_groups(spec)
    fwd: list[Action] = []
    bwd: list[Action] = []
    for group in groups:
        back = backward_unit_order(group, k)
        fwd += [Action(local * p + rank, F, u) for local in range(v) for u in group]
        bwd += [Action(local * p + rank, B, u) for local in reversed(range(v)) for u in back]
    return fwd, bwd


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warm: int) -> list[Action]:
    out = fwd[:warm]
    for f, b in zip(fwd[warm:], bwd, strict=False):
        out += [f, b]
    return out + bwd[len(fwd) - warm :]


def _searched_orders(spec: OrderSpec) -> tuple[dict[int, int], dict[int, list[Action]]]:
    """The search build_orders used to run: start interleaved ranks at
    ``(v-1)*R + 2*(pp-r-1) + K-1`` (R = units of the first round), single-stage ranks at
    :func:`seq1f1b_warmup`, and give every rank the replay finds stuck one more warm-up
    forward until none is."""
    seqs = {r: _sequences(spec, r) for r in range(spec.pp)}
    n_local = spec.n_units * spec.stages_per_rank
    warm = {}
    for r in range(spec.pp):
        if spec.stages_per_rank == 1:
            warm[r] = seq1f1b_warmup(spec.pp, r, spec.n_units, spec.seq_chunks)
        else:
            start = (spec.stages_per_rank - 1) * len(sample_groups(spec)[0])
            warm[r] = min(start + 2 * (spec.pp - r - 1) + spec.seq_chunks - 1, n_local)
    while True:
        orders = {r: _one_f_one_b(*seqs[r], warm[r]) for r in range(spec.pp)}
        stuck = replay(orders, _topology(spec)).stuck
        if not stuck:
            return warm, orders
        assert any(warm[r] < n_local for r in stuck), spec
        for r in stuck:
            warm[r] = min(warm[r] + 1, n_local)


@pytest.mark.parametrize("split", [False, True], ids=["seq1f1b", "zb"])
def test_grid_replays_without_a_stuck_rank(split: bool) -> None:
    for pp, v, m, k in GRID:
        spec = OrderSpec(pp, v, m, k, split_backward=split)
        result = replay(build_orders(spec), _topology(spec))
        assert result.finished, (spec, result.stuck)


def test_grid_sample_passes_torch_validators() -> None:
    # torch's passes cost ~8 ms a point: every 5th point of the grid, plus its far corner
    for pp, v, m, k in [*GRID[::5], GRID[-1]]:
        spec = OrderSpec(pp, v, m, k)
        order = build_orders(spec)
        torch_ref.validate_schedule(order, pp, pp * v, m * k)
        comms = torch_ref.add_send_recv(
            {r: list(a) for r, a in order.items()}, spec.stage_to_rank, spec.num_stages
        )
        torch_ref.simulate_comms_compute(comms, spec.stage_to_rank, spec.num_stages)


@pytest.mark.parametrize("split", [False, True], ids=["seq1f1b", "zb"])
def test_rank_order_is_build_orders_rank(split: bool) -> None:
    for pp, v, m, k in GRID[::3]:
        spec = OrderSpec(pp, v, m, k, split_backward=split)
        orders = build_orders(spec)
        assert list(orders) == list(range(pp))
        for r in range(pp):
            assert rank_order(spec, r) == orders[r], (spec, r)


def test_rank_order_builds_one_rank_only() -> None:
    # a rank of a large pipeline without the others: its list names its own stages only
    spec = OrderSpec(64, 2, 64, 4)
    acts = rank_order(spec, 63)
    assert len(acts) == 2 * spec.n_units * spec.stages_per_rank
    assert {a.stage_index for a in acts} == {63, 127}


def test_single_stage_warmup_is_seq1f1b_warmup() -> None:
    for pp, m, k in itertools.product(range(1, 9), range(1, 9), range(1, 9)):
        spec = OrderSpec(pp, 1, m, k)
        for r in range(pp):
            acts = rank_order(spec, r)
            first_b = next(i for i, a in enumerate(acts) if a.computation_type == B)
            assert first_b == min(seq1f1b_warmup(pp, r, m * k, k) + 1, m * k), (spec, r)


@pytest.mark.parametrize("pp", range(1, 9))
def test_orders_equal_the_search(pp: int) -> None:
    for _, v, m, k in (g for g in GRID if g[0] == pp):
        spec = OrderSpec(pp, v, m, k)
        _, searched = _searched_orders(spec)
        assert build_orders(spec) == searched, spec
        zb = build_orders(OrderSpec(pp, v, m, k, split_backward=True))
        assert zb == {r: split_backward(acts) for r, acts in searched.items()}, spec


def test_build_orders_does_not_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_replay(*args: object, **kwargs: object) -> None:
        raise AssertionError("build_orders replayed an order")

    monkeypatch.setattr(replay_mod, "replay", no_replay)
    for spec in (OrderSpec(4, 2, 3, 2), OrderSpec(8, 3, 8, 8, split_backward=True)):
        orders = build_orders(spec)
        assert len(orders) == spec.pp
    # nor can it: order.py imports neither the replay nor the topology it would need
    tree = ast.parse(inspect.getsource(order_mod))
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert (
        not {"replay", "seq1f1b._runtime.replay", "topology", "seq1f1b._runtime.topology"}
        & imported
    )
    assert not hasattr(order_mod, "replay")
