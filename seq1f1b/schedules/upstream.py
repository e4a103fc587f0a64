"""Patch 6's Seq1F1B schedule as proposed to torch, the class included: one implementation for
both.

The code between the markers below is, character for character, what
``upstream/series/0006-*.patch`` adds to ``torch/distributed/pipelining/schedules.py`` from
``_SequenceUnit`` to ``ScheduleInterleavedSeq1F1B`` (torch's style: 88 columns, its private
names); ``tests/test_upstream_verbatim.py`` fails if the two differ, so a fix is made once. The
order it runs is :mod:`seq1f1b.orders.upstream` (the patch's code before this block). This
header binds the names that code reads in torch's module to the seam's (:mod:`seq1f1b._runtime`)
and to torch's own; ``_PipelineScheduleRuntime`` is the seam's ``UnitRuntime``, which gives the
class, on a torch without the series, what it takes from a patched runtime (see the seam's
table), so ``ScheduleSeq1F1B`` here runs on torch 2.13 to 2.15 unpatched.

The package uses the helpers too: :mod:`.receives` checks each received activation against
``_SequenceRecvMeta``'s sizing; :mod:`.partition`'s uniform split is ``_get_even_segment_lengths``;
:mod:`.microbatch` cuts each tensor with ``_split_into_segments`` and merges outputs with
``_merge_segments``. The package's ``seq1f1b.ScheduleSeq1F1B`` is this class with its hooks
answered model-side (:mod:`.sequence_schedule`).
Not formatted by ruff (``pyproject.toml``): its layout is torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    split_args_kwargs_into_chunks,
)

from .._runtime.ir import TARGET_CHUNK_SPEC as _TARGET_CHUNK_SPEC
from .._runtime.ir import Action as _Action
from .._runtime.ir import DTensorMeta as _DTensorMeta
from .._runtime.ir import PipelineStageBase as _PipelineStageBase
from .._runtime.ir import TensorMeta, make_contiguous_strides_for, tree_flatten, tree_unflatten
from .._runtime.ir import broadcast_to_and_flatten as _broadcast_to_and_flatten
from .._runtime.ir import split_tensor as _split_tensor
from .._runtime.unit import UnitRuntime as _PipelineScheduleRuntime
from ..orders.upstream import _get_seq1f1b_rank_ops

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "_SequenceRecvMeta",
    "_SequenceUnit",
    "_get_even_segment_lengths",
    "_merge_segments",
    "_resize_seq_meta",
    "_split_into_segments",
]

# upstream: begin (torch/distributed/pipelining/schedules.py, patch 6)
class _SequenceUnit(NamedTuple):
    """Where a Seq1F1B unit (one microbatch of the runtime) lies in its sample."""

    sample: int
    segment: int
    start: int
    length: int
    seq_len: int


def _resize_seq_meta(meta: TensorMeta, seq_dim: int, length: int) -> TensorMeta:
    """
    Return ``meta`` with ``length`` positions at ``seq_dim`` (for a DTensor,
    the global length; its local length follows in proportion), contiguous:
    the stage receives into a buffer of this layout, and p2p backends send
    and receive contiguous tensors, whatever layout the stage inferred.
    """
    if isinstance(meta, _DTensorMeta):
        old_global = meta.global_shape[seq_dim]
        local = meta.shape[seq_dim] * length
        if local % old_global != 0:
            raise ValueError(
                f"A sequence segment of {length} positions does not divide over "
                f"a DTensor with local size {meta.shape[seq_dim]} of "
                f"{old_global} at dim {seq_dim}"
            )
        global_shape = list(meta.global_shape)
        global_shape[seq_dim] = length
        meta = replace(
            meta,
            global_shape=torch.Size(global_shape),
            global_stride=make_contiguous_strides_for(global_shape),
        )
        length = local // old_global
    shape = list(meta.shape)
    shape[seq_dim] = length
    return replace(
        meta, shape=torch.Size(shape), stride=make_contiguous_strides_for(shape)
    )


def _get_even_segment_lengths(seq_len: int, seq_chunks: int) -> tuple[int, ...]:
    """
    Cut ``seq_len`` positions into ``seq_chunks`` segments of near-equal
    length, the first ones one longer when ``seq_chunks`` does not divide
    ``seq_len`` (under causal attention, earlier segments are the cheaper ones).
    This is the split of :class:`ScheduleSeq1F1B` without ``seq_split``.
    """
    if seq_len < seq_chunks:
        raise ValueError(
            f"Cannot split a sequence of length {seq_len} into "
            f"{seq_chunks} segments"
        )
    base, extra = divmod(seq_len, seq_chunks)
    return tuple(base + (1 if k < extra else 0) for k in range(seq_chunks))


def _split_into_segments(value: Any, lengths: Sequence[int], seq_dim: Any) -> list[Any]:
    """
    Cut one sample's ``value`` (a pytree) along ``seq_dim`` into segments of
    ``lengths``: one pytree per segment. ``seq_dim`` is an int for every
    leaf or, like ``vmap``'s ``in_dims``, a prefix of ``value``'s tree giving
    each leaf its own (``None``: not cut). Leaves not cut (non-tensors, tensors
    with no such dim) go whole to every segment.
    """
    leaves, tree_spec = tree_flatten(value)
    dims = _broadcast_to_and_flatten(seq_dim, tree_spec, is_leaf=lambda x: x is None)
    if dims is None:
        raise ValueError(f"seq_dim {seq_dim!r} is not a prefix of the inputs' tree")
    pieces: list[Sequence[Any]] = []
    for leaf, dim in zip(leaves, dims, strict=True):
        if isinstance(leaf, torch.Tensor) and dim is not None and leaf.dim() > dim:
            if leaf.size(dim) != sum(lengths):
                raise ValueError(
                    f"Expected sequence length {sum(lengths)} at dim {dim}, "
                    f"got a tensor of shape {tuple(leaf.shape)}"
                )
            segments = torch.split(leaf, list(lengths), dim=dim)
            # As in _split_tensor: views of a leaf need retain_grad()
            if leaf.requires_grad and leaf.is_leaf:
                for segment in segments:
                    segment.retain_grad()
            pieces.append(segments)
        else:
            pieces.append([leaf] * len(lengths))
    return [
        tree_unflatten([piece[k] for piece in pieces], tree_spec)
        for k in range(len(lengths))
    ]


def _merge_segments(chunks: list[Any], seq_chunks: int, seq_dim: int) -> list[Any]:
    """
    Merge each run of ``seq_chunks`` consecutive chunks (the segments of one
    sample) along ``seq_dim``: one merged value per sample. Tensors are
    joined with ``torch.cat``, so a DTensor sharded along ``seq_dim`` is
    joined as a DTensor (``merge_chunks`` joins the local shards, which would
    interleave the shards of the segments); other leaves are the first
    segment's.
    """
    merged = []
    for i in range(0, len(chunks), seq_chunks):
        flats = [tree_flatten(chunk) for chunk in chunks[i : i + seq_chunks]]
        leaves = [
            torch.cat(parts, dim=seq_dim)
            if isinstance(parts[0], torch.Tensor)
            else parts[0]
            for parts in zip(*(leaves for leaves, _ in flats), strict=True)
        ]
        merged.append(tree_unflatten(leaves, flats[0][1]))
    return merged


class _SequenceRecvMeta:
    """
    The receive metadata function of a Seq1F1B stage: each unit's activations
    and gradients get its segment's share of the positions at ``seq_dim``.

    The stage infers each receive's metadata from a unit; a unit of ``n``
    positions receives ``n`` times the positions per token of the first
    inference, so a tensor that holds a shard of its segment (sequence or
    context parallelism) is sized in proportion, and contiguous (see
    ``_resize_seq_meta``). ``lengths`` holds every unit's length (the samples
    of a step may be cut differently); it is set per step and holds no
    reference to the schedule (no reference cycle between the schedule and
    its stages).
    """

    def __init__(self, seq_dim: int):
        self.seq_dim = seq_dim
        self.lengths: tuple[int, ...] = ()
        # (kind, arg_index) -> (positions, segment length) of the metadata the
        # stage inferred from unit 0 of the first step that received it; the
        # ratio holds for the metadata of any later inference
        self._inferred: dict[tuple[str, int], tuple[int, int]] = {}

    def _positions(
        self, mb_index: int, kind: str, arg_index: int, shape: Sequence[int]
    ) -> int | None:
        """
        Return the local positions at ``seq_dim`` of receive ``arg_index`` of
        unit ``mb_index`` whose metadata has ``shape``, or ``None`` to leave it
        as inferred (no sequence dim, or no step has begun).
        """
        if not self.lengths:
            return None
        if len(shape) <= self.seq_dim:
            if len(set(self.lengths)) > 1:
                raise ValueError(
                    f"Seq1F1B received {kind} {arg_index} of microbatch "
                    f"{mb_index} with shape {tuple(shape)}, which has no "
                    f"sequence dim {self.seq_dim}; uneven sequence segments need "
                    "every tensor passed between stages to keep the sequence "
                    "at seq_dim"
                )
            return None
        inferred, length = self._inferred.setdefault(
            (kind, arg_index), (shape[self.seq_dim], self.lengths[0])
        )
        positions = inferred * self.lengths[mb_index]
        if positions % length != 0:
            raise ValueError(
                f"Seq1F1B received {kind} {arg_index} with {inferred} positions "
                f"for a segment of {length}, which does not scale to the "
                f"segment of {self.lengths[mb_index]} of microbatch {mb_index}"
            )
        return positions // length

    def __call__(
        self, mb_index: int, kind: str, arg_index: int, meta: TensorMeta
    ) -> TensorMeta:
        positions = self._positions(mb_index, kind, arg_index, meta.shape)
        if positions is None:
            return meta
        length = positions
        if isinstance(meta, _DTensorMeta):
            # _resize_seq_meta takes the global length of a DTensor
            global_positions = positions * meta.global_shape[self.seq_dim]
            length = global_positions // meta.shape[self.seq_dim]
        return _resize_seq_meta(meta, self.seq_dim, length)


def _get_sequence_unit(
    sample_lengths: Sequence[Sequence[int]], mb_index: int
) -> _SequenceUnit:
    """Where unit ``mb_index`` lies among samples cut into ``sample_lengths``."""
    if not sample_lengths:
        raise RuntimeError("unit_info() is only available once a step has begun")
    seq_chunks = len(sample_lengths[0])
    if not 0 <= mb_index < len(sample_lengths) * seq_chunks:
        raise ValueError(
            f"mb_index must be in [0, {len(sample_lengths) * seq_chunks}), "
            f"got {mb_index}"
        )
    sample, segment = divmod(mb_index, seq_chunks)
    lengths = sample_lengths[sample]
    start = sum(lengths[:segment])
    return _SequenceUnit(sample, segment, start, lengths[segment], sum(lengths))


def _validate_seq1f1b(
    n_microbatches: int, seq_chunks: int, seq_dim: int, seq_split: Any
) -> tuple[int, ...] | None:
    """Validate the sizes of a Seq1F1B schedule; return ``seq_split`` as a tuple."""
    for name, value in (
        ("n_microbatches", n_microbatches),
        ("seq_chunks", seq_chunks),
        ("seq_dim", seq_dim),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_split is None:
        return None
    seq_split = tuple(seq_split)
    if len(seq_split) != seq_chunks or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in seq_split
    ):
        raise ValueError(
            f"seq_split must be {seq_chunks} positive segment lengths, "
            f"got {seq_split!r}"
        )
    return seq_split


def _seq_len_of(value: Any, seq_dim: int) -> int | None:
    """Sequence length of the first tensor in ``value`` that has ``seq_dim``."""
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > seq_dim:
            return leaf.size(seq_dim)
    return None


def _get_segment_lengths(
    seq_len: int, seq_chunks: int, seq_split: tuple[int, ...] | None
) -> tuple[int, ...]:
    """
    Segment lengths of a sequence of ``seq_len`` positions: ``seq_split``,
    which must sum to it, or near-equal lengths.
    """
    if seq_split is None:
        return _get_even_segment_lengths(seq_len, seq_chunks)
    if seq_len != sum(seq_split):
        raise ValueError(
            f"Inputs have sequence length {seq_len}, but "
            f"seq_split={list(seq_split)} sums to {sum(seq_split)}"
        )
    return seq_split


def _split_into_units(
    samples: Sequence[Any],
    lengths_for: Callable[[int], Sequence[Sequence[int]]],
    seq_dim: int,
) -> list[Any]:
    """
    Cut each sample (a pytree) into its segments (see ``_split_into_segments``):
    the units of a Seq1F1B step, sample by sample. ``lengths_for(seq_len)``
    gives each sample's segment lengths from the first sample's sequence
    length (see ``ScheduleSeq1F1B._lengths_for``).
    """
    seq_len = _seq_len_of(samples[0], seq_dim)
    if seq_len is None:
        raise ValueError(
            f"Seq1F1B needs inputs and targets with a sequence dim {seq_dim}"
        )
    sample_lengths = lengths_for(seq_len)
    if len(sample_lengths) != len(samples):
        raise ValueError(
            f"Cannot split the inputs into {len(sample_lengths)} samples, "
            f"got {len(samples)}"
        )
    return [
        unit
        for sample, lengths in zip(samples, sample_lengths, strict=True)
        for unit in _split_into_segments(sample, lengths, seq_dim)
    ]


def _get_unit_loss_weight(unit: _SequenceUnit, seq_chunks: int) -> float:
    """
    The share of its sample's positions that ``unit`` holds, times the number
    of segments (1.0 for segments of equal length): weighted so, a mean loss
    over the unit's positions averages over units to the mean over the whole
    batch, whatever each sample's cut.
    """
    return unit.length * seq_chunks / unit.seq_len


def _register_seq_recv_metas(
    stages: list[_PipelineStageBase], seq_dim: int
) -> list[_SequenceRecvMeta]:
    """Register a ``_SequenceRecvMeta`` as each stage's receive metadata function."""
    recv_metas = [_SequenceRecvMeta(seq_dim) for _ in stages]
    for stage, recv_meta in zip(stages, recv_metas, strict=True):
        stage.register_recv_meta_fn(recv_meta)
    return recv_metas


