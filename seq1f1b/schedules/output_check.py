"""The first step checks itself: each stage's pipelined outputs of one sample against the same
stage run once over the sequence.

A stage adapted wrongly (RoPE or learned positions taken from the segment, attention that does
not read the earlier segments, a recurrent state not carried) trains silently under Seq1F1B:
the loss barely moves while the gradients are wrong. On the guarded first step (and the first
one after the sequence length changes), each stage keeps its inputs for sample 0 of microbatch 0
in the first two segments and a projection of its outputs; after the step it runs once more
over those two segments at once (no gradients, eagerly, buffers restored, one sample) and
compares. Two segments suffice: a causal stage's outputs there depend on nothing after them,
and segment 1 is the first that reads an earlier segment, so every cross-segment mistake shows
in it. The step's activations are freed by then, so the check adds no peak memory in practice.

Tolerances follow the outputs' precision: fp32 1e-3 (a correct dense stage differs by about
1e-7, compiled 1e-6: only the attention's merge of segments is summed in another order; one
with torchtitan's routed experts, whose GEMMs run in bf16, by 1.3e-4); bf16 / fp16 2e-2, about
five units in the last place (a correct stage: 2e-3 to 4e-3, the rounding of its output). A
position error at initialisation moves a stage's outputs by about 1e-2; in bf16 an error
under 2e-2 passes, and ``seq1f1b.verify_model`` (fp32) is the finer check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._runtime import small_buffers_kept
from ..attention.kv import SegmentInfo, StageKVState, UnitContext, activate
from ..attention.masks import RowGroups

logger = logging.getLogger(__name__)

__all__ = ["OutputMismatchError", "WholeSequenceCheck", "output_mismatch_error", "tolerance"]

#: the segments compared: 0 (no cache read) and 1 (the first that reads one)
SEGMENTS = 2
#: random directions each output position is projected on (what is kept of the outputs)
DIRECTIONS = 8


class OutputMismatchError(RuntimeError):
    """A stage's pipelined outputs differ from the stage run over the whole sequence."""

    def __init__(self, message: str, stage_index: int, segment: int, error: float) -> None:
        super().__init__(message)
        self.stage_index, self.segment, self.error = stage_index, segment, error


def tolerance(dtype: torch.dtype) -> float:
    """The relative error a correct stage stays under, for outputs of ``dtype``."""
    return 1e-3 if torch.finfo(dtype).bits >= 32 else 2e-2


def output_mismatch_error(stage_index: int, segment: int, error: float, dtype: torch.dtype):
    """The named error of a stage whose outputs differ (raised on every rank)."""
    where = "from its first segment" if segment == 0 else f"in segment {segment}, not before"
    if segment == 0:
        cause = (
            "even the first segment differs, so the stage's forward depends on the sequence "
            "length or the segment itself (a norm or pooling over the sequence, a length-"
            "dependent buffer, randomness other than dropout)"
        )
    else:
        cause = (
            "positions taken from the segment instead of the sequence (RoPE or learned "
            "positions from arange(segment length): use seq1f1b.current_segment().positions() "
            "or seq1f1b.segment_positions), attention that does not read the earlier segments' "
            "K/V (not chunk-aware), or a recurrent layer (Gated DeltaNet, Mamba) that restarts "
            "each segment from a zero state: carry it with seq1f1b.carried_state(layer) (or use "
            "seq1f1b.ChunkAwareGatedDeltaNet)"
        )
    return OutputMismatchError(
        f"Seq1F1B first-step check: stage {stage_index}'s outputs differ {where} from the same "
        f"stage run over the whole sequence (relative error {error:.1e} > {tolerance(dtype):.0e} "
        f"for {dtype} outputs; no optimizer step has run). Likely cause: {cause}. "
        "seq1f1b.verify_model(...) reports the first differing parameter; check_attention=False "
        "([seq1f1b] first_step_check = false) turns the first-step checks off.",
        stage_index,
        segment,
        error,
    )


