"""What ScheduleBitPipe refuses, checked before any traffic: the stages this rank must hold, the
microbatch count, the pair group, an order's placement and mirror symmetry, and the step's
``document_ids``. Each error names the constraint and the fix."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from .. import _runtime as rt
from .._runtime import Action, PipelineStageBase
from .layout import BitPipeLayout

__all__ = [
    "check_microbatches",
    "check_order",
    "check_pair_group",
    "check_stages",
    "reduce_order",
    "split_documents",
]

logger = logging.getLogger(__name__)


def reduce_order(actions: Sequence[Action | None], per_stage: int) -> list[int]:
    """Stages in the order their last backward runs (when their gradients are final)."""
    counts: dict[int, int] = {}
    out: list[int] = []
    for a in actions:
        if a is None or a.computation_type != rt.FULL_BACKWARD:
            continue
        counts[a.stage_index] = counts.get(a.stage_index, 0) + 1
        if counts[a.stage_index] == per_stage:
            out.append(a.stage_index)
    return out


def check_stages(
    stages: PipelineStageBase | Sequence[PipelineStageBase],
) -> tuple[list[PipelineStageBase], BitPipeLayout]:
    """This rank's four stages, sorted, and the layout they must follow."""
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


def check_microbatches(n_microbatches: Any, pp: int) -> None:
    """An even count (half per replica); a multiple of pp gives the published bubble."""
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


def check_pair_group(
    pair_group: dist.ProcessGroup | None, stage: PipelineStageBase, layout: BitPipeLayout
) -> None:
    """The pair group holds exactly this rank and its partner ``pp-1-r``."""
    if pair_group is None:
        raise ValueError(
            "pair_group is required: the 2-rank process group of this rank and its "
            "partner pp-1-r, which hold the same layers (build_bitpipe_stages returns it)"
        )
    pp_group = stage.group or rt.default_process_group()
    ranks = (stage.group_rank, layout.partner(stage.group_rank))
    want = sorted(dist.get_global_rank(pp_group, r) for r in ranks)
    got = sorted(dist.get_process_group_ranks(pair_group))
    if got != want:
        raise ValueError(
            f"pair_group has global ranks {got}, but pipeline rank {stage.group_rank} pairs "
            f"with pipeline rank {layout.partner(stage.group_rank)}: expected {want} "
            "(use seq1f1b.bitpipe.new_pair_group or build_bitpipe_stages)"
        )


def check_order(
    actions: Mapping[int, Sequence[Action | None]], layout: BitPipeLayout, n_microbatches: int
) -> dict[int, int]:
    """torch's per-stage checks, replica halves, and mirror-symmetric gradient readiness;
    returns the stage -> rank mapping."""
    m = n_microbatches
    mapping = rt.validate_schedule(dict(actions), layout.pp, layout.num_stages, m // 2)  # type: ignore[arg-type]
    if mapping != layout.stage_to_rank():
        raise ValueError(f"stages are not on BitPipe's ranks: {mapping}")
    for acts in actions.values():
        for a in acts:
            if a is not None and a.microbatch_index not in layout.microbatches(
                layout.replica(a.stage_index), m
            ):
                raise ValueError(f"{a}: microbatch of the other replica")
    ready = {r: [layout.chunk(g) for g in reduce_order(actions[r], m // 2)] for r in actions}
    for r, chunks in ready.items():
        if chunks != ready[layout.partner(r)]:
            raise ValueError(
                f"ranks {r} and {layout.partner(r)} finish their chunks in different orders "
                f"({chunks} vs {ready[layout.partner(r)]}); the gradient all-reduces would not "
                "match. BitPipe orders must be mirror images across partner ranks."
            )
    return mapping


def split_documents(
    document_ids: torch.Tensor | Sequence[torch.Tensor] | None, n_microbatches: int, kwargs: dict
) -> list[torch.Tensor] | None:
    """A step's ``document_ids`` per microbatch, split as the inputs are (or given as a list
    with pre-split inputs)."""
    m = n_microbatches
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
