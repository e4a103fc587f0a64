"""seq1f1b: sequence-level pipeline parallelism (Seq1F1B) for torch.distributed.pipelining."""

from .attention.attention_op import add_layer_key, checkpoint_save_ops, segment_positions
from .attention.carried import CarriedState, carried_state
from .attention.gated_deltanet import ChunkAwareGatedDeltaNet
from .attention.kv import SegmentInfo, current_segment, packed_documents
from .attention.layer import ChunkAwareAttention, chunk_aware_attention, latent_attention
from .bitpipe import ScheduleBitPipe, build_bitpipe_stages
from .chunked_loss import ChunkedLoss
from .schedules.options import ContextParallelConfig, SequenceSplit
from .schedules.partition import (
    LatentKV,
    LinearAttention,
    ModelShape,
    compute_balanced_split,
    resolve_split,
    segment_multiple,
    uniform_split,
)
from .schedules.schedule import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleZBSeq1F1B,
    ScheduleZBVSeq1F1B,
)
from .verify import VerificationReport, verify_model

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``MemoryCappedSplit`` comes from the planning layer, a tool on the library: imported
    when first asked for, so ``import seq1f1b`` does not load the planner."""
    if name == "MemoryCappedSplit":
        from .planning.split_search import MemoryCappedSplit

        return MemoryCappedSplit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CarriedState",
    "ChunkAwareAttention",
    "ChunkAwareGatedDeltaNet",
    "ChunkedLoss",
    "ContextParallelConfig",
    "LatentKV",
    "LinearAttention",
    "MemoryCappedSplit",
    "ModelShape",
    "ScheduleBitPipe",
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "ScheduleZBSeq1F1B",
    "ScheduleZBVSeq1F1B",
    "SegmentInfo",
    "SequenceSplit",
    "VerificationReport",
    "add_layer_key",
    "build_bitpipe_stages",
    "carried_state",
    "checkpoint_save_ops",
    "chunk_aware_attention",
    "compute_balanced_split",
    "current_segment",
    "latent_attention",
    "packed_documents",
    "resolve_split",
    "segment_multiple",
    "segment_positions",
    "uniform_split",
    "verify_model",
]
