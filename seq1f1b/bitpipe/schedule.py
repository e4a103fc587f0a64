"""ScheduleBitPipe: bidirectional V-shaped pipeline (BitPipe) on torch's pipelining runtime.

Two replicas of the model run in opposite directions over the same ``pp`` ranks, each cut into
``2*pp`` stages placed V-shaped (see :mod:`~seq1f1b.bitpipe.layout`); replica A runs the first
half of the microbatches, replica B the second. Partner ranks ``r`` and ``pp-1-r`` hold the same
layers and sum their (pre-scaled) gradients, each chunk as soon as its last backward is done.

torch's runtime does the rest, with these replica-aware pieces:

* stages whose ``is_first``/``is_last`` hold at each replica's ends (``BitPipeStage``);
* the order (:mod:`~seq1f1b.bitpipe.order`), lowered by the shared lowering
  (:mod:`seq1f1b._runtime.lowering`) over a two-chain stage topology, since torch's lowering would
  send across replicas;
* per-microbatch losses (kept by microbatch id by :class:`~seq1f1b._runtime.UnitRuntime`: a
  rank may hold the last stage of one replica, whose microbatches are not ``0..M/2-1``),
  exchanged between ranks ``0`` and ``pp-1`` so that both return all ``M`` losses;
* packed documents (``step(..., document_ids=...)``): each microbatch's forward and backward
  run inside :func:`seq1f1b.packed_documents` of its own rows, through an action context, so
  the chunk-aware attention masks by document as an unpipelined run does;
* REDUCE_GRAD as a custom function: torch's ``perform_reduce_grad`` (FSDP post-backward), then
  the chunk's gradients scaled by ``1/M`` and all-reduced (SUM) with the twin chunk. Each
  replica's stage accumulated ``M/2`` microbatch gradients of a mean loss, so the sum over the
  pair is exactly the gradient of the mean loss over all ``M`` microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.microbatch import TensorChunkSpec

from .. import _runtime as rt
from .._runtime import Action, PipelineContext, PipelineStageBase
from .._runtime.topology import StageTopology
from ..attention.kv import metadata_inference, packed_documents
from ..schedules.loss_checks import LossChecks
from .checks import (
    check_microbatches,
    check_order,
    check_pair_group,
    check_stages,
    reduce_order,
    split_documents,
)
from .order import build_bitpipe_orders
from .sync import PairGradSync, exchange_losses, owned_parameters

__all__ = ["ScheduleBitPipe"]


def _reduce_grad_action(action: Action, ctx: PipelineContext) -> None:
    """REDUCE_GRAD hook (a plain function: the runtime already hands us the schedule)."""
    schedule = ctx.schedule_ref
    assert isinstance(schedule, ScheduleBitPipe)
    _reduce_stage_grad(schedule, action.stage_index)


def _wait_reduce_grad_action(action: Action, ctx: PipelineContext) -> None:
    """2.15's WAIT_REDUCE_GRAD: our REDUCE_GRAD already finished FSDP's reduction."""
    del action, ctx


def _reduce_stage_grad(schedule: ScheduleBitPipe, stage_index: int) -> None:
    """One stage's REDUCE_GRAD: FSDP's post-backward, then the pair all-reduce starts."""
    if not schedule.has_backward:  # eval(): nothing to reduce
        return
    stage = next(s for s in schedule.local_stages if s.stage_index == stage_index)
    stage.perform_reduce_grad(1)  # FSDP post-backward; scaling is ours (once per param)
    for module in stage.submod.modules():  # (torch's RESHARD follows; reshard is idempotent)
        if isinstance(module, FSDPModule):  # the sharded parameters hold the reduced grads
            module.reshard()  # (an unsharded group registers its unsharded ones)
    sync = schedule._grad_sync
    assert sync is not None
    sync.owned[stage_index] = owned_parameters(schedule.local_stages, sync.order)[stage_index]
    sync.start(stage_index, schedule.n_units if schedule.scale_grads else 1)


class ScheduleBitPipe(rt.UnitRuntime):
    """BitPipe: two V-shaped replicas in opposite directions, with eager pair gradient sync.

    Args:
        stages: this rank's four stages (``build_bitpipe_stages`` makes them).
        n_microbatches: M, split along dim 0; replica A runs microbatches ``0..M/2-1``, B the
            rest. Must be even; a multiple of pp gives the published bubble.
        loss_fn: as in torch's schedules; with ``scale_grads=True`` a mean loss.
        args_chunk_spec, kwargs_chunk_spec, output_merge_spec, scale_grads,
            backward_requires_autograd: as in torch's schedules.
        pair_group: the 2-rank group of this rank and its partner ``pp-1-r``.

    Ranks 0 and pp-1 hold both first stages and both last stages, so both get the whole batch
    and the whole target; ``losses`` there receives all M losses (in microbatch order) and
    ``step()`` returns the outputs of that rank's replica (first half of the batch on rank 0,
    second half on rank pp-1). Zero the gradients between steps: each step all-reduces whatever
    the parameters' ``.grad`` holds.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        pair_group: dist.ProcessGroup | None,
    ) -> None:
        stage_list, layout = check_stages(stages)
        check_microbatches(n_microbatches, layout.pp)
        self.loss_checks = LossChecks(loss_fn, n_microbatches, "scale_grads=False", scale_grads)
        check_pair_group(pair_group, stage_list[0], layout)
        super().__init__(stages=stage_list, n_microbatches=n_microbatches, loss_fn=loss_fn,
                         args_chunk_spec=args_chunk_spec, kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads,
                         backward_requires_autograd=backward_requires_autograd)  # fmt: skip
        self.layout, self.pair_group = layout, pair_group
        self._twins_checked = False
        self._grad_sync: PairGradSync | None = None
        self._documents: list[torch.Tensor] | None = None  # this step's, per microbatch
        self.failures = rt.StepFailures(stage_list[0].group, "ScheduleBitPipe.step()")
        self._install_order(dict(build_bitpipe_orders(layout.pp, n_microbatches)))
        self.register_action_context(self._documents_of_action)
        self.register_custom_function(rt.REDUCE_GRAD, _reduce_grad_action)
        if rt.WAIT_REDUCE_GRAD is not None:
            self.register_custom_function(rt.WAIT_REDUCE_GRAD, _wait_reduce_grad_action)

    def step(
        self,
        *args: Any,
        document_ids: torch.Tensor | Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """torch's ``step()`` (and, through it, ``eval()``), plus packed documents:
        ``document_ids`` (batch, seq_len), one contiguous run of equal ids per document, keeps
        chunk-aware attention (``documents=True``) inside each document. Split as the inputs
        are (with pre-split inputs, a list of M tensors); pass it on every rank."""
        self._documents = split_documents(document_ids, self.n_units, kwargs)
        try:
            with self.failures.scope():  # a failure on one rank raises on all, named
                error, _ = self.loss_checks.before_step(self, kwargs.get("target"),
                                                        kwargs.get("target_mbs"), None, False)
                if error is not None:
                    raise error
                return super().step(*args, **kwargs)
        finally:
            self._documents = None

    def unit_loss(self, stage, output, target, mb_index, loss_kwargs):  # type: ignore[override]
        """torch's loss; the first step tests that a loss meant as a mean is not a sum."""
        loss = super().unit_loss(stage, output, target, mb_index, loss_kwargs)
        self.loss_checks.after_unit(output, target, loss, loss_kwargs, None)
        return loss

    def _documents_of_action(
        self, stage: PipelineStageBase, action: Action
    ) -> contextlib.AbstractContextManager[None]:
        """A microbatch's forward and backward (recomputation attends again): its documents."""
        del stage
        if self._documents is None or action.microbatch_index is None:
            return contextlib.nullcontext()
        return packed_documents(self._documents[action.microbatch_index])

    def stage_mapping(self, actions: Mapping[int, Sequence[Action | None]]) -> dict[int, int]:
        """torch's per-stage checks, replica halves, and mirror-symmetric gradient readiness."""
        mapping = check_order(actions, self.layout, self.n_units)
        self._grad_sync = self._make_grad_sync(reduce_order(actions[self.rank], self.n_units // 2))
        return mapping

    def stage_topology(self, stage_to_rank: Mapping[int, int]) -> StageTopology:
        """Two chains of 2*pp stages: nothing crosses from replica A's end into B's start."""
        return StageTopology.chains(
            self.layout.num_stages, stage_to_rank.__getitem__, self.layout.replica_stages
        )

    def microbatches_per_stage(self) -> int:
        return self.n_units // 2  # each replica runs half of the microbatches

    def lowering_options(self) -> dict[str, Any]:
        # REDUCE_GRAD is ours (pair sync) and waits in place; a deferred wait cannot apply
        return {**super().lowering_options(), "defer_reduce_grad_wait": False}

    def _make_grad_sync(self, order: list[int]) -> PairGradSync:
        assert self.pair_group is not None
        return PairGradSync(self.pair_group, order, owned_parameters(self.local_stages, order))

    def stage_chain(self, stage: PipelineStageBase) -> int:
        return self.layout.replica(stage.stage_index)

    def unit_scope(self) -> Any:
        """Per step: re-read the parameters and check the twins once before any traffic."""
        assert self._grad_sync is not None
        # a module moved off the meta device or re-wrapped after construction (torchtitan's
        # to_empty/init) holds new Parameter objects
        self._grad_sync = self._make_grad_sync(self._grad_sync.order)
        if not self._twins_checked:
            self._grad_sync.check_twins(self.local_stages[0].device)
            self._twins_checked = True
        return super().unit_scope()

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        """Shape inference: plain attention; a :class:`seq1f1b.ChunkedLoss` runs no backward."""
        return metadata_inference()

    def collect_losses(self, unit_losses: dict[int, torch.Tensor], losses: list) -> None:
        """All M losses on ranks 0 and pp-1 (each computed one replica's half)."""
        assert self.pair_group is not None
        replica = self.layout.replica(next(s for s in self.local_stages if s.is_last).stage_index)
        losses.extend(
            exchange_losses(self.layout, self.pair_group, replica, unit_losses, self.n_units)
        )

    def finish_step(self) -> None:
        """End of step: the pair gradient all-reduces complete before the losses are read."""
        assert self._grad_sync is not None
        self._grad_sync.finish()
