"""Receive sizing: each unit's activation and gradient receives get their own segment length,
and every received activation is checked against it before it is used.

torch sizes all receives of a stage alike, from the first unit it ran (2.13/2.14: preallocated
buffers; 2.15: ``tensor_meta`` per receive). Segments differ in length within a step and
between steps. The sizing is torch's, proposed in patch 6 of upstream/ (``_SequenceRecvMeta``,
one per stage, in :mod:`.upstream`): each unit gets its segment's share of the positions torch
inferred, which covers sequence-sharded activations (tensor and context parallelism) and
samples cut differently. On a torch with the per-microbatch receive hook
(``register_recv_meta_fn``, patch 5) the stage's hook asks it for each receive's length and
nothing is rewritten; otherwise the seam's ``set_recv_length`` resizes each receive per unit
per step to that length. Either way the resized metadata is contiguous (:func:`resize_meta`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _runtime as rt
from .._runtime import PipelineStageBase
from .upstream import _resize_seq_meta, _SequenceRecvMeta

__all__ = ["ReceiveSizer", "resize_meta"]

_Key = tuple[int, bool, int, int]  # (stage, backward?, unit, slot)
_ADVICE = (
    "uneven segments need activations that keep the sequence at seq_dim (else use "
    "split='uniform' with a divisible seq_len); a sequence sharded over n ranks needs "
    "split_multiple_of=n (e.g. the TP size)"
)


class ReceiveSizer:
    """Sizes one schedule's receives per unit (see the module docstring)."""

    def __init__(self, seq_dim: int) -> None:
        self.seq_dim = seq_dim
        self._sizing: dict[int, _SequenceRecvMeta] = {}  # by stage index (torch's, patch 6)
        self._hooked: set[int] = set()  # stages whose receive hook is torch's sizing (patch 5)

    def _of(self, stage_index: int) -> _SequenceRecvMeta:
        return self._sizing.setdefault(stage_index, _SequenceRecvMeta(self.seq_dim))

    def resize(self, stages: list[PipelineStageBase], lengths: list[int]) -> None:
        """Give each unit's receives (forward and backward) its segment's share
        (``lengths[u]``: unit ``u``'s length)."""
        for stage in stages:
            self._of(stage.stage_index).lengths = tuple(lengths)
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
                        want = self.length((stage.stage_index, backward, u, i), shape)
                        if want is not None:
                            rt.set_recv_length(info, self.seq_dim, want, resize_meta)

    def _meta_fn(self, stage_index: int) -> Callable[[int, str, int, Any], Any]:
        """The stage's receive hook (patch 5): torch's sizing (``_positions``) in a contiguous
        layout (``_SequenceRecvMeta`` keeps the inferred one, which gloo cannot receive into)."""

        def fn(mb_index: int, kind: str, arg_index: int, meta: Any) -> Any:
            key = (stage_index, kind == "gradient", mb_index, arg_index)
            want = self.length(key, meta.shape)
            return meta if want is None else resize_meta(meta, self.seq_dim, want)

        return fn

    def length(self, key: _Key, shape: torch.Size) -> int | None:
        """Positions the receive ``key`` holds at ``seq_dim`` for its unit (None: not a
        per-token tensor); ``shape``: its shape now (the first one seen is torch's)."""
        stage_index, backward, unit, slot = key
        kind = "gradient" if backward else "activation"
        try:
            return self._of(stage_index)._positions(unit, kind, slot, shape)
        except ValueError as e:
            raise ValueError(f"stage {stage_index}: {e}: {_ADVICE}") from e

    def check_received(self, stage: PipelineStageBase, unit: int) -> None:
        """Every received activation has its unit's segment length (never silently wrong)."""
        for slot, info, buf in rt.received_tensors(stage, unit):
            shape = rt.recv_shape(info)  # the descriptor's, as sized (or inferred: patch 5)
            if shape is None:
                continue
            want = self.length((stage.stage_index, False, unit, slot), shape)
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
