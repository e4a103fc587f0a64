"""Per-unit receive metadata and the even segment split, as proposed to torch: one
implementation for both.

The code between the markers below is, character for character, what
``upstream/series/0006-*.patch`` adds to ``torch/distributed/pipelining/schedules.py`` for
them (torch's style: 88 columns, its private names); ``tests/test_upstream_verbatim.py`` fails
if the two differ, so a fix is made once. This header binds the names that code reads in
torch's module to the seam's (:mod:`seq1f1b._runtime`). :mod:`.receives` sizes each unit's
receives with ``_resize_seq_meta``; :mod:`.partition`'s uniform split is
``_get_even_segment_lengths``. Not formatted by ruff (``pyproject.toml``): its layout is
torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from .._runtime.ir import DTensorMeta as _DTensorMeta
from .._runtime.ir import TensorMeta

__all__ = ["_get_even_segment_lengths", "_resize_seq_meta", "_strides_like"]

# upstream: begin (torch/distributed/pipelining/schedules.py, patch 6)
def _resize_seq_meta(meta: TensorMeta, seq_dim: int, length: int) -> TensorMeta:
    """Return ``meta`` with ``length`` positions at ``seq_dim``, same layout."""
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
            global_stride=_strides_like(global_shape, meta.global_stride),
        )
        length = local // old_global
    shape = list(meta.shape)
    shape[seq_dim] = length
    return replace(
        meta, shape=torch.Size(shape), stride=_strides_like(shape, meta.stride)
    )


def _strides_like(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dim order of ``stride``."""
    order = sorted(range(len(shape)), key=lambda d: stride[d])
    new_stride = [0] * len(shape)
    step = 1
    for d in order:
        new_stride[d] = step
        step *= max(shape[d], 1)
    return tuple(new_stride)


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
# upstream: end
