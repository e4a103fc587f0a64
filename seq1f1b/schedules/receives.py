"""Receive sizing: each unit's activation and gradient receives get their own segment length,
and every received activation is checked against it before it is used.

torch sizes all receives of a stage alike, from the first unit it ran (2.13/2.14: preallocated
buffers; 2.15: ``tensor_meta`` per receive). Segments differ in length within a step and
between steps. The sizing is torch's, proposed in patch 6 of upstream/ (``_SequenceRecvMeta``,
one per stage, in :mod:`.upstream`): each unit gets its segment's share of the positions torch
inferred, in a contiguous layout, which covers sequence-sharded activations (tensor and context
parallelism) and samples cut differently. On a torch with the per-microbatch receive hook
(``register_recv_meta_fn``, patch 5) it is the stage's hook; otherwise the seam's
``set_recv_length`` rewrites each receive per unit per step with it.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import _runtime as rt
from .._runtime import PipelineStageBase
from .upstream import _SequenceRecvMeta

__all__ = ["ReceiveSizer"]

_Key = tuple[int, bool, int, int]  # (stage, backward?, unit, slot)
_ADVICE = (
    "uneven segments need activations that keep the sequence at seq_dim (else use "
    "split='uniform' with a divisible seq_len); a sequence sharded over n ranks needs "
    "SequenceSplit(multiple_of=n) (e.g. the TP size)"
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
            sizing = self._of(stage.stage_index)
            sizing.lengths = tuple(lengths)
            if rt.RECV_META_HOOK and stage.stage_index not in self._hooked:
                rt.register_recv_meta_fn(stage, sizing)
                self._hooked.add(stage.stage_index)
        if rt.RECV_META_HOOK:
            return
        for stage in stages:
            for backward in (False, True):
                kind = "gradient" if backward else "activation"
                for u, infos in rt.recv_infos(stage, backward).items():
                    if u >= len(lengths):  # sized for more units by another schedule
                        continue
                    for i, info in enumerate(infos):
                        shape = rt.recv_shape(info)
                        if shape is None:
                            continue
                        want = self.length((stage.stage_index, backward, u, i), shape)
                        if want is not None:
                            sizing = partial(self._of(stage.stage_index), u, kind, i)
                            rt.set_recv_length(info, self.seq_dim, want, sizing)

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
