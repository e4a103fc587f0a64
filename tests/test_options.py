"""The schedule's grouped arguments: ``SequenceSplit`` and ``ContextParallelConfig``, the only
way to pass a split's or context parallelism's settings."""

from __future__ import annotations

import inspect

import pytest
from mockstages import mock_stages

from seq1f1b import (
    ContextParallelConfig,
    ModelShape,
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleZBSeq1F1B,
    ScheduleZBVSeq1F1B,
    SequenceSplit,
)
from seq1f1b._runtime import BACKWARD_INPUT, BACKWARD_WEIGHT, FULL_BACKWARD
from seq1f1b._runtime.unit import UnitRuntime
from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.schedules import sequence_schedule, upstream

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

SHAPE = ModelShape(hidden=64, n_heads=4, n_layers=2, vocab=128)


def test_a_split_mode_alone_is_the_split_object() -> None:
    by_name = ScheduleSeq1F1B(mock_stages(2, 1), 2, 3, seq_split=[40, 32, 24])
    grouped = ScheduleSeq1F1B(mock_stages(2, 1), 2, 3, seq_split=SequenceSplit((40, 32, 24)))
    assert by_name.sequence_split == grouped.sequence_split
    assert by_name.seq_split == grouped.seq_split == (40, 32, 24)  # torch's attribute
    split = SequenceSplit("compute", SHAPE, multiple_of=2, seq_len=96)
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 2, 3, seq_split=split)
    assert sched.sequence_split is split and sched.seq_split is None  # not fixed lengths
    lengths = sched.split_lengths(96)
    assert sum(lengths) == 96 and all(n % 2 == 0 for n in lengths)


def test_each_step_length_gets_its_own_split() -> None:
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 1, 3, seq_split=SequenceSplit("compute", SHAPE))
    for n in (24, 48, 36):
        lengths = sched.split_lengths(n)
        assert sum(lengths) == n and len(lengths) == 3
        assert lengths[0] >= lengths[-1]  # causal: later segments cost more per token


@pytest.mark.parametrize(
    "flat",
    [
        {"model_shape": SHAPE},
        {"split_multiple_of": 2},
        {"seq_len": 8},
        {"cp_group": None},
        {"cp_prefix": "pass_q"},
        {"cp_reduce_grads": False},
    ],
)
def test_flat_spellings_are_not_arguments(flat: dict) -> None:
    """Every argument is spelled out in the signature: the settings of a split or of context
    parallelism go inside their objects, never beside them."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(flat))}'"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, **flat)


def test_grouped_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="split='compute' needs the model shape"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, seq_split=SequenceSplit("compute"))
    with pytest.raises(ValueError, match="split has 3 lengths but seq_chunks=2"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, seq_split=SequenceSplit((4, 4, 4)))
    with pytest.raises(ValueError, match="cp_prefix='ring' is unknown"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2,
                        context_parallel=ContextParallelConfig(prefix="ring"))  # fmt: skip
    with pytest.raises(ValueError, match=r"SequenceSplit\.multiple_of must be an integer"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, seq_split=SequenceSplit(multiple_of=0))


@pytest.mark.parametrize(
    ("cls", "spr", "split_backward"),
    [
        (ScheduleSeq1F1B, 1, False),
        (ScheduleSeq1F1B, 2, False),
        (ScheduleInterleavedSeq1F1B, 2, False),
        (ScheduleZBSeq1F1B, 1, True),
        (ScheduleZBSeq1F1B, 2, True),
    ],
)
def test_each_class_computes_its_own_closed_form_order(cls, spr, split_backward) -> None:
    sched = cls(mock_stages(4, spr), 3, 2)
    expected = build_orders(OrderSpec(4, spr, 3, 2, split_backward=split_backward))
    assert sched.pipeline_order == expected
    assert sched.order_spec.split_backward == split_backward


def _params(cls: type) -> list[tuple[str, object, object]]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("cls", [ScheduleSeq1F1B, ScheduleZBSeq1F1B, ScheduleZBVSeq1F1B])
def test_package_classes_take_the_upstream_signature(cls: type) -> None:
    """One definition per schedule: the upstream class's parameters (names, kinds, defaults)
    in its order, then only keyword-only additions."""
    theirs = _params(upstream.ScheduleSeq1F1B)
    mine = _params(cls)
    assert mine[: len(theirs)] == theirs
    added = mine[len(theirs) :]
    assert added and all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in added)
    # the interleaved classes forward everything to the class above them, in both
    assert _params(ScheduleInterleavedSeq1F1B) == _params(upstream.ScheduleInterleavedSeq1F1B)
    assert issubclass(ScheduleInterleavedSeq1F1B, ScheduleSeq1F1B)


def test_positional_arguments_mean_what_upstream_says() -> None:
    """The 9th and 10th positional arguments are seq_dim and seq_split, as upstream."""
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 2, 3, None, None, None, None, True, 1, (8, 4, 4))
    assert sched.seq_dim == 1 and sched.seq_split == (8, 4, 4)


def test_a_whole_backward_order_is_installed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero-bubble schedule on stages whose backward cannot be split (compiled or
    checkpointed) builds the whole-backward order in the base's one installation."""
    installed: list[dict] = []
    original = UnitRuntime.stage_mapping  # each lowering maps the stages of its order once

    def counting(self, actions):  # type: ignore[no-untyped-def]
        installed.append(actions)
        return original(self, actions)

    monkeypatch.setattr(UnitRuntime, "stage_mapping", counting)
    monkeypatch.setattr(sequence_schedule, "unsplittable", lambda stages, cls: True)
    sched = ScheduleZBSeq1F1B(mock_stages(2, 1), 2, 2)
    kinds = {a.computation_type for o in sched.pipeline_order.values() for a in o if a}
    assert FULL_BACKWARD in kinds and not kinds & {BACKWARD_INPUT, BACKWARD_WEIGHT}
    assert len(installed) == 1  # lowered once, the order run
    monkeypatch.setattr(sequence_schedule, "unsplittable", lambda stages, cls: False)
    split = ScheduleZBSeq1F1B(mock_stages(2, 1), 2, 2)
    kinds = {a.computation_type for o in split.pipeline_order.values() for a in o if a}
    assert BACKWARD_WEIGHT in kinds
