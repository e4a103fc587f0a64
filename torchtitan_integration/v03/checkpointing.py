"""torchtitan 0.3's selective activation checkpointing, saving the chunk-aware attention.

torchtitan's op-level policy saves the outputs of the attention kernels it knows (torch's
SDPA and flash kernels, flex attention) and recomputes every op it does not. Compiled, the
chunk-aware attention is one such op (``seq1f1b::segment_attention``), so under torchtitan's
own policy every backward runs the whole attention forward again. The policy's documented
hook, ``SelectiveAC.get_save_ops``, adds it (:func:`seq1f1b.checkpoint_save_ops`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan.distributed.activation_checkpoint import SelectiveAC

from seq1f1b import checkpoint_save_ops

__all__ = ["ChunkAwareSelectiveAC", "saving_chunk_aware_attention"]


class ChunkAwareSelectiveAC(SelectiveAC):
    """torchtitan's ``SelectiveAC`` whose save list also holds the chunk-aware attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | checkpoint_save_ops()


def saving_chunk_aware_attention(ac_config: Any) -> Any:
    """torchtitan's ``SelectiveAC.Config`` as :class:`ChunkAwareSelectiveAC`'s (same fields);
    any other AC config (none, full, memory budget, a user's own policy) as it is."""
    if type(ac_config) is not SelectiveAC.Config:
        return ac_config
    fields = {f.name: getattr(ac_config, f.name) for f in dataclasses.fields(ac_config)}
    return ChunkAwareSelectiveAC.Config(**fields)
