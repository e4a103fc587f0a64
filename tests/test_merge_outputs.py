"""Segment outputs merged back into whole samples: plain tensors, tuples, and DTensors of a
tensor-parallel last stage, sharded along the sequence (sequence parallelism) or along another
dim, each equal to the whole output (torch's ``merge_chunks`` joins a DTensor's local shards,
which interleaves the segments' shards along a sharded dim)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

from seq1f1b.schedules.microbatch import merge_unit_outputs

pytestmark = pytest.mark.fast  # the fast tier: seconds

LENGTHS = (4, 2, 2)  # one sample's segments, uneven


def _units(full: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's segments of ``full`` (samples, seq, hidden) along dim 1, sample by sample."""
    out = []
    for m in range(full.size(0)):
        out.extend(full[m : m + 1].split(list(LENGTHS), dim=1))
    return out


def test_plain_tensors_and_tuples_merge_to_the_whole_output() -> None:
    full = torch.randn(3, sum(LENGTHS), 5)
    assert torch.equal(merge_unit_outputs(_units(full), 3, 1), full)
    pairs = list(zip(_units(full), _units(2 * full), strict=True))
    first, second = merge_unit_outputs(pairs, 3, 1)
    assert torch.equal(first, full) and torch.equal(second, 2 * full)


def _dtensor_merge(rank: int, world: int, shard_dim: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(2 * sum(LENGTHS) * 4, dtype=torch.float32).reshape(2, -1, 4)
    units = [distribute_tensor(u.contiguous(), mesh, [Shard(shard_dim)]) for u in _units(full)]
    merged = merge_unit_outputs(units, 2, 1)
    got = merged.full_tensor()
    assert torch.equal(got, full), f"rank {rank}, Shard({shard_dim}): {got} != {full}"


@pytest.mark.parametrize("shard_dim", [1, 2], ids=["sequence-sharded", "hidden-sharded"])
def test_dtensor_outputs_merge_to_the_whole_output(shard_dim: int) -> None:
    run_ranks(_dtensor_merge, 2, shard_dim)


def test_dict_outputs_merge_leaf_by_leaf() -> None:
    full = torch.randn(3, sum(LENGTHS), 5)
    units = [{"logits": u, "hidden": 3 * u} for u in _units(full)]
    merged = merge_unit_outputs(units, 3, 1)
    assert set(merged) == {"logits", "hidden"}
    assert torch.equal(merged["logits"], full) and torch.equal(merged["hidden"], 3 * full)


def test_outputs_that_differ_between_segments_are_an_error() -> None:
    full = torch.randn(2, sum(LENGTHS), 5)
    units: list = [{"logits": u} for u in _units(full)]
    units[1] = {"logits": units[1]["logits"], "aux": units[1]["logits"]}
    with pytest.raises(ValueError, match="same structure"):
        merge_unit_outputs(units, 2, 1)
    nested = [(u, (u,)) for u in _units(full)]
    nested[2] = (nested[2][0], (nested[2][0], nested[2][0]))
    with pytest.raises(ValueError, match="same structure"):
        merge_unit_outputs(nested, 2, 1)
