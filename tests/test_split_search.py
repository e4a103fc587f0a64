"""split="memory_capped" (seq1f1b.planning.split_search): the cap holds, the search beats the
uniform split where the simulator says it can, the fallback is said, and bad input names the fix."""

from __future__ import annotations

import itertools
import warnings

import pytest
from mockstages import mock_stages

from seq1f1b import (
    MemoryCappedSplit,
    ModelShape,
    ScheduleSeq1F1B,
    ScheduleZBSeq1F1B,
    SequenceSplit,
    resolve_split,
)
from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning.simulate import FlopsCosts, simulate
from seq1f1b.planning.split_search import (
    memory_capped_split,
    search_capped_split,
    stage_token_bytes,
)
from seq1f1b.schedules.partition import uniform_split

# the quick benchmark's model (dim 128, 4 layers, SwiGLU 344 -> 516, vocab 1024)
QUICK = ModelShape(hidden=128, n_heads=2, n_layers=4, vocab=1024, ffn_hidden=516)
# attention-light: 24 tokens, so per-token costs dominate and the uniform split is best
LIGHT = ModelShape(hidden=64, n_heads=4, n_layers=2, vocab=128)


def _peak_and_time(lengths: list[int], order: OrderSpec, dtype_bytes: int) -> tuple[float, float]:
    """Recomputed independently of the search: the weighted peak and the makespan."""
    costs = FlopsCosts(QUICK, tuple(lengths), order.num_stages, order.pp)
    res = simulate(build_orders(order), costs.cost, activation=costs.activation)
    weights = stage_token_bytes(QUICK, order.num_stages, dtype_bytes)
    return max(weights[s] * v for s, v in res.peak_activation_stage.items()), res.makespan


@pytest.mark.parametrize(
    ("pp", "spr", "m", "k", "cap"),
    [
        (p, v, m, k, c)
        for p, v, m, k, c in itertools.product((2, 4), (1, 2), (2, 4), (2, 4, 8), (1.0, 1.2))
        if not (v == 2 and k == 8)  # keeps the test fast
    ],
)
def test_cap_is_respected_and_never_slower_than_uniform(
    pp: int, spr: int, m: int, k: int, cap: float
) -> None:
    order = OrderSpec(pp, spr, m, k)
    found = search_capped_split(4096, k, QUICK, order, multiple_of=64, cap=cap, dtype_bytes=4)
    assert len(found.lengths) == k and sum(found.lengths) == 4096
    assert all(n > 0 and n % 64 == 0 for n in found.lengths)
    peak, time = _peak_and_time(found.lengths, order, 4)
    u_peak, u_time = _peak_and_time(uniform_split(4096, k, 64), order, 4)
    assert peak <= cap * u_peak * (1 + 1e-9), (found.lengths, peak / u_peak)
    assert time <= u_time * (1 + 1e-9)
    assert (found.fallback is None) == (found.lengths != uniform_split(4096, k, 64))


@pytest.mark.parametrize("k", [4, 8])
def test_faster_than_uniform_at_the_uniform_peak(k: int) -> None:
    """pp=2, M=2 at 4096 tokens: the benchmark's setting. At the uniform split's peak the search
    finds a symmetric-ish split (short ends) that the simulator runs faster; a looser cap is
    faster still and uses its room."""
    order = OrderSpec(2, 1, 2, k)
    tight = search_capped_split(4096, k, QUICK, order, cap=1.0, dtype_bytes=4)
    loose = search_capped_split(4096, k, QUICK, order, cap=1.2, dtype_bytes=4)
    assert tight.fallback is None
    assert tight.time < 0.99 * tight.uniform_time
    assert tight.lengths[0] < 4096 // k and tight.lengths[-1] < 4096 // k
    assert loose.time < 0.97 * tight.time
    assert tight.peak < loose.peak <= 1.2 * loose.uniform_peak * (1 + 1e-9)


def test_last_stage_weighs_more_with_its_loss_state() -> None:
    fp32 = stage_token_bytes(QUICK, 2, 4)
    bf16 = stage_token_bytes(QUICK, 2, 2)
    assert fp32[0] < fp32[1] and fp32[1] - fp32[0] == 4 * QUICK.vocab  # fp32 log-probs
    assert bf16[1] / bf16[0] > fp32[1] / fp32[0]  # the log-probs stay fp32 in bf16


