"""What runs around each compute action of a Seq1F1B step: the unit's place in its sample
(:class:`~seq1f1b.attention.kv.SegmentInfo`), its K/V cache bookkeeping, the received-length check
and, on the first step, the guards against plain SDPA and against a stage that mixes positions
without the chunk-aware attention (:mod:`seq1f1b.attention.mixing_probe`). Registered on the
schedule as one per-action context (``UnitRuntime.register_action_context``), so it composes with
other such contexts and never replaces a stage's methods itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _runtime as rt
from .._runtime import Action, PipelineStageBase
from ..attention.kv import ContextParallel, SegmentInfo, StageKVState, UnitContext, activate
from ..attention.mixing_probe import mixes_positions, mixing_error
from .output_check import WholeSequenceCheck, output_mismatch_error
from .partition import segment_offsets
from .receives import ReceiveCheck

logger = logging.getLogger(__name__)

#: output dtypes the first-step check names (by index in the all-reduced report)
OUTPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

__all__ = ["PlainAttentionGuard", "UnitActions"]


class PlainAttentionGuard(TorchFunctionMode):
    """Fails fast when a model calls plain SDPA inside a chunked unit (wrong, not just slow)."""

    error: RuntimeError | None = None

    def __init__(self, documents: bool) -> None:
        super().__init__()
        self.documents = documents

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            why = (
                "it would ignore the document_ids given to step() (attention across documents)"
                if self.documents
                else "a segment would not see the earlier segments' keys and values"
            )
            self.error = RuntimeError(
                "ScheduleSeq1F1B: the model called "
                f"torch.nn.functional.scaled_dot_product_attention directly, so {why} "
                "(silently wrong results). Route causal attention through "
                "seq1f1b.chunk_aware_attention / ChunkAwareAttention (or pass "
                "check_attention=False if this SDPA call is not over the sequence)."
            )
            raise self.error
        return func(*args, **(kwargs or {}))


class UnitActions:
    """The per-action context of one schedule's units; ``begin_step`` sets the step's
    segment lengths and documents, and the instance is the factory ``(stage, action) -> ctx``.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStageBase],
        seq_chunks: int,
        receives: ReceiveCheck,
        cp: ContextParallel | None,
        skip_invisible: bool = True,
        check_attention: bool = True,
    ) -> None:
        self.seq_chunks = seq_chunks
        self.receives = receives
        self.stages = {s.stage_index: s for s in stages}
        self.cp = cp
        self.kv_states = {
            s.stage_index: StageKVState(s.stage_index, seq_chunks, skip_invisible=skip_invisible)
            for s in stages
        }
        self.lengths: list[list[int]] = []  # each sample's segment lengths
        self._seq_len = 0
        self._bounds: list[tuple[int, ...]] = []  # each sample's segment starts, then seq_len
        self._infos: dict[int, SegmentInfo] = {}
        self.documents: list | None = None  # per sample: document runs (packed documents)
        self.guard = False  # check for plain SDPA (first step, first step with documents)
        self.mixing: tuple[int, int] | None = None
        # the guard runs on the first step (units or CP), and on the first with documents
        self._guard_units = check_attention and (seq_chunks > 1 or cp is not None)
        self._guard_documents = check_attention
        # the stages' outputs against the whole sequence: first step, and a new sequence length
        self.outputs = WholeSequenceCheck(receives.seq_dim) if check_attention else None
        self.checking = False  # this step compares outputs
        self._checked_len: int | None = None
        self.mismatches: dict[int, tuple[int, float, torch.dtype]] = {}
        # stages with compiled blocks run a guarded step eagerly (below); a compiled
        # block's variants: a static first length, then dynamic lengths, and as many again
        # for what tensor parallelism adds (torchtitan: pytorch#187073)
        counts = {s.stage_index: rt.compiled_modules(getattr(s, "submod", None)) for s in stages}
        self._compiled = {index for index, n in counts.items() if n}
        if self._compiled:
            rt.allow_compiled_variants(sum(counts.values()), 4)

    def as_checked(self, seq_len: int) -> None:
        """Mark the first-step checks done for ``seq_len`` tokens, as after a first step: the
        dry run measures a steady-state step, in which they do not run."""
        self._guard_units = self._guard_documents = False
        self._checked_len = seq_len

    def begin_step(self, lengths: list[list[int]], documents: list | None) -> None:
        """A step's segment lengths (each sample's) and documents: receives sized, guards set."""
        self.receives.size_units([n for sample in lengths for n in sample])
        seq_len = sum(lengths[0])
        self.checking = (
            self.outputs is not None and self.seq_chunks > 1 and (seq_len != self._checked_len)
        )
        guard = (
            self._guard_units or self.checking or (documents is not None and self._guard_documents)
        )
        self.lengths, self.documents, self.guard = lengths, documents, guard
        self.mixing: tuple[int, int] | None = None  # (stage, segment) that mixes positions
        self.mismatches = {}
        if self.outputs is not None:
            self.outputs.reset()
        self._seq_len = seq_len
        self._bounds = [(*segment_offsets(ls), self._seq_len) for ls in lengths]
        self._infos = {}  # by unit: its forward and backward share one
        for state in self.kv_states.values():
            state.clear(reset_peak=True)

    def end_step(self) -> None:
        for state in self.kv_states.values():
            state.clear()

    @contextlib.contextmanager
    def step_scope(self, stage: PipelineStageBase, group_size: int) -> Iterator[None]:
        """Around a step's actions: after a guarded step, compare the stages' outputs with the
        whole sequence and raise on every rank if a stage mixed positions or differs
        (:meth:`raise_if_check_failed`); the K/V state is cleared either way."""
        first = self._guard_units
        try:
            yield
            if self.guard:
                self.end_step()  # the step's K/V is not needed: free it before the check
                self.compare_outputs()
                self.raise_if_check_failed(stage, group_size)
            if first:
                self.log_memory(stage.device)
            if self.checking:
                self._checked_len = self._seq_len
            self._guard_units = False
            self._guard_documents = self._guard_documents and self.documents is None
        finally:
            self.end_step()

    def log_memory(self, device: torch.device) -> None:
        """Say what the first step held: each stage's K/V cache of earlier segments at its
        peak, and on CUDA the device's allocation peak (weights, activations and cache)."""
        for index, state in sorted(self.kv_states.items()):
            logger.info("Seq1F1B: stage %d: K/V cache of earlier segments peaked at %.2f MiB "
                        "(first step)", index, state.peak_bytes / 2**20)  # fmt: skip
        if device.type == "cuda":  # pragma: no cover - GPU only
            logger.info("Seq1F1B: device %s: peak allocated %.1f MiB in the first step (weights, "
                        "activations and K/V cache together)", device,
                        torch.cuda.max_memory_allocated(device) / 2**20)  # fmt: skip

    def kv_state_bytes(self) -> int:
        """Bytes of K/V still cached (0 between steps; for tests and memory checks)."""
        return sum(s.nbytes() for s in self.kv_states.values())

    def kv_peak_bytes(self) -> int:
        """Most K/V bytes cached at once on this rank's stages during the last step."""
        return max((s.peak_bytes for s in self.kv_states.values()), default=0)

    def kv_state_empty(self) -> bool:
        return all(s.is_empty() for s in self.kv_states.values())

    def compare_outputs(self) -> None:
        """Each local stage's kept outputs against the stage over the whole sequence."""
        if not self.checking or self.outputs is None or self.mixing is not None:
            return
        docs = None if self.documents is None else self.documents[0]
        for index, stage in sorted(self.stages.items()):
            start = time.perf_counter()
            found = self.outputs.run(index, stage.submod, docs)
            if found is not None and found[0] is not None:
                self.mismatches[index] = found  # type: ignore[assignment]
            elif found is not None:
                logger.info("Seq1F1B: stage %d: first-step check passed: its outputs equal the "
                            "stage's over the whole sequence (relative error %.1e, %s, %.3f s)",
                            index, found[1], found[2], time.perf_counter() - start)  # fmt: skip
        self.outputs.reset()

    def raise_if_check_failed(self, stage: PipelineStageBase, group_size: int) -> None:
        """After a guarded step: if any rank's stage combined the positions of a later segment
        without a chunk-aware attention call, or its outputs differ from the whole sequence's,
        every rank raises the same named error about the first such stage (the step's traffic
        completed; no optimizer step has run on its gradients)."""
        # per stage: the segment that mixes, the segment that differs, its error, its dtype
        found = torch.full((stage.num_stages, 4), -1.0, dtype=torch.float64)
        if self.mixing is not None:
            found[self.mixing[0], 0] = self.mixing[1]
        for index, (segment, error, dtype) in self.mismatches.items():
            code = OUTPUT_DTYPES.index(dtype) if dtype in OUTPUT_DTYPES else 0
            found[index, 1:] = torch.tensor([segment, min(error, 1e300), code])
        if group_size > 1:
            found = found.to(stage.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=stage.group)
            found = found.cpu()
        for index, row in enumerate(found.tolist()):
            if row[0] >= 0:
                raise rt.raised_on_every_rank(mixing_error(index, int(row[0])))
        for index, row in enumerate(found.tolist()):
            if row[1] >= 0:
                raise rt.raised_on_every_rank(output_mismatch_error(
                    index, int(row[1]), row[2], OUTPUT_DTYPES[int(row[3])]))  # fmt: skip

    def segment_info(self, unit: int) -> SegmentInfo:
        """The unit's place in its sample; built once per step (lengths and bounds are the
        step's, computed in :meth:`begin_step`), then shared by its forward and backward."""
        info = self._infos.get(unit)
        if info is None:
            m, seg = divmod(unit, self.seq_chunks)
            info = self._infos[unit] = SegmentInfo(
                microbatch=m,
                segment=seg,
                num_segments=self.seq_chunks,
                start=self._bounds[m][seg],
                length=self.lengths[m][seg],
                seq_len=self._seq_len,
                bounds=self._bounds[m],
                documents=None if self.documents is None else self.documents[m],
                cp=self.cp,
            )
        return info

    def __call__(
        self, stage: PipelineStageBase, action: Action
    ) -> contextlib.AbstractContextManager[None]:
        kind = action.computation_type
        if kind == rt.FORWARD:
            return self._forward(stage, action.microbatch_index)
        if not stage.has_backward:
            return contextlib.nullcontext()
        if kind == rt.BACKWARD_WEIGHT and not stage.is_first:
            return self._weight(stage, action.microbatch_index)
        if kind == rt.BACKWARD_INPUT and stage.is_first:
            # torch runs the first stage's whole backward in its BACKWARD_WEIGHT (there is no
            # input gradient to split off): the unit's K/V work happens there
            return contextlib.nullcontext()
        return self._backward(stage, action.microbatch_index, free=kind != rt.BACKWARD_INPUT)

    @contextlib.contextmanager
    def _forward(self, stage: PipelineStageBase, unit: int) -> Iterator[None]:
        info, state = self.segment_info(unit), self.kv_states[stage.stage_index]
        if not stage.is_first:
            self.receives.check_received(stage, unit)
        keep = stage.has_backward and torch.is_grad_enabled()
        state.begin_forward(info.microbatch, info.segment)
        # a stage with compiled blocks runs a guarded step eagerly: the SDPA guard's mode and
        # the probe's no-grad forward would each compile another variant of every block, and
        # the check compares eager with eager (every unit: one step's K/V cache is one kind)
        mode = PlainAttentionGuard(info.documents is not None) if self.guard else None
        seen: list[tuple] = []  # (args, kwargs, output) of a guarded forward
        hook = None
        kept = self.checking and info.cp is None and self.outputs.wants(info)
        probed = self.guard and info.segment > 0
        if (kept or probed) and isinstance(stage.submod, nn.Module):
            hook = stage.submod.register_forward_hook(
                lambda _m, a, kw, out: seen.append((a, kw, out)), with_kwargs=True
            )
        state.attention_calls = 0
        try:
            with activate(UnitContext(state, info, "forward", keep)):
                with self._eager_if_guarded(stage), mode or contextlib.nullcontext():
                    yield
        except RuntimeError as exc:
            if mode is not None and mode.error is not None:
                raise mode.error from exc  # not torch's generic "failed to run forward"
            raise
        finally:
            if hook is not None:
                hook.remove()
        if seen and kept:
            self.outputs.keep(stage.stage_index, info.length, *seen[0])
        if seen and probed and state.attention_calls == 0 and self.mixing is None:
            args, kwargs, out = seen[0]
            seq_dim = self.receives.seq_dim
            with self._eager_if_guarded(stage):
                mixes = mixes_positions(stage.submod, args, kwargs, out, seq_dim, info.local_length)
            if mixes:
                # raised after the step, on every rank at once (see SequencePipelineSchedule)
                self.mixing = (stage.stage_index, info.segment)
        state.end_forward(info.microbatch, info.segment, keep)

    @contextlib.contextmanager
    def _backward(self, stage: PipelineStageBase, unit: int, free: bool) -> Iterator[None]:
        """A full backward, the input half of a split one, or the first stage's whole one."""
        info, state = self.segment_info(unit), self.kv_states[stage.stage_index]
        state.begin_backward(info.microbatch, info.segment)
        phase = "backward" if free else "backward_input"
        with activate(UnitContext(state, info, phase, True)), self._eager_if_guarded(stage):
            yield
        state.end_backward(info.microbatch, info.segment, free=free)

    @contextlib.contextmanager
    def _weight(self, stage: PipelineStageBase, unit: int) -> Iterator[None]:
        """Weight gradients from the intermediates BACKWARD_INPUT saved; checkpointing may
        recompute the layer (and its attention, from the kept K/V cache) once more here, once
        for all of torch's weight groups (``checkpoints_recomputed_once``)."""
        info, state = self.segment_info(unit), self.kv_states[stage.stage_index]
        with activate(UnitContext(state, info, "backward_weight", False)):
            with self._eager_if_guarded(stage), rt.checkpoints_recomputed_once():
                yield
        state.end_weight(info.microbatch, info.segment)

    def _eager_if_guarded(self, stage: PipelineStageBase) -> contextlib.AbstractContextManager:
        """A guarded step's actions on a stage with compiled blocks run eagerly, backwards
        too: a checkpointed block's recomputation must build the K/V cache the eager forward
        built (each kind wires its gradients its own way)."""
        if self.guard and stage.stage_index in self._compiled:
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()
