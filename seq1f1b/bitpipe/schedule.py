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
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

from .. import _runtime as rt
from .._runtime import Action, PipelineContext, PipelineStageBase
from .._runtime.topology import StageTopology
from ..attention.kv import metadata_inference, packed_documents
from .layout import BitPipeLayout
from .order import build_bitpipe_orders
from .sync import PairGradSync

__all__ = ["ScheduleBitPipe"]

logger = logging.getLogger(__name__)

_F = rt.FORWARD
_B = rt.FULL_BACKWARD


def _reduce_grad_action(action: Action, ctx: PipelineContext) -> None:
    """REDUCE_GRAD hook (a plain function: the runtime already hands us the schedule)."""
    schedule = ctx.schedule_ref
    assert isinstance(schedule, ScheduleBitPipe)
    schedule._reduce_grad(action.stage_index)


def _wait_reduce_grad_action(action: Action, ctx: PipelineContext) -> None:
    """2.15's WAIT_REDUCE_GRAD: our REDUCE_GRAD already finished FSDP's reduction."""
    del action, ctx


def reduce_order(actions: Sequence[Action | None], per_stage: int) -> list[int]:
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
        self._twins_checked = False
        self._grad_sync: PairGradSync | None = None
        self._documents: list[torch.Tensor] | None = None  # this step's, per microbatch
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
        """torch's ``step()`` (and, through it, ``eval()``), plus packed documents.

        ``document_ids`` (batch, seq_len) marks packed documents (one contiguous run of equal
        ids each) for chunk-aware attention (:func:`seq1f1b.chunk_aware_attention` with
        ``documents=True``): attention stays inside each document. It is split into
        microbatches as the inputs are; with pre-split inputs (``arg_mbs``...) pass a list of
        M tensors. Pass it on every rank (every stage attends); the model does not see it.
        """
        self._documents = self._split_documents(document_ids, kwargs)
        try:
            return super().step(*args, **kwargs)
        finally:
            self._documents = None

    def _split_documents(
        self, document_ids: torch.Tensor | Sequence[torch.Tensor] | None, kwargs: dict
    ) -> list[torch.Tensor] | None:
        m = self.n_units
        if document_ids is None:
            return None
        if isinstance(document_ids, torch.Tensor):
            if any(kwargs.get(k) is not None for k in ("arg_mbs", "kwarg_mbs", "target_mbs")):
                raise ValueError(
                    "document_ids: with pre-split inputs (arg_mbs/kwarg_mbs/target_mbs) pass "
                    f"a list of {m} per-microbatch tensors, not one whole-batch tensor"
                )
            if document_ids.dim() != 2 or document_ids.shape[0] < m:
                raise ValueError(
                    f"document_ids has shape {tuple(document_ids.shape)}: expected (batch, "
                    f"seq_len) with batch >= n_microbatches = {m}, split as the inputs are"
                )
            chunks, _ = split_args_kwargs_into_chunks((document_ids,), None, m)
            return [c[0] for c in chunks]
        docs = list(document_ids)
        if len(docs) != m:
            raise ValueError(
                f"document_ids is a list of {len(docs)} tensors: pass one per microbatch "
                f"(n_microbatches = {m})"
            )
        return docs

    def _documents_of_action(
        self, stage: PipelineStageBase, action: Action
    ) -> contextlib.AbstractContextManager[None]:
        """A microbatch's forward and backward (recomputation attends again) see its
        documents."""
        del stage
        if self._documents is None or action.microbatch_index is None:
            return contextlib.nullcontext()
        return packed_documents(self._documents[action.microbatch_index])

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_stages(
        stages: Sequence[PipelineStageBase],
    ) -> tuple[list[PipelineStageBase], BitPipeLayout]:
        if isinstance(stages, PipelineStageBase):
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
        pair_group: dist.ProcessGroup | None, stage: PipelineStageBase, layout: BitPipeLayout
    ) -> None:
        if pair_group is None:
            raise ValueError(
                "pair_group is required: the 2-rank process group of this rank and its "
                "partner pp-1-r, which hold the same layers (build_bitpipe_stages returns it)"
            )
        pp_group = stage.group or rt.default_process_group()
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

    def stage_mapping(self, actions: Mapping[int, Sequence[Action | None]]) -> dict[int, int]:
        """torch's per-stage checks, replica halves, and mirror-symmetric gradient readiness."""
        lay, m = self.layout, self.n_units
        mapping = rt.validate_schedule(dict(actions), lay.pp, lay.num_stages, m // 2)  # type: ignore[arg-type]
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
        self._grad_sync = self._make_grad_sync(reduce_order(actions[self.rank], m // 2))
        return mapping

    # ------------------------------------------------------------------ lowering
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
        return PairGradSync(self.pair_group, order, self._owned_parameters(order))

    def _owned_parameters(self, order: list[int]) -> dict[int, list[torch.nn.Parameter]]:
        """Each stage's parameters as registered now; a shared one belongs to the stage
        reduced last."""
        by_index = {s.stage_index: s for s in self.local_stages}
        owned: dict[int, list[torch.nn.Parameter]] = {}
        taken: set[int] = set()
        for g in reversed(order):
            params = [p for p in dict.fromkeys(by_index[g].submod.parameters()) if p.requires_grad]
            owned[g] = [p for p in params if id(p) not in taken]
            taken.update(id(p) for p in params)
        return owned

    # ------------------------------------------------------------------ runtime hooks
    def stage_chain(self, stage: PipelineStageBase) -> int:
        return self.layout.replica(stage.stage_index)

    def _reduce_grad(self, stage_index: int) -> None:
        if not self.has_backward:  # eval(): nothing to reduce
            return
        stage = next(s for s in self.local_stages if s.stage_index == stage_index)
        stage.perform_reduce_grad(1)  # FSDP post-backward; scaling is ours (once per param)
        for module in stage.submod.modules():  # (torch's RESHARD follows; reshard is idempotent)
            if isinstance(module, FSDPModule):  # the sharded parameters hold the reduced grads
                module.reshard()  # (an unsharded group registers its unsharded ones)
        sync = self._grad_sync
        assert sync is not None
        sync.owned[stage_index] = self._owned_parameters(sync.order)[stage_index]
        sync.start(stage_index, self.n_units if self.scale_grads else 1)

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
        """torch's shape-inference forward: plain attention, and a loss that runs its own
        backward (:class:`seq1f1b.ChunkedLoss`) runs none (no gradients before the step)."""
        return metadata_inference()

    def collect_losses(self, unit_losses: dict[int, torch.Tensor], losses: list) -> None:
        """All M losses on ranks 0 and pp-1 (each computed one replica's half)."""
        lasts = [s for s in self.local_stages if s.is_last]
        losses.extend(self._exchange_losses(self.layout.replica(lasts[0].stage_index), unit_losses))

    def finish_step(self) -> None:
        """End of step: the pair gradient all-reduces complete before the losses are read."""
        assert self._grad_sync is not None
        self._grad_sync.finish()

    def _exchange_losses(
        self, replica: int, unit_losses: dict[int, torch.Tensor]
    ) -> list[torch.Tensor]:
        """This replica's losses (kept as computed) and the partner's (received, detached)."""
        m = self.n_units
        mine = self.layout.microbatches(replica, m)
        theirs = self.layout.microbatches(1 - replica, m)
        missing = [mb for mb in mine if mb not in unit_losses]
        if missing:
            raise RuntimeError(f"BitPipe: no losses for microbatches {missing}")
        kept = {mb: _plain(unit_losses[mb]) for mb in mine}
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
