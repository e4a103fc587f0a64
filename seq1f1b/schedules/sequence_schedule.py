"""``SequencePipelineSchedule``: what every Seq1F1B-family schedule shares, on torch's runtime.

Each batch is split into ``n_microbatches`` samples along dim 0 and each sample into
``seq_chunks`` segments along ``seq_dim``; a (sample, segment) *unit* is what torch's runtime
calls a microbatch (index ``u = m * K + k``). Subclasses give each rank's compute order
(``_calculate_single_rank_operations``, as torch's schedules do); lowering to send/recv, FSDP
unshard/reshard, REDUCE_GRAD and gradient scaling are torch's.

The step is torch's ``_step_microbatches`` on units this class cuts: torch's ``step()`` splits
the target along the batch into ``n_microbatches`` pieces and merges outputs along the batch,
neither of which fits sequence units. Around it, small collaborators each do one job:
:class:`~seq1f1b.schedules.options.SequenceSplit` (segment lengths),
:class:`~seq1f1b.schedules.step_inputs.UnitCutter` (units and token weights),
:class:`~seq1f1b.schedules.preflight.Preflight` (inputs cut and agreed on before any traffic),
:class:`~seq1f1b.schedules.receives.ReceiveSizer` (receives per unit) and
:class:`~seq1f1b.schedules.unit_actions.UnitActions` (the per-action context: K/V state, guard).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from .. import _runtime as rt
from .._runtime import Action, PipelineStageBase
from ..attention.kv import metadata_inference
from ..orders.order import OrderSpec
from ..orders.order_rules import check_order_rules
from .microbatch import merge_unit_outputs
from .options import ContextParallelConfig, SequenceSplit, check_counts, runtime_options
from .preflight import Preflight
from .receives import ReceiveSizer
from .step_inputs import StepInputs, UnitCutter, split_step_inputs, weighted_loss
from .unit_actions import UnitActions

logger = logging.getLogger(__name__)

__all__ = ["SequencePipelineSchedule"]


def whole_backwards(order: Sequence[Action | None]) -> list[Action | None]:
    """A compute order with each BACKWARD_INPUT run as a FULL_BACKWARD and no BACKWARD_WEIGHT
    (the same gradient sends, at the same places)."""
    out: list[Action | None] = []
    for action in order:
        if action is not None and action.computation_type == rt.BACKWARD_WEIGHT:
            continue
        if action is not None and action.computation_type == rt.BACKWARD_INPUT:
            action = Action(action.stage_index, rt.FULL_BACKWARD, action.microbatch_index)
        out.append(action)
    return out


def compiled_stages(stages: Sequence[PipelineStageBase], cls: type) -> bool:
    """Whether any stage holds compiled modules: torch cannot split a compiled backward into
    its input and weight halves (split, it would run twice: twice the time, and with
    AOTAutograd's donated buffers wrong weight gradients), so zero-bubble orders run each
    backward whole there."""
    compiled = any(rt.has_compiled_module(getattr(s, "submod", None)) for s in stages)
    if compiled:
        logger.info(
            "%s: stages hold compiled modules, so each backward runs whole (BACKWARD_INPUT as "
            "FULL_BACKWARD, no BACKWARD_WEIGHT): a compiled backward cannot be split in two",
            cls.__name__,
        )
    return compiled


class SequencePipelineSchedule(rt.UnitRuntime):
    """Base of the Seq1F1B schedules; see :class:`seq1f1b.ScheduleSeq1F1B` for the arguments."""

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
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        seq_dim: int = 1,
        split: SequenceSplit | str | Sequence[int] = "uniform",
        context_parallel: ContextParallelConfig | None = None,
        ignore_index: int | None = -100,
        kwargs_seq_dims: Mapping[str, int | None] | None = None,
        check_attention: bool = True,
        skip_invisible: bool = True,
        max_active_stages: int | None = None,
        unshard_lookahead: str | tuple[int, ...] | None = None,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
    ) -> None:
        stage_list = _check_stages(stages, self._placement)
        m, k = check_counts(n_microbatches, seq_chunks, seq_dim)
        self.sequence_split = SequenceSplit.of(split)
        self.context_parallel = context_parallel or ContextParallelConfig()
        self.sequence_split.check(k)
        self._cp = self.context_parallel.resolve()
        self.n_samples, self.seq_chunks, self.seq_dim = m, k, seq_dim
        super().__init__(stages=stage_list, n_microbatches=m * k, loss_fn=loss_fn,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads,
                         backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, **runtime_options(
                             max_active_stages, unshard_lookahead, defer_reduce_grad_wait,
                             max_outstanding_sends))  # fmt: skip
        self.cutter = UnitCutter(m, k, seq_dim, dict(kwargs_seq_dims or {}), ignore_index,
                                 scale_grads, *self.chunk_specs[:2])  # fmt: skip
        self.preflight = Preflight(self.sequence_split, self.cutter, self.sample_lengths,
                                   self._cp, self.pp_group_size)  # fmt: skip
        self.receives = ReceiveSizer(seq_dim)
        self.unit_actions = UnitActions(stage_list, k, self.receives, self._cp, skip_invisible,
                                        check_attention)  # fmt: skip
        self.register_action_context(self.unit_actions)
        self._inputs: StepInputs | None = None
        self.order_spec = OrderSpec(self.pp_group_size, len(stage_list), m, k,
                                    self._split_backward, self._placement)  # fmt: skip
        self._whole_backward = self._split_backward and compiled_stages(stage_list, type(self))
        orders = {r: self._calculate_single_rank_operations(r) for r in range(self.pp_group_size)}
        whole = self._whole_backward
        self._install_order({r: whole_backwards(o) if whole else o for r, o in orders.items()})
        if self.sequence_split.seq_len is not None:
            self.segment_lengths(self.sequence_split.seq_len)  # fail now, not at the first step

    #: whether the orders split each backward into BACKWARD_INPUT + BACKWARD_WEIGHT
    _split_backward = False
    #: how stages sit on ranks: "looped" (stage s on rank s % pp) or "v" (r and 2*pp-1-r)
    _placement = "looped"

    def _calculate_single_rank_operations(self, rank: int) -> list[Action | None]:
        """This rank's compute-only order (closed form; subclasses)."""
        raise NotImplementedError

    @property
    def split(self) -> str | list[int]:
        mode = self.sequence_split.mode
        return mode if isinstance(mode, str) else list(mode)

    def segment_lengths(self, seq_len: int) -> list[int]:
        """Segment lengths for a sequence of ``seq_len`` tokens without packed documents
        (cached per length): every sample's, unless a step passes ``document_ids``."""
        cp = 1 if self._cp is None else self._cp.size
        return self.sequence_split.lengths(seq_len, self.seq_chunks, cp, self.order_spec)

    def sample_lengths(self, seq_len: int, document_ids: Any = None) -> list[list[int]]:
        """Each sample's segment lengths for a step. With the step's ``document_ids`` and
        ``split="compute"``, each sample's are balanced for its own documents (cached per
        layout; the same on every rank, which all hold the documents)."""
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
             document_ids: torch.Tensor | Sequence[torch.Tensor] | None = None,
             **kwargs: Any) -> Any:  # fmt: skip
        """One step on whole-batch inputs or M pre-split samples, each cut here into its K
        segments; ``document_ids`` (batch, seq_len) marks packed documents (on every rank);
        ``losses`` gets M*K unit losses whose mean is the batch's (docs/direct_api.md)."""
        presplit = split_step_inputs(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs,
                                     self.n_samples)  # fmt: skip
        self.begin_step(finalize_gradients)
        self._inputs = inputs = self.preflight.prepare(self.local_stages[0], args, kwargs,
                                                       target, presplit, document_ids,
                                                       self._whole_backward)  # fmt: skip
        self.unit_actions.begin_step(inputs.lengths, inputs.documents)
        self.run_microbatches(inputs.args, inputs.kwargs, inputs.targets, losses,
                              return_outputs, loss_kwargs=loss_kwargs)  # fmt: skip
        if self._cp is not None and self.context_parallel.reduce_grads and self.has_backward:
            self._cp.average_grads(p for s in self.local_stages for p in s.submod.parameters())
        last = [s for s in self.local_stages if s.is_last]
        if last and return_outputs:
            return merge_unit_outputs(last[0].output_chunks, self.n_samples, self.seq_dim,
                                      self.chunk_specs[2])  # fmt: skip
        return None

    def unit_loss(self, stage, output, target, mb_index, loss_kwargs):  # type: ignore[override]
        """torch's per-unit loss, weighted by the unit's share of the batch's tokens (a loss
        that runs its own backward inside, :class:`seq1f1b.ChunkedLoss`, takes the weight)."""
        weight = self._inputs.weights[mb_index] if self._inputs is not None else 1.0
        if getattr(self.loss_fn, "takes_unit_weight", False):
            return self.loss_fn(output, target, weight=weight, **(loss_kwargs or {}))
        loss = super().unit_loss(stage, output, target, mb_index, loss_kwargs)
        return weighted_loss(loss, weight)

    def after_stage_init(self) -> None:
        """Give each unit's receives its own segment length (torch sizes them all alike)."""
        if self._inputs is not None:
            self.receives.resize(self.local_stages, self._inputs.unit_lengths)

    @contextlib.contextmanager
    def unit_scope(self) -> Iterator[None]:
        if self._inputs is None:
            raise RuntimeError("call step() or eval(): Seq1F1B splits the sequence itself")
        with self.unit_actions.step_scope(self.local_stages[0], self.pp_group_size):
            yield

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        return metadata_inference()


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