def _get_units_seq_len(
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
    seq_chunks: int,
    seq_dim: int,
) -> int | None:
    """
    Return the sequence length of the first sample of a Seq1F1B step's units
    of inputs and of targets, which must agree, or ``None`` if this rank has
    neither.
    """
    seq_lens = set()
    for mbs in (list(zip(arg_mbs or (), kwarg_mbs or (), strict=True)), target_mbs):
        seg_lens = (
            [_seq_len_of(mbs[k], seq_dim) for k in range(seq_chunks)] if mbs else []
        )
        if seg_lens and None not in seg_lens:
            seq_lens.add(sum(seg_lens))  # type: ignore[arg-type]
    if len(seq_lens) > 1:
        raise ValueError(
            f"Inputs and target have sequence lengths {sorted(seq_lens)} at dim "
            f"{seq_dim}"
        )
    return seq_lens.pop() if seq_lens else None


def _all_reduce_seq_len(
    seq_len: int | None, seq_split: tuple[int, ...] | None, stage: _PipelineStageBase
) -> int:
    """
    Return a Seq1F1B step's sequence length on every rank of the pipeline
    group, from this rank's ``seq_len`` (``None``: no inputs, as on middle
    ranks): one all-reduce (MAX) over the group, none with ``seq_split``.
    """
    if seq_split is None and stage.group_size > 1:
        agreed = torch.tensor([seq_len or 0], device=stage.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=stage.group)
        if seq_len is not None and seq_len != int(agreed.item()):
            raise ValueError(
                f"This rank's inputs have sequence length {seq_len}, but "
                f"another rank's have {int(agreed.item())}"
            )
        seq_len = int(agreed.item()) or None
    if seq_len is None and seq_split is not None:
        seq_len = sum(seq_split)
    if seq_len is None:
        raise RuntimeError(
            "Seq1F1B could not learn the sequence length of this step: "
            "pass the inputs or the target, or give seq_split"
        )
    return seq_len


