"""``SequencePipelineSchedule``: what every Seq1F1B-family schedule shares, as a layer over the
class proposed to torch.

Each batch is split into ``n_microbatches`` samples along dim 0 and each sample into
``seq_chunks`` segments along ``seq_dim``; a (sample, segment) *unit* is what torch's runtime
calls a microbatch (index ``u = m * K + k``). The class is patch 6's ``ScheduleSeq1F1B``
(:mod:`.upstream`, verbatim): its unit bookkeeping (``segment_lengths``, ``unit_info``), its
per-unit receive sizing, its loss weighting and torch's runtime underneath. This layer answers
its hooks with what stays model-side:

* ``_calculate_single_rank_operations`` (subclasses): the zero-bubble, V and interleaved orders
  of :mod:`seq1f1b.orders`, run whole on compiled stages;
* ``_get_microbatch_inputs``: the units, read in one pass by
  :func:`~seq1f1b.schedules.step_inputs.prepare_step` (every rank cuts its inputs, agrees on
  the length through :func:`~seq1f1b.schedules.preflight.agree_on_step` and fails together on
  bad input before any pipeline traffic), with packed documents and context-parallel shards;
* ``_lengths_for``: :class:`~seq1f1b.schedules.options.SequenceSplit` (uniform, compute-balanced,
  per document); ``_loss_weight``: each unit's token share; ``_merge_outputs``: any pytree;
* the per-action unit context (:class:`~seq1f1b.schedules.unit_actions.UnitActions`: K/V state,
  the received-length check, the attention guards), through ``register_action_context``.

``step()`` is torch's in shape; it also takes ``document_ids`` and M pre-split samples on every
supported torch, and averages gradients over a context-parallel group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from .. import _runtime as rt
from .._runtime import Action, PipelineStageBase
from .._runtime.lowering import check_backward_send_waits as _waits
from ..attention.kv import metadata_inference
from ..orders.order import OrderSpec, whole_backwards
from ..orders.order_rules import check_order_rules
from .loss_checks import LossChecks
from .microbatch import merge_unit_outputs
from .options import ContextParallelConfig, SequenceSplit, check_counts
from .preflight import agree_on_step, fingerprint
from .receives import ReceiveCheck
from .step_inputs import StepInputs, UnitCutter, prepare_step
from .unit_actions import UnitActions
from .upstream import ScheduleSeq1F1B as UpstreamSeq1F1B

logger = logging.getLogger(__name__)

__all__ = ["SequencePipelineSchedule"]

#: a step's packed documents: (batch, seq_len) ids, or one such tensor per sample
DocumentIds = torch.Tensor | Sequence[torch.Tensor]


def unsplittable(stages: Sequence[PipelineStageBase], cls: type) -> bool:
    """Whether zero-bubble orders must run each backward whole on these stages: torch cannot
    split a compiled backward into its input and weight halves (split, it would run twice:
    twice the time, and with AOTAutograd's donated buffers wrong weight gradients), and a
    checkpointed block, split, is recomputed once for its input half and again for each group
    of weights torch's weight half differentiates apart (measured: 3.6x the step of the
    unsplit order on torchtitan's debug Llama with full AC)."""
    mods = [getattr(s, "submod", None) for s in stages]
    why = None
    if any(rt.has_compiled_module(m) for m in mods):
        why = "compiled"
    elif any(rt.has_checkpointed_module(m) for m in mods):
        why = "checkpointed"
    if why is not None:
        logger.info(
            "%s: stages hold %s modules, so each backward runs whole (BACKWARD_INPUT as "
            "FULL_BACKWARD, no BACKWARD_WEIGHT): a %s backward is not split in two",
            cls.__name__, why, why,
        )  # fmt: skip
    return why is not None


class SequencePipelineSchedule(UpstreamSeq1F1B):
    """The class proposed to torch (:mod:`.upstream`), its hooks answered model-side (see the
    module docstring). Arguments: :class:`seq1f1b.ScheduleSeq1F1B`."""

    def __init__(
        self,
        stages: PipelineStageBase | Sequence[PipelineStageBase],
        n_microbatches: int,
        seq_chunks: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        seq_dim: int = 1,
        seq_split: SequenceSplit | str | Sequence[int] | None = None,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = 3,
        unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
        context_parallel: ContextParallelConfig | None = None,
        ignore_index: int | None = -100,
        kwargs_seq_dims: Mapping[str, int | None] | None = None,
        check_attention: bool = True,
        skip_invisible: bool = True,
        loss_reduction: Literal["mean", "sum"] = "mean", backward_send_waits: str = "consumed",
    ) -> None:
        stage_list = _check_stages(stages, self._placement)
        self.loss_reduction, self.backward_send_waits = loss_reduction, _waits(backward_send_waits)
        self.loss_checks, scale_grads = LossChecks.of_reduction(
            loss_fn, n_microbatches * seq_chunks, loss_reduction, scale_grads, context_parallel)
        rt.release_recv_meta_fns(stage_list)  # this schedule takes over their receive sizing
        m, k = check_counts(n_microbatches, seq_chunks, seq_dim)
        self.sequence_split = SequenceSplit.of("uniform" if seq_split is None else seq_split)
        self.context_parallel = context_parallel or ContextParallelConfig()
        self.sequence_split.check(k)
        self._cp = self.context_parallel.resolve()
        lengths = None if isinstance(mode := self.sequence_split.mode, str) else mode  # fixed
        super().__init__(stage_list, m, k, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, seq_dim, lengths,
                         backward_requires_autograd, defer_pp_recv, max_active_stages,
                         unshard_lookahead, defer_reduce_grad_wait=defer_reduce_grad_wait,
                         max_outstanding_sends=max_outstanding_sends)  # fmt: skip
        self.cutter = UnitCutter(m, k, seq_dim, dict(kwargs_seq_dims or {}), ignore_index,
                                 scale_grads, *self.chunk_specs[:2])  # fmt: skip
        self.failures, self._agree = _agreement(self, stage_list, loss_fn is not None)
        receives = ReceiveCheck.of(seq_dim, self.local_stages, self._recv_metas)
        self.unit_actions = UnitActions(stage_list, k, receives, self._cp, skip_invisible,
                                        check_attention)  # fmt: skip
        self.register_action_context(self.unit_actions)
        self._inputs: StepInputs | None = None
        if self.sequence_split.seq_len is not None:
            self.split_lengths(self.sequence_split.seq_len)  # fail now, not at the first step

    _split_backward = False  # whether the orders split backwards (BACKWARD_INPUT + _WEIGHT)
    _placement = "looped"  # stage s on rank s % pp; "v": rank r holds r and 2*pp-1-r

    @functools.cached_property
    def order_spec(self) -> OrderSpec:
        """The order's shape (pp, stages per rank, M, K, split, placement), from the base's."""
        return OrderSpec(self.pp_group_size, self.n_local_stages, self.n_samples,
                         self.seq_chunks, self._split_backward, self._placement)  # fmt: skip

    @functools.cached_property
    def _whole_backward(self) -> bool:
        """Whether a zero-bubble order runs each backward whole (compiled or checkpointed)."""
        return self._split_backward and unsplittable(self.local_stages, type(self))

    def _runnable(self, order: Iterable[Action | None]) -> list[Action | None]:
        """A rank's order as run: split backwards merged back where they cannot be split."""
        return whole_backwards(list(order)) if self._whole_backward else list(order)

    def split_lengths(self, seq_len: int) -> list[int]:
        """Every sample's segment lengths for ``seq_len`` tokens without packed documents."""
        return self.sample_lengths(seq_len)[0]

    def sample_lengths(self, seq_len: int, document_ids: Any = None) -> list[list[int]]:
        """Each sample's segment lengths, balanced for its own ``document_ids`` under "compute"."""
        cp = 1 if self._cp is None else self._cp.size
        return self.sequence_split.sample_lengths(seq_len, self.seq_chunks, self.n_samples, cp,
                                                  self.order_spec, document_ids)  # fmt: skip

    def check_loaded_order(self, actions: Mapping[int, Sequence[Action | None]]) -> None:
        """A loaded CSV order must keep Seq1F1B's rules (full backward, segment order)."""
        check_order_rules(actions, self.seq_chunks)

    def step(self, *args: Any, target: torch.Tensor | None = None, losses: list | None = None,
             return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None,
             arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, finalize_gradients: bool = True,
             document_ids: DocumentIds | None = None, **kwargs: Any) -> Any:  # fmt: skip
        """torch's step (the batch, or M pre-split samples) with packed ``document_ids``: a
        failure on any rank raises on every rank, naming it (docs/direct_api.md)."""
        checks = self.loss_checks.before_step(self, target, target_mbs, loss_kwargs)
        units = self._get_microbatch_inputs(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs,
                                            document_ids, checks=checks)  # fmt: skip
        with self.failures.scope():
            self.begin_step(finalize_gradients)
            self.run_microbatches(*units, losses, return_outputs, loss_kwargs=loss_kwargs)
            return _end_step(self, return_outputs)

    def _get_microbatch_inputs(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs,  # type: ignore[override]
                               document_ids=None, checks=(None, None)):  # fmt: skip
        """The units, after a pre-flight that fails every rank on any rank's bad input."""
        agree = functools.partial(_agree_checked, self._agree, *checks)
        inputs = prepare_step(self.cutter, (args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs),
                              document_ids, self.sequence_split.seq_len, self.sample_lengths,
                              self._cp, agree)  # fmt: skip
        _log_split(self.segment_lengths, inputs, self.sequence_split)
        self._inputs, self.segment_lengths = inputs, inputs.lengths
        self.unit_actions.begin_step(inputs.lengths, inputs.documents)
        return inputs.args, inputs.kwargs, inputs.targets

    def _lengths_for(self, seq_len: int) -> list[tuple[int, ...]]:
        return [tuple(ls) for ls in self.sample_lengths(seq_len)]

    def _loss_weight(self, mb_index: int) -> float:
        """The unit's token share; 1.0 for a loss that takes it (:class:`seq1f1b.ChunkedLoss`)."""
        takes = getattr(self.loss_fn, "takes_unit_weight", False)
        return 1.0 if self._inputs is None or takes else self._inputs.weights[mb_index]

    def unit_loss(self, stage, output, target, mb_index, loss_kwargs):  # type: ignore[override]
        """torch's loss; ChunkedLoss takes the weight; a 0-weight unit's NaN (0/0) mean adds 0."""
        weight = self._inputs.weights[mb_index] if self._inputs is not None else 1.0
        if getattr(self.loss_fn, "takes_unit_weight", False):
            return self.loss_fn(output, target, weight=weight, **(loss_kwargs or {}))
        loss = super().unit_loss(stage, output, target, mb_index, loss_kwargs)
        return self.loss_checks.after_unit(output, target, loss, loss_kwargs, self.seq_dim, weight)

    def _merge_outputs(self, output_chunks: list[Any]) -> Any:
        return merge_unit_outputs(output_chunks, self.n_samples, self.seq_dim, self.chunk_specs[2])

    def unit_scope(self) -> contextlib.AbstractContextManager[None]:
        if self._inputs is None:
            raise RuntimeError("call step() or eval(): Seq1F1B splits the sequence itself")
        return self.unit_actions.step_scope(self.local_stages[0], self.pp_group_size)

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        return metadata_inference()


def _agreement(schedule: Any, stages: list, has_loss: bool) -> tuple[rt.StepFailures, Any]:
    """A schedule's failure reports and its pre-flight agreement: every rank must have built
    the same schedule (:func:`~.preflight.fingerprint`), and a failure names its rank."""
    name = type(schedule).__name__
    settings = fingerprint(name, schedule.n_samples, schedule.seq_chunks,
                           schedule.sequence_split, len(stages), has_loss)  # fmt: skip
    failures = rt.StepFailures(stages[0].group, f"{name}.step()")
    agree = functools.partial(agree_on_step, stages[0], schedule.pp_group_size,
                              settings=settings, whole_backward=schedule._whole_backward,
                              failures=failures)  # fmt: skip
    return failures, agree


def _agree_checked(agree: Any, before: Exception | None, note: str | None, local: int,
                   error: Exception | None, has_documents: bool) -> int:  # fmt: skip
    """The pre-flight agreement with this rank's step checks (``before``) as its error."""
    return agree(local, error or before, has_documents, note=note)


def _end_step(schedule: Any, return_outputs: bool) -> Any:
    """After a step's actions: gradients averaged over a context-parallel group (where the
    schedule reduces them), and the last stage's merged outputs (or None)."""
    cp = schedule._cp
    if cp is not None and schedule.context_parallel.reduce_grads and schedule.has_backward:
        cp.average_grads(p for s in schedule.local_stages for p in s.submod.parameters())
    last = [s for s in schedule.local_stages if s.is_last]
    return schedule._merge_outputs(last[0].output_chunks) if last and return_outputs else None


def _log_split(before: list, inputs: StepInputs, split: SequenceSplit) -> None:
    """Log a step's segment lengths when they differ from the previous step's."""
    lengths = inputs.lengths
    if lengths == before:
        return
    same = all(ls == lengths[0] for ls in lengths)
    by_document = inputs.documents is not None and split.mode == "compute"
    logger.info("Seq1F1B: segment lengths%s %s (seq_split=%s%s)", "" if same else " per sample",
                list(lengths[0]) if same else [list(ls) for ls in lengths], split.mode,
                ", by document" if by_document else "")  # fmt: skip


def _check_stages(
    stages: PipelineStageBase | Sequence[PipelineStageBase], placement: str = "looped"
) -> list:
    """This rank's stages, checked against the schedule's placement (looped or V)."""
    stage_list = [stages] if isinstance(stages, PipelineStageBase) else list(stages)
    if not stage_list:
        raise ValueError("stages is empty: pass this rank's PipelineStage(s)")
    pp, rank = stage_list[0].group_size, stage_list[0].group_rank
    n_stages = stage_list[0].num_stages
    indices = sorted(s.stage_index for s in stage_list)
    consistent = all(s.num_stages == n_stages and s.group_size == pp for s in stage_list)
    if placement == "v":
        expected = [rank, 2 * pp - 1 - rank]
        if not consistent or n_stages != 2 * pp or indices != expected:
            raise ValueError(
                f"rank {rank} of {pp} holds stages {indices} of {n_stages}: this schedule uses "
                f"the V placement (num_stages = 2 * pp, rank r holds stages r and 2*pp-1-r), "
                f"so this rank must hold exactly {expected}. Split the model into 2 * pp "
                "stages and give rank r the stages r and 2*pp-1-r (torch's style='v')"
            )
        return sorted(stage_list, key=lambda s: s.stage_index)
    expected = list(range(rank, n_stages, pp))
    if not consistent or n_stages != pp * len(stage_list) or indices != expected:
        raise ValueError(
            f"rank {rank} of {pp} holds stages {indices} of {n_stages}: Seq1F1B uses looped "
            f"placement (stage s on rank s % pp, the same number on every rank), so this "
            f"rank must hold exactly {expected}. Build num_stages = pp * stages_per_rank "
            "stages and give rank r the stages r, r + pp, r + 2*pp, ..."
        )
    return stage_list
