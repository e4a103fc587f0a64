"""The schedule's grouped arguments: ``SequenceSplit`` and ``ContextParallelConfig``, and the
flat spellings they replace (still accepted, never mixed with their object)."""

from __future__ import annotations

import pytest
from mockstages import mock_stages

from seq1f1b import (
    ContextParallelConfig,
    ModelShape,
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleZBSeq1F1B,
    SequenceSplit,
)
from seq1f1b.orders.order import OrderSpec, build_orders

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

SHAPE = ModelShape(hidden=64, n_heads=4, n_layers=2, vocab=128)


def test_flat_spellings_build_the_same_split() -> None:
    flat = ScheduleSeq1F1B(mock_stages(2, 1), 2, 3, split="compute", model_shape=SHAPE,
                           split_multiple_of=2, seq_len=96)  # fmt: skip
    grouped = ScheduleSeq1F1B(
        mock_stages(2, 1), 2, 3, split=SequenceSplit("compute", SHAPE, multiple_of=2, seq_len=96)
    )
    assert flat.sequence_split == grouped.sequence_split
    assert flat.segment_lengths(96) == grouped.segment_lengths(96)
    assert sum(grouped.segment_lengths(96)) == 96
    assert all(n % 2 == 0 for n in grouped.segment_lengths(96))
    assert grouped.split == "compute" and flat.split == "compute"


def test_each_step_length_gets_its_own_split() -> None:
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 1, 3, split=SequenceSplit("compute", SHAPE))
    for n in (24, 48, 36):
        lengths = sched.segment_lengths(n)
        assert sum(lengths) == n and len(lengths) == 3
        assert lengths[0] >= lengths[-1]  # causal: later segments cost more per token


def test_mixing_an_object_with_its_flat_spellings_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\['seq_len'\] inside split=SequenceSplit"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, split=SequenceSplit("uniform"), seq_len=8)
    with pytest.raises(ValueError, match=r"\['cp_prefix'\] inside context_parallel="):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, context_parallel=ContextParallelConfig(),
                        cp_prefix="pass_q")  # fmt: skip


def test_grouped_arguments_are_validated_with_the_flat_messages() -> None:
    with pytest.raises(ValueError, match="split='compute' needs the model shape"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, split=SequenceSplit("compute"))
    with pytest.raises(ValueError, match="split has 3 lengths but seq_chunks=2"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, split=SequenceSplit((4, 4, 4)))
    with pytest.raises(ValueError, match="cp_prefix='ring' is unknown"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2,
                        context_parallel=ContextParallelConfig(prefix="ring"))  # fmt: skip
    with pytest.raises(ValueError, match="split_multiple_of must be an integer >= 1"):
        ScheduleSeq1F1B(mock_stages(2, 1), 1, 2, split=SequenceSplit(multiple_of=0))


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
