"""Per-unit receive sizing, the even segment split and the cutting of a sample into segments
(and back), as proposed to torch: one implementation for both.

The code between the markers below is, character for character, what
``upstream/series/0006-*.patch`` adds to ``torch/distributed/pipelining/schedules.py`` for
them (torch's style: 88 columns, its private names); ``tests/test_upstream_verbatim.py`` fails
if the two differ, so a fix is made once. This header binds the names that code reads in
torch's module to the seam's (:mod:`seq1f1b._runtime`) and to torch's own. :mod:`.receives`
sizes each unit's receives with ``_SequenceRecvMeta``: the stages' receive hook on a torch with
patch 5, else called by the package for each receive; :mod:`.partition`'s uniform split is
``_get_even_segment_lengths``; :mod:`.microbatch` cuts each tensor with
``_split_into_segments`` and merges outputs with ``_merge_segments``.
Not formatted by ruff (``pyproject.toml``): its layout is torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.utils._pytree import _broadcast_to_and_flatten, tree_flatten, tree_unflatten

from .._runtime.ir import DTensorMeta as _DTensorMeta
from .._runtime.ir import TensorMeta

__all__ = [
    "_SequenceRecvMeta",
    "_get_even_segment_lengths",
    "_merge_segments",
    "_resize_seq_meta",
    "_split_into_segments",
]

# upstream: begin (torch/distributed/pipelining/schedules.py, patch 6)
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
# upstream: end
