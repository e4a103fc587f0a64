"""Per-sample kwargs cut into segments: tensors along the sequence, plain values as they are,
and a structured value holding tensors (a full-sequence attention mask) refused, not copied
into every segment."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from seq1f1b.schedules.microbatch import split_presplit_units

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

LENGTHS = [6, 4, 2]


class VarlenLike(NamedTuple):
    cu_seq: torch.Tensor
    max_len: int


def _split(kwargs: dict, seq_dims: dict | None = None) -> list[dict]:
    args = [(torch.zeros(1, 12),)]
    _, units, _ = split_presplit_units(args, [kwargs], None, LENGTHS, 1, seq_dims)
    return units


def test_positions_are_cut_and_plain_values_repeated() -> None:
    pos = torch.arange(12).unsqueeze(0)
    units = _split({"positions": pos, "flag": True})
    want = [[list(range(6))], [[6, 7, 8, 9]], [[10, 11]]]
    assert [u["positions"].tolist() for u in units] == want
    assert all(u["flag"] is True for u in units)


@pytest.mark.parametrize(
    "mask",
    [
        VarlenLike(torch.tensor([0, 12]), 12),
        {"cu_seq": torch.tensor([0, 12])},
        pytest.param("block_mask", id="BlockMask"),
    ],
)
def test_full_sequence_masks_are_refused(mask: object) -> None:
    if mask == "block_mask":
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 12, 12, device="cpu")
    with pytest.raises(ValueError, match=r"kwarg 'attention_masks' is a \w+ holding tensors"):
        _split({"attention_masks": mask})
    # replicated on purpose: allowed
    units = _split({"attention_masks": mask}, {"attention_masks": None})
    assert all(u["attention_masks"] is mask for u in units)
