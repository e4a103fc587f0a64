"""Build one rank's four BitPipe stages and its pair group from one model's layer chunks."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .layout import BitPipeLayout, BitPipeStage
from .sync import broadcast_twins, new_pair_group

__all__ = ["BitPipeStages", "build_bitpipe_stages"]

ChunkBuilder = Callable[[Sequence[int]], Sequence[nn.Module]]


class BitPipeStages(NamedTuple):
    """What ``ScheduleBitPipe`` needs: this rank's stages and its pair group."""

    stages: list[BitPipeStage]
    pair_group: dist.ProcessGroup


def _builder(chunks: Sequence[nn.Module] | ChunkBuilder, n_chunks: int) -> ChunkBuilder:
    if callable(chunks) and not isinstance(chunks, nn.Module):
        return chunks
    if isinstance(chunks, nn.Module) and not isinstance(chunks, nn.ModuleList | nn.Sequential):
        raise ValueError("chunks must be a list of 2*pp modules, or a function building them")
    modules = list(chunks)  # type: ignore[arg-type]
    if len(modules) != n_chunks:
        raise ValueError(
            f"BitPipe cuts the model into 2*pp = {n_chunks} layer chunks (one per stage of a "
            f"replica), but {len(modules)} modules were given"
        )

    def build(indices: Sequence[int]) -> list[nn.Module]:
        # one deepcopy per replica: a weight shared between its chunks stays shared
        return copy.deepcopy([modules[i] for i in indices])

    return build


def build_bitpipe_stages(
    chunks: Sequence[nn.Module] | ChunkBuilder,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    *,
    pair_group: dist.ProcessGroup | None = None,
) -> BitPipeStages:
    """This rank's four stages (two per replica), with both replicas starting identical.

    Args:
        chunks: the model's ``2*pp`` layer chunks in order (each rank deep-copies the four it
            needs, twice over for the two replicas; the given modules stay untouched), or a
            function ``build(chunk_indices) -> modules`` called once per replica with that
            replica's chunk indices on this rank -- build only those, and tie weights between
            them there (e.g. the embedding of chunk 0 and the output head of chunk 2pp-1,
            which replica A holds together on rank 0 and replica B on rank pp-1).
        device: where this rank's stages run.
        group: the pipeline process group (default: the whole world).
        pair_group: this rank's 2-rank group with rank pp-1-r; made here if not given
            (collective: every rank of the default group calls this function then).

    Each chunk's parameters and buffers are broadcast from its replica-A copy to its B copy,
    so a function that initialises randomly still gives identical replicas.
    """
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = BitPipeLayout(pp)
    build = _builder(chunks, layout.replica_stages)
    mine = layout.stages_of(rank)
    modules: dict[int, nn.Module] = {}
    for replica in (0, 1):
        ids = [g for g in mine if layout.replica(g) == replica]
        built = list(build([layout.chunk(g) for g in ids]))
        if len(built) != len(ids) or not all(isinstance(m, nn.Module) for m in built):
            raise ValueError(
                f"the chunk builder returned {len(built)} objects for chunks "
                f"{[layout.chunk(g) for g in ids]}: return one nn.Module per requested chunk"
            )
        modules.update(zip(ids, built, strict=True))
    stages = [
        BitPipeStage(modules[g].to(device), g, layout.num_stages, device, group=group) for g in mine
    ]
    if pair_group is None:
        pair_group = new_pair_group(group)
    broadcast_twins(stages, layout, pair_group)
    return BitPipeStages(stages, pair_group)