class ScheduleSeq1F1B(_PipelineScheduleRuntime):
    """
    The Seq1F1B schedule: 1F1B over sequence segments.
    See https://arxiv.org/abs/2406.03488 for details.

    Each of the ``n_microbatches`` samples of a batch is cut along ``seq_dim`` into
    ``seq_chunks`` segments; unit ``u = sample * seq_chunks + segment`` is
    microbatch ``u`` of the runtime, in the order of ``_get_seq1f1b_rank_ops``
    (several stages per rank: looped placement). A sample's backwards run its
    segments in reverse, so a causal model can cache each segment's keys and values
    for the later segments of its sample, learning the running unit from
    :meth:`unit_info` in a context registered with ``register_action_context``.
    Hooks for subclasses: ``_lengths_for``, ``_agree_seq_len``, ``_loss_weight``.

    Args:
        n_microbatches: Number of samples each batch is split into.
        seq_chunks: Number of sequence segments per sample.
        seq_dim: Sequence dimension of inputs, targets, outputs and the
            tensors passed between stages. Default: ``1``.
        seq_split: Lengths of the segments. Default: ``None``, near-equal
            lengths (one all-reduce per step tells middle ranks the length).
        The others are those of :class:`ScheduleInterleaved1F1B`.
    """

    def __init__(
        self,
        stages: _PipelineStageBase | list[_PipelineStageBase],
        n_microbatches: int,
        seq_chunks: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        seq_dim: int = 1,
        seq_split: Sequence[int] | None = None,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = 3,
        unshard_lookahead: Literal["full", "auto"] | tuple[int, ...] = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
    ):
        if isinstance(stages, _PipelineStageBase):
            stages = [stages]
        self.seq_split = _validate_seq1f1b(
            n_microbatches, seq_chunks, seq_dim, seq_split
        )
        super().__init__(
            stages=stages,
            n_microbatches=n_microbatches * seq_chunks,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            defer_pp_recv=defer_pp_recv,
            max_active_stages=max_active_stages,
            unshard_lookahead=unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait,
            max_outstanding_sends=max_outstanding_sends,
        )
        self.n_local_stages = len(stages)
        self.n_samples = n_microbatches
        self.seq_chunks = seq_chunks
        self.seq_dim = seq_dim
        # Each sample's segment lengths in the current step (the last one between)
        self.segment_lengths: list[tuple[int, ...]] = []
        self._recv_metas = _register_seq_recv_metas(self._stages, seq_dim)
        self.pipeline_order: dict[int, list[_Action | None]] = {
            rank: self._calculate_single_rank_operations(rank)
            for rank in range(self.pp_group_size)
        }
        self._prepare_schedule_with_comms(self.pipeline_order)

    def _calculate_single_rank_operations(self, rank) -> list[_Action | None]:
        pp, v = self.pp_group_size, self.n_local_stages
        return _get_seq1f1b_rank_ops(rank, pp, v, self.n_samples, self.seq_chunks)

    def unit_info(self, mb_index: int) -> _SequenceUnit:
        """Where unit (microbatch) ``mb_index`` of the step lies in its sample."""
        return _get_sequence_unit(self.segment_lengths, mb_index)

    def _lengths_for(self, seq_len: int) -> list[tuple[int, ...]]:
        """Each sample's segment lengths; override to cut samples differently."""
        lengths = _get_segment_lengths(seq_len, self.seq_chunks, self.seq_split)
        return [lengths] * self.n_samples

    def _agree_seq_len(self, seq_len: int | None) -> int:
        """The step's sequence length on every rank, from this rank's (or None)."""
        return _all_reduce_seq_len(seq_len, self.seq_split, self._stages[0])

    def _loss_weight(self, mb_index: int) -> float:
        """Weight of unit ``mb_index``'s loss (see ``_get_unit_loss_weight``)."""
        unit = self.unit_info(mb_index)
        return _get_unit_loss_weight(unit, self.seq_chunks) if self.scale_grads else 1.0

    def _get_microbatch_inputs(
        self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
    ) -> tuple[list | None, list | None, list | None]:
        """Gets a step's units, then fixes their lengths on every rank."""
        arg_mbs, kwarg_mbs, target_mbs = super()._get_microbatch_inputs(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
        )
        seq_len = _get_units_seq_len(
            arg_mbs, kwarg_mbs, target_mbs, self.seq_chunks, self.seq_dim
        )
        self.segment_lengths = self._lengths_for(self._agree_seq_len(seq_len))
        for recv_meta in self._recv_metas:
            recv_meta.lengths = sum(self.segment_lengths, ())
        return arg_mbs, kwarg_mbs, target_mbs

    def _split_inputs(self, args, kwargs=None):
        """Splits full-batch inputs into samples, then each into its segments."""
        if not (args or kwargs):
            return [()] * self._n_microbatches, [{}] * self._n_microbatches
        args_split, kwargs_split = split_args_kwargs_into_chunks(
            args, kwargs, self.n_samples, self._args_chunk_spec, self._kwargs_chunk_spec
        )
        samples = list(zip(args_split, kwargs_split, strict=True))
        units = _split_into_units(samples, self._lengths_for, self.seq_dim)
        return [unit[0] for unit in units], [unit[1] for unit in units]

    def _split_target(self, target: Any) -> list[Any]:
        """Splits a full-batch target into samples, then each into its segments."""
        samples = list(_split_tensor(target, _TARGET_CHUNK_SPEC, self.n_samples))
        return _split_into_units(samples, self._lengths_for, self.seq_dim)

    def _merge_outputs(self, output_chunks: list[Any]) -> Any:
        """Merges each sample's segments, then the samples as usual."""
        samples = _merge_segments(output_chunks, self.seq_chunks, self.seq_dim)
        return super()._merge_outputs(samples)

    def _maybe_compute_loss(
        self, stage, output, target_mbs, mb_index, loss_kwargs=None
    ):
        super()._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)
        loss = self._internal_losses.get(mb_index)
        if loss is not None and (weight := self._loss_weight(mb_index)) != 1.0:
            self._internal_losses[mb_index] = loss * weight


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """
    The interleaved Seq1F1B schedule: :class:`ScheduleSeq1F1B` with several
    stages per rank in looped placement (stage ``s`` on rank
    ``s % pp_group_size``), over rounds of whole samples with at least
    ``pp_group_size`` units each. Takes the same arguments.

    :class:`ScheduleSeq1F1B` already interleaves when given several stages
    per rank; this class insists on it.
    """

    def __init__(
        self, stages: list[_PipelineStageBase], *args: Any, **kwargs: Any
    ) -> None:
        if isinstance(stages, _PipelineStageBase) or len(stages) < 2:
            raise ValueError(
                "ScheduleInterleavedSeq1F1B requires at least 2 stages per rank; "
                "use ScheduleSeq1F1B for a single stage"
            )
        super().__init__(stages, *args, **kwargs)
# upstream: end
