"""BitPipe: two V-shaped model replicas in opposite directions over the same pipeline ranks.

See :class:`ScheduleBitPipe` and :func:`build_bitpipe_stages`. The pieces: placement, the
replica-aware stage and the two-chain stage topology (``layout``), orders (``order``), pair
groups and gradient sync (``sync``). Lowering and replay are the library's shared ones
(:mod:`seq1f1b._runtime.lowering`, :mod:`seq1f1b._runtime.replay`).
"""

from .build import BitPipeStages, build_bitpipe_stages
from .layout import BitPipeLayout, BitPipeStage, ReplicaBoundaries
from .order import bitpipe_warmup, build_bitpipe_orders
from .schedule import ScheduleBitPipe
from .sync import new_pair_group

__all__ = [
    "BitPipeLayout",
    "BitPipeStage",
    "BitPipeStages",
    "ReplicaBoundaries",
    "ScheduleBitPipe",
    "bitpipe_warmup",
    "build_bitpipe_orders",
    "build_bitpipe_stages",
    "new_pair_group",
]
