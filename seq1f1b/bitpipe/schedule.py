"""ScheduleBitPipe: bidirectional V-shaped pipeline (BitPipe) on torch's pipelining runtime.

Two replicas of the model run in opposite directions over the same ``pp`` ranks, each cut into
``2*pp`` stages placed V-shaped (see :mod:`~seq1f1b.bitpipe.layout`); replica A runs the first
half of the microbatches, replica B the second. Partner ranks ``r`` and ``pp-1-r`` hold the same
layers and sum their (pre-scaled) gradients, each chunk as soon as its last backward is done.

torch's runtime does the rest, with these replica-aware pieces:

* stages whose ``is_first``/``is_last`` hold at each replica's ends (``BitPipeStage``);
* the order (:mod:`~seq1f1b.bitpipe.order`) and its lowering to SEND/RECV
  (:mod:`~seq1f1b.bitpipe.lowering`), since torch's lowering would send across replicas;
* per-microbatch losses kept by microbatch id (a rank may hold the last stage of one replica,
  whose microbatches are not ``0..M/2-1``), and exchanged between ranks ``0`` and ``pp-1`` so
  that both return all ``M`` losses;
* REDUCE_GRAD as a custom function: torch's ``perform_reduce_grad`` (FSDP post-backward), then
  the chunk's gradients scaled by ``1/M`` and all-reduced (SUM) with the twin chunk. Each
  replica's stage accumulated ``M/2`` microbatch gradients of a mean loss, so the sum over the
  pair is exactly the gradient of the mean loss over all ``M`` microbatches.

Checked on torch 2.13 (``_PipelineScheduleRuntime`` internals: ``_prepare_schedule_with_comms``,
``_maybe_compute_loss``/``_maybe_get_loss``/``_update_losses``, ``_warmup_p2p``, custom functions).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _validate_schedule,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from .layout import BitPipeLayout
from .lowering import lower_bitpipe
from .order import build_bitpipe_orders
from .sync import PairGradSync

__all__ = ["ScheduleBitPipe"]

logger = logging.getLogger(__name__)

_F = _ComputationType.FORWARD
_B = _ComputationType.FULL_BACKWARD
_REDUCE_GRAD = _ComputationType.REDUCE_GRAD


def _reduce_grad_action(action: _Action, ctx: _PipelineContext) -> None:
    """REDUCE_GRAD hook (a plain function: the runtime already hands us the schedule)."""
    schedule = ctx.schedule_ref
    assert isinstance(schedule, ScheduleBitPipe)
    schedule._reduce_grad(action.stage_index)


def reduce_order(actions: Sequence[_Action | None], per_stage: int) -> list[int]:
    """Stages in the order their last backward runs (when their gradients are final)."""
    counts: dict[int, int] = {}
    out: list[int] = []
    for a in actions:
        if a is None or a.computation_type != _B:
            continue
        counts[a.stage_index] = counts.get(a.stage_index, 0) + 1
        if counts[a.stage_index] == per_stage:
            out.append(a.stage_index)
    return out


class ScheduleBitPipe(_PipelineScheduleRuntime):
    """BitPipe: two V-shaped replicas in opposite directions, with eager pair gradient sync.

    Args:
        stages: this rank's four stages (``build_bitpipe_stages`` makes them).
        n_microbatches: M, split along dim 0; replica A runs microbatches ``0..M/2-1``, B the
            rest. Must be even; a multiple of pp gives the published bubble.
        loss_fn: as in torch's schedules; with ``scale_grads=True`` a mean loss.
        pair_group: the 2-rank group of this rank and its partner ``pp-1-r``.

    Ranks 0 and pp-1 hold both first stages and both last stages, so both get the whole batch
    and the whole target; ``losses`` there receives all M losses (in microbatch order) and
    ``step()`` returns the outputs of that rank's replica (first half of the batch on rank 0,
    second half on rank pp-1). Zero the gradients between steps: each step all-reduces whatever
    the parameters' ``.grad`` holds.
    """

    def __init__(
        self,
        stages: Sequence[_PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        pair_group: dist.ProcessGroup | None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
    ) -> None:
        stage_list, layout = self._check_stages(stages)
        self._check_microbatches(n_microbatches, layout.pp)
        self._check_pair_group(pair_group, stage_list[0], layout)
        super().__init__(
            stages=stage_list,
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
        )
        self.layout = layout
        self.pair_group = pair_group
        self._mb_losses: dict[int, torch.Tensor] = {}
        self._twins_checked = False
        self._grad_sync: PairGradSync | None = None
        self.pipeline_order = dict(build_bitpipe_orders(layout.pp, n_microbatches))
        self._prepare_schedule_with_comms(self.pipeline_order)
        self.register_custom_function(_REDUCE_GRAD, _reduce_grad_action)

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_stages(
        stages: Sequence[_PipelineStageBase],
    ) -> tuple[list[_PipelineStageBase], BitPipeLayout]:
        if isinstance(stages, _PipelineStageBase):
            stages = [stages]
        stage_list = sorted(stages, key=lambda s: s.stage_index)
        if not stage_list:
            raise ValueError("stages is empty: pass this rank's 4 BitPipe stages")
        first = stage_list[0]
        pp, rank = first.group_size, first.group_rank
        layout = BitPipeLayout(pp)  # ValueError for odd pp
        got = [s.stage_index for s in stage_list]
        want = layout.stages_of(rank)
        if got != want or any(s.num_stages != layout.num_stages for s in stage_list):
            raise ValueError(
                f"rank {rank} of {pp} holds stages {got} (num_stages "
                f"{sorted({s.num_stages for s in stage_list})}): BitPipe places "
                f"num_stages = 4*pp = {layout.num_stages} stages V-shaped, 4 per rank, so this "
                f"rank must hold exactly {want}. Use build_bitpipe_stages(...) to make them."
            )
        for s in stage_list:
            g = s.stage_index
            if s.is_first != layout.is_first(g) or s.is_last != layout.is_last(g):
                role = "first" if layout.is_first(g) else "last" if layout.is_last(g) else "middle"
                raise ValueError(
                    f"stage {g} reports is_first={s.is_first}, is_last={s.is_last}, but it is a "
                    f"{role} stage of BitPipe replica {layout.replica(g)}: build the stages as "
                    "BitPipeStage (or with build_bitpipe_stages), whose pipeline ends are per "
                    "replica"
                )
        return stage_list, layout

    @staticmethod
    def _check_microbatches(n_microbatches: Any, pp: int) -> None:
        if (
            isinstance(n_microbatches, bool)
            or not isinstance(n_microbatches, int)
            or n_microbatches < 2
            or n_microbatches % 2
        ):
            raise ValueError(
                f"n_microbatches={n_microbatches!r}: BitPipe gives half of the microbatches to "
                f"each replica, so it needs an even n_microbatches >= 2 (a multiple of pp={pp} "
                "gives the published bubble)"
            )
        if n_microbatches % pp:
            logger.info(
                "BitPipe with n_microbatches=%d, not a multiple of pp=%d: correct, but the "
                "bubble is larger than (pp-2)/(4M+pp-2)",
                n_microbatches,
                pp,
            )

    @staticmethod
    def _check_pair_group(
        pair_group: dist.ProcessGroup | None, stage: _PipelineStageBase, layout: BitPipeLayout
    ) -> None:
        if pair_group is None:
            raise ValueError(
                "pair_group is required: the 2-rank process group of this rank and its "
                "partner pp-1-r, which hold the same layers (build_bitpipe_stages returns it)"
            )
        pp_group = stage.group or dist.distributed_c10d._get_default_group()
        want = sorted(
            dist.get_global_rank(pp_group, r)
            for r in (stage.group_rank, layout.partner(stage.group_rank))
        )
        got = sorted(dist.get_process_group_ranks(pair_group))
        if got != want:
            raise ValueError(
                f"pair_group has global ranks {got}, but pipeline rank {stage.group_rank} pairs "
                f"with pipeline rank {layout.partner(stage.group_rank)}: expected {want} "
                "(use seq1f1b.bitpipe.new_pair_group or build_bitpipe_stages)"
            )

    def _check_order(self, actions: Mapping[int, Sequence[_Action | None]]) -> dict[int, int]:
        """torch's per-stage checks, replica halves, and mirror-symmetric gradient readiness."""
        lay, m = self.layout, self._n_microbatches
        mapping = _validate_schedule(dict(actions), lay.pp, lay.num_stages, m // 2)  # type: ignore[arg-type]
        if mapping != lay.stage_to_rank():
            raise ValueError(f"stages are not on BitPipe's ranks: {mapping}")
        for acts in actions.values():
            for a in acts:
                if a is not None and a.microbatch_index not in lay.microbatches(
                    lay.replica(a.stage_index), m
                ):
                    raise ValueError(f"{a}: microbatch of the other replica")
        ready = {r: [lay.chunk(g) for g in reduce_order(actions[r], m // 2)] for r in actions}
        for r, chunks in ready.items():
            if chunks != ready[lay.partner(r)]:
                raise ValueError(
                    f"ranks {r} and {lay.partner(r)} finish their chunks in different orders "
                    f"({chunks} vs {ready[lay.partner(r)]}); the gradient all-reduces would not "
                    "match. BitPipe orders must be mirror images across partner ranks."
                )
        return mapping

    # ------------------------------------------------------------------ lowering
    def _prepare_schedule_with_comms(
        self,
        actions: dict[int, list[_Action | None]],
        format: str = "compute_only",
    ) -> None:
        """Replica-aware lowering (torch's would send from replica A's end into B's start)."""
        if format != "compute_only":
            raise ValueError("ScheduleBitPipe lowers compute-only orders itself")
        mapping = self._check_order(actions)
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        self.pipeline_order_with_comms = lower_bitpipe(
            actions, self.layout, self._n_microbatches // 2
        )
        self._grad_sync = self._make_grad_sync(
            reduce_order(actions[self.rank], self._n_microbatches // 2)
        )
        self._forward_only: dict[int, list[_Action]] | None = None

    def _forward_only_order(self) -> dict[int, list[_Action]]:
        """eval(): the forwards alone, in the same order (torch's runtime would still run the
        backward actions and fail handing gradients between same-rank V stages)."""
        if self._forward_only is None:
            fwd = {
                r: [a for a in acts if a is not None and a.computation_type == _F]
                for r, acts in self.pipeline_order.items()
            }
            self._forward_only = lower_bitpipe(fwd, self.layout, self._n_microbatches // 2)
        return self._forward_only

    def _make_grad_sync(self, order: list[int]) -> PairGradSync:
        by_index = {s.stage_index: s for s in self._stages}
        owned: dict[int, list[torch.nn.Parameter]] = {}
        taken: set[int] = set()
        for g in reversed(order):  # a shared parameter belongs to the stage reduced last
            params = [p for p in dict.fromkeys(by_index[g].submod.parameters()) if p.requires_grad]
            owned[g] = [p for p in params if id(p) not in taken]
            taken.update(id(p) for p in params)
        assert self.pair_group is not None
        return PairGradSync(self.pair_group, order, owned)

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Load a compute-only order (one row per rank) and lower it the BitPipe way."""
        if format != "compute_only":
            raise ValueError("ScheduleBitPipe loads compute-only orders")
        with open(filename, newline="") as f:
            rows = list(csv.reader(f))
        self.pipeline_order = {r: [_Action.from_str(s) for s in row] for r, row in enumerate(rows)}
        self._prepare_schedule_with_comms(self.pipeline_order)

    # ------------------------------------------------------------------ runtime hooks
    def _warmup_p2p(
        self, stages: list[_PipelineStageBase], has_backward: bool, p2p_done: bool
    ) -> None:
        """torch's warm-up vote, once per replica: each replica is its own pipeline chain."""
        for replica in (0, 1):
            mine = [s for s in stages if self.layout.replica(s.stage_index) == replica]
            super()._warmup_p2p(mine, has_backward, p2p_done)

    def _maybe_compute_loss(
        self,
        stage: _PipelineStageBase,
        output: Any,
        target_mbs: list | None,
        mb_index: int,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if stage.is_last and self._loss_fn is not None:
            self._mb_losses[mb_index] = self._compute_loss(
                output,
                target_mbs[mb_index],  # type: ignore[index]
                loss_kwargs,
            )

    def _maybe_get_loss(self, stage: _PipelineStageBase, mb_index: int) -> torch.Tensor | None:
        if stage.is_last and self._loss_fn is not None:
            if mb_index not in self._mb_losses:
                raise RuntimeError(f"BitPipe: no loss for microbatch {mb_index} yet")
            return self._mb_losses[mb_index]
        return None

    def _reduce_grad(self, stage_index: int) -> None:
        if not self._has_backward:  # eval(): nothing to reduce
            return
        stage = next(s for s in self._stages if s.stage_index == stage_index)
        stage.perform_reduce_grad(1)  # FSDP post-backward; scaling is ours (once per param)
        assert self._grad_sync is not None
        self._grad_sync.start(stage_index, self._n_microbatches if self.scale_grads else 1)

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        assert self._grad_sync is not None
        self._mb_losses.clear()
        # re-read the parameters every step: a module moved off the meta device or re-wrapped
        # after construction (torchtitan's to_empty/init) holds new Parameter objects
        self._grad_sync = self._make_grad_sync(self._grad_sync.order)
        if not self._twins_checked:
            self._grad_sync.check_twins(self._stages[0].device)
            self._twins_checked = True
        lowered = self.pipeline_order_with_comms
        if not self._has_backward:
            self.pipeline_order_with_comms = self._forward_only_order()
        try:
            super()._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )
        finally:
            self.pipeline_order_with_comms = lowered

    def _update_losses(self, stages: Any, losses: list | None) -> None:
        """End of step: finish the gradient sync, then gather all M losses on ranks 0, pp-1."""
        assert self._grad_sync is not None
        self._grad_sync.finish()
        lasts = [s for s in self._stages if s.is_last]
        if self._loss_fn is None or not lasts:
            self._mb_losses.clear()
            return
        all_losses = self._exchange_losses(self.layout.replica(lasts[0].stage_index))
        if losses is not None:
            losses.clear()
            losses.extend(all_losses)
        self._mb_losses.clear()

    def _exchange_losses(self, replica: int) -> list[torch.Tensor]:
        """This replica's losses (kept as computed) and the partner's (received, detached)."""
        m = self._n_microbatches
        mine = self.layout.microbatches(replica, m)
        theirs = self.layout.microbatches(1 - replica, m)
        missing = [mb for mb in mine if mb not in self._mb_losses]
        if missing:
            raise RuntimeError(f"BitPipe: no losses for microbatches {missing}")
        kept = {mb: _plain(self._mb_losses[mb]) for mb in mine}
        local = torch.stack([kept[mb].detach() for mb in mine])
        both = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(both, local, group=self.pair_group)
        other = both[1 - dist.get_rank(self.pair_group)]
        out: dict[int, torch.Tensor] = dict(kept)
        out.update({mb: other[i] for i, mb in enumerate(theirs)})
        return [out[mb] for mb in range(m)]


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A DTensor loss (TP's loss parallel) as a plain tensor: c10d collectives and the
    partner's received losses are plain, and one list must not mix the two."""
    full = getattr(loss, "full_tensor", None)
    return full() if callable(full) else loss
