"""Receive sizing: each unit's activation and gradient receives get their own segment length,
and every received activation is checked against it before it is used.

torch sizes all receives of a stage alike, from the first microbatch it ever saw (2.13/2.14:
preallocated buffers; 2.15: ``tensor_meta`` per receive). Segments differ in length within a
step and between steps, so the seam's ``set_recv_length`` resizes each receive per unit per
step. The ratio (positions torch saw : tokens of the segment it saw them for) is kept, not the
size, which covers sequence-sharded activations (tensor parallel) and steps of any length.
On a torch with the per-microbatch receive hook (``register_recv_meta_fn``, patch 5 of
upstream/), that hook asks this class for each receive's length and nothing is rewritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _runtime as rt
from .._runtime import PipelineStageBase
from .upstream import _resize_seq_meta

__all__ = ["ReceiveSizer", "resize_meta"]

_Key = tuple[int, bool, int, int]  # (stage, backward?, unit, slot)


class ReceiveSizer:
    """Sizes one schedule's receives per unit (see the module docstring)."""

    def __init__(self, seq_dim: int) -> None:
        self.seq_dim = seq_dim
        self._base: dict[_Key, tuple[int, int]] = {}  # (positions torch saw, their tokens)
        self._lengths: list[int] = []  # by unit
        self._hooked: set[int] = set()  # stages whose receive hook asks us (patch 5)

    def resize(self, stages: list[PipelineStageBase], lengths: list[int]) -> None:
        """Give each unit's receives (forward and backward) its segment's length
        (``lengths[u]``: unit ``u``'s)."""
        self._lengths = lengths
        if rt.RECV_META_HOOK:
            for stage in stages:
                if stage.stage_index not in self._hooked:
                    rt.register_recv_meta_fn(stage, self._meta_fn(stage.stage_index))
                    self._hooked.add(stage.stage_index)
            return
        for stage in stages:
            for backward in (False, True):
                for u, infos in rt.recv_infos(stage, backward).items():
                    if u >= len(lengths):  # sized for more units by another schedule
                        continue
                    for i, info in enumerate(infos):
                        shape = rt.recv_shape(info)
                        if shape is None:
                            continue
                        want = self.length(lengths, (stage.stage_index, backward, u, i), shape)
                        if want is not None:
                            rt.set_recv_length(info, self.seq_dim, want, resize_meta)

    def _meta_fn(self, stage_index: int) -> Callable[[int, str, int, Any], Any]:
        def fn(mb_index: int, kind: str, arg_index: int, meta: Any) -> Any:
            key = (stage_index, kind == "gradient", mb_index, arg_index)
            want = self.length(self._lengths, key, meta.shape)
            return meta if want is None else resize_meta(meta, self.seq_dim, want)

        return fn

    def length(self, lengths: list[int], key: _Key, shape: torch.Size) -> int | None:
        """Positions the receive ``key`` holds at ``seq_dim`` (None: not a per-token tensor;
        ``lengths``: every unit's segment length)."""
        stage_index, _, unit, _ = key
        dim = self.seq_dim
        if len(shape) <= dim:
            if len(set(lengths)) == 1:
                return None
            raise ValueError(
                f"stage {stage_index} receives a tensor of shape {tuple(shape)} with no "
                f"sequence dim {dim}: uneven segment lengths need activations that keep the "
                "sequence at seq_dim; use split='uniform' with a divisible seq_len"
            )
        base, tokens = self._base.setdefault(key, (int(shape[dim]), lengths[0]))
        seg = lengths[unit]
        if (base * seg) % tokens:
            raise ValueError(
                f"stage {stage_index} receives activations with {base} positions for a "
                f"segment of {tokens} tokens, which does not scale to a segment of {seg}: "
                "set split_multiple_of to the sequence-sharding degree (e.g. the TP size)"
            )
        return base * seg // tokens

    def check_received(self, stage: PipelineStageBase, unit: int, lengths: list[int]) -> None:
        """Every received activation has its unit's segment length (never silently wrong)."""
        for slot, info, buf in rt.received_tensors(stage, unit):
            shape = rt.recv_shape(info)  # the descriptor's, as sized (or inferred: patch 5)
            if shape is None:
                continue
            want = self.length(lengths, (stage.stage_index, False, unit, slot), shape)
            if want is not None and buf.shape[self.seq_dim] != want:
                raise RuntimeError(
                    f"stage {stage.stage_index}, unit {unit}: received an activation with "
                    f"{buf.shape[self.seq_dim]} positions at dim {self.seq_dim}, expected "
                    f"{want} (its segment). The receive was not sized per unit: this torch "
                    "release changed how receive buffers are allocated (see seq1f1b/_runtime/)."
                )


def resize_meta(meta: rt.TensorMeta, dim: int, length: int) -> rt.TensorMeta:
    """``meta`` with ``length`` local positions at ``dim`` in a contiguous layout (p2p backends
    send contiguous tensors), a DTensor's global shape in proportion: torch's resizing
    (``_resize_seq_meta``, patch 6), which takes the global length of a DTensor."""
    contiguous = {"stride": _contiguous(meta.shape)}
    global_length = length
    if isinstance(meta, rt.DTensorMeta):
        contiguous["global_stride"] = _contiguous(meta.global_shape)
        global_length = round(meta.global_shape[dim] * length / meta.shape[dim])
    if meta.shape[dim] == length and tuple(meta.stride) == contiguous["stride"]:
        return meta
    return _resize_seq_meta(dataclasses.replace(meta, **contiguous), dim, global_length)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))