@dataclass
class _Kept:
    """What one stage keeps of sample 0's first segments: inputs, and projected outputs."""

    args: list[tuple] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)  # (length, DIRECTIONS) fp32
    dtype: torch.dtype = torch.float32


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _sharded_along(t: Any, dim: int) -> bool:
    """A DTensor sharded along ``dim`` (a plain tensor is not)."""
    places = getattr(t, "placements", ())
    return any(getattr(p, "dim", None) in (dim, dim - t.dim()) for p in places)


def _first_output(out: Any, seq_dim: int) -> torch.Tensor | None:
    """The stage's (first) floating-point output, as a plain tensor. A DTensor is compared by
    its local part (torchtitan's vocabulary-parallel logits: each rank its own columns); one
    sharded along the sequence is not compared."""
    t = _first(out)
    if hasattr(t, "to_local"):
        if _sharded_along(t, seq_dim):
            return None
        t = t.to_local()
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


def _row0(x: Any, batch: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch:
        return x.detach()[:1].clone()
    return x


class WholeSequenceCheck:
    """Keeps, on a checked step, each stage's sample 0 of its first :data:`SEGMENTS` segments
    (:meth:`keep`), then compares it with the stage over those segments at once (:meth:`run`)."""

    def __init__(self, seq_dim: int) -> None:
        self.seq_dim = seq_dim
        self._kept: dict[int, _Kept] = {}
        self._sharded: set[int] = set()  # stages whose segments are sequence shards
        self._directions: dict[tuple[int, str], torch.Tensor] = {}

    def reset(self) -> None:
        self._kept, self._sharded = {}, set()

    def wants(self, info: SegmentInfo) -> bool:
        return info.microbatch == 0 and info.segment < SEGMENTS and info.num_segments >= 2

    def keep(self, stage_index: int, length: int, args: tuple, kwargs: dict, out: Any) -> None:
        """One forward of a wanted segment of ``length`` positions (from the stage's forward
        hook). Inputs or outputs shorter than the segment along the sequence are shards of it
        (sequence parallelism passes its local shard between stages): two segments' shards do
        not join into the whole sequence's shard, so such a stage is not compared."""
        t = _first_output(out, self.seq_dim)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or first.dim() <= self.seq_dim:
            return
        if (_sharded_along(_first(out), self.seq_dim) or first.shape[self.seq_dim] != length
                or (t is not None and t.shape[self.seq_dim] != length)):  # fmt: skip
            self._kept.pop(stage_index, None)
            if stage_index not in self._sharded:
                logger.info("Seq1F1B: stage %d: first-step output check skipped (its inputs "
                            "or outputs are shards along the sequence: sequence parallelism)",
                            stage_index)  # fmt: skip
            self._sharded.add(stage_index)
            return
        if t is None:
            return
        batch = first.shape[0]
        kept = self._kept.setdefault(stage_index, _Kept(dtype=t.dtype))
        kept.args.append(tuple(_row0(a, batch) for a in args))
        kept.kwargs.append({k: _row0(v, batch) for k, v in kwargs.items()})
        kept.outputs.append(self._project(t.detach()[:1]))

    def _project(self, t: torch.Tensor) -> torch.Tensor:
        """(1, length, ...) -> (length, DIRECTIONS): random directions, fixed per width."""
        flat = t.movedim(self.seq_dim, 1).reshape(t.shape[self.seq_dim], -1).float()
        key = (flat.shape[1], str(flat.device))
        r = self._directions.get(key)
        if r is None:
            g = torch.Generator().manual_seed(0)
            r = torch.randn(flat.shape[1], DIRECTIONS, generator=g).to(flat.device)
            self._directions[key] = r
        return flat @ r

    def _whole_inputs(self, kept: _Kept) -> tuple[tuple, dict] | None:
        """The segments' inputs joined along the sequence (None: they cannot be)."""
        lengths = [o.shape[0] for o in kept.outputs]

        def join(values: list[Any]) -> tuple[bool, Any]:
            a = values[0]
            if all(v is a for v in values):
                return True, a
            if not all(isinstance(v, torch.Tensor) for v in values):
                return all(v == a for v in values), a
            if all(v.dim() > self.seq_dim and v.shape[self.seq_dim] == n
                   for v, n in zip(values, lengths, strict=True)):  # fmt: skip
                return True, torch.cat(values, dim=self.seq_dim)
            return False, None

        args: list[Any] = []
        for values in zip(*kept.args, strict=True):
            ok, joined = join(list(values))
            if not ok:
                return None
            args.append(joined)
        kwargs: dict[str, Any] = {}
        for name in kept.kwargs[0]:
            ok, joined = join([kw.get(name) for kw in kept.kwargs])
            if not ok:
                return None
            kwargs[name] = joined
        return tuple(args), kwargs

    def run(self, stage_index: int, module: nn.Module, documents: RowGroups | None
            ) -> tuple[int | None, float, torch.dtype] | None:  # fmt: skip
        """(the first segment whose outputs differ or None, the largest relative error, the
        outputs' dtype); None when the stage has nothing to compare."""
        kept = self._kept.get(stage_index)
        if kept is None or len(kept.outputs) != SEGMENTS:
            return None
        if any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules()):
            logger.info("Seq1F1B: stage %d: first-step output check skipped (dropout in "
                        "training mode makes two forwards differ)", stage_index)  # fmt: skip
            return None
        whole = self._whole_inputs(kept)
        if whole is None:
            logger.info("Seq1F1B: stage %d: first-step output check skipped (an input that "
                        "cannot be joined along the sequence)", stage_index)  # fmt: skip
            return None
        lengths = [o.shape[0] for o in kept.outputs]
        out = self._forward(stage_index, module, whole, sum(lengths), documents)
        out = _first_output(out, self.seq_dim)
        if out is None:
            return None
        ref = self._project(out.detach()[:1])
        start, worst = 0, 0.0
        for segment, (got, n) in enumerate(zip(kept.outputs, lengths, strict=True)):
            want = ref[start : start + n]
            error = float((got - want).norm() / want.norm().clamp_min(1e-30))
            start += n
            if not error <= tolerance(kept.dtype):  # NaN counts as a mismatch
                return segment, error, kept.dtype
            worst = max(worst, error)
        return None, worst, kept.dtype

    def _forward(self, stage_index: int, module: nn.Module, whole: tuple[tuple, dict],
                 length: int, documents: RowGroups | None) -> Any:  # fmt: skip
        """The stage over ``length`` positions as one segment: no gradients, eagerly (no
        recompilation for a new length), the random state and every buffer left as they were,
        and FSDP's parameters sharded again (under pipelining FSDP does not reshard after a
        forward: the schedule's RESHARD does, and the gradients stay on the sharded ones)."""
        docs = _row0_documents(documents, length)
        info = SegmentInfo(0, 0, 1, 0, length, length, (0, length), docs)
        state = StageKVState(stage_index, 1)
        args, kwargs = whole
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        forked = [device] if device is not None and device.type == "cuda" else []
        with small_buffers_kept([module]), torch.no_grad(), torch.random.fork_rng(devices=forked):
            with torch.compiler.set_stance("force_eager"):
                with activate(UnitContext(state, info, "forward", False)):
                    try:
                        return module(*args, **kwargs)
                    finally:
                        for m in module.modules():
                            if isinstance(m, FSDPModule):
                                m.reshard()


def _row0_documents(documents: RowGroups | None, length: int) -> RowGroups | None:
    """Sample 0's document runs (row 0 of its microbatch) in its first ``length`` positions."""
    if documents is None:
        return None
    runs = next(r for first, end, r in documents if first <= 0 < end)
    return ((0, 1, tuple((a, min(b, length)) for a, b in runs if a < length)),)