def test_falls_back_to_uniform_and_says_why() -> None:
    order = OrderSpec(2, 1, 2, 4)
    found = search_capped_split(24, 4, LIGHT, order)
    assert found.lengths == [6, 6, 6, 6]
    assert found.fallback is not None and "memory_cap" in found.fallback
    heard: list[str] = []
    assert memory_capped_split(24, 4, LIGHT, order, warn=heard.append) == [6, 6, 6, 6]
    assert len(heard) == 1 and "keeps the uniform split" in heard[0]
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=MemoryCappedSplit(model_shape=LIGHT))
    with pytest.warns(UserWarning, match="raise memory_cap"):
        assert sched.split_lengths(24) == [6, 6, 6, 6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ScheduleSeq1F1B(
            mock_stages(2, 1), 2, 1, seq_split=MemoryCappedSplit(model_shape=LIGHT)
        ).split_lengths(24) == [24]


@pytest.mark.parametrize("cls", [ScheduleSeq1F1B, ScheduleZBSeq1F1B])
def test_schedule_uses_its_own_order(cls: type) -> None:
    """The schedule resolves the split on its order (pp, stages per rank, M, K, split
    backward), identically on every rank."""
    split = MemoryCappedSplit(model_shape=QUICK, memory_cap=1.1, dtype_bytes=4, multiple_of=8)
    got = [cls(mock_stages(2, 1, r), 2, 4, seq_split=split).split_lengths(4096) for r in (0, 1)]
    order = OrderSpec(2, 1, 2, 4, split_backward=cls is ScheduleZBSeq1F1B)
    want = memory_capped_split(4096, 4, QUICK, order, multiple_of=8, cap=1.1, dtype_bytes=4)
    assert got == [want, want]
    assert want != uniform_split(4096, 4, 8) and all(n % 8 == 0 for n in want)


def test_errors_name_the_constraint_and_the_fix() -> None:
    shape_fix = r"needs the model shape.*MemoryCappedSplit\('memory_capped', model_shape="
    with pytest.raises(ValueError, match=shape_fix):
        ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=MemoryCappedSplit())
    with pytest.raises(ValueError, match=r"the planning layer does.*MemoryCappedSplit"):
        ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=SequenceSplit("memory_capped", QUICK))
    with pytest.raises(ValueError, match=r"MemoryCappedSplit has mode 'compute'"):
        ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=MemoryCappedSplit("compute", QUICK))
    for bad in (0, -1.0, "1.2", True, float("nan")):
        with pytest.raises(ValueError, match="memory_cap must be a number > 0"):
            split = MemoryCappedSplit(model_shape=QUICK, memory_cap=bad)
            ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=split)
    with pytest.raises(ValueError, match="dtype_bytes"):
        split = MemoryCappedSplit(model_shape=QUICK, dtype_bytes=3)
        ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=split)
    with pytest.raises(ValueError, match=r"resolve_split does not know.*MemoryCappedSplit"):
        resolve_split("memory_capped", 4096, 4, shape=QUICK)
    with pytest.raises(ValueError, match=r"simulates the schedule's order.*OrderSpec"):
        MemoryCappedSplit(model_shape=QUICK).lengths(4096, 4)
    with pytest.raises(ValueError, match="multiple of 64"):  # the seq_len check is uniform's
        search_capped_split(4000, 4, QUICK, OrderSpec(2, 1, 2, 4), multiple_of=64)
    with pytest.raises(ValueError, match="needs the model shape"):
        search_capped_split(4096, 4, None, OrderSpec(2, 1, 2, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seq_chunks=4 but the split asks for 8.*seq_chunks=8"):
        search_capped_split(4096, 8, QUICK, OrderSpec(2, 1, 2, 4))
    # fails at construction when the length is fixed
    with pytest.raises(ValueError, match="multiple of 64"):
        split = MemoryCappedSplit(model_shape=QUICK, multiple_of=64, seq_len=4000)
        ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=split)
