"""The received-length check: every received activation has its unit's segment length before
it is used, never silently another's.

torch sizes all receives of a stage alike, from the first unit it ran (2.13/2.14: preallocated
buffers; 2.15: ``tensor_meta`` per receive). Segments differ in length within a step and
between steps, so the schedule sizes each unit's receives with patch 6's ``_SequenceRecvMeta``
(one per stage, :mod:`.upstream`): the stage's receive hook on a torch with patch 5, else the
seam's emulation of it (``UnitRuntime._apply_recv_meta_fns``). This check reads the same sizing,
so a torch release that changed how receives are allocated fails loudly here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .. import _runtime as rt
from .._runtime import PipelineStageBase
from .upstream import _SequenceRecvMeta

__all__ = ["ReceiveCheck"]

_Key = tuple[int, bool, int, int]  # (stage, backward?, unit, slot)
_ADVICE = (
    "uneven segments need activations that keep the sequence at seq_dim (else use "
    "seq_split='uniform' with a divisible seq_len); a sequence sharded over n ranks needs "
    "SequenceSplit(multiple_of=n) (e.g. the TP size)"
)


class ReceiveCheck:
    """Checks one schedule's receives against each unit's segment (see the module docstring);
    ``sizing``: each stage's ``_SequenceRecvMeta`` (by stage index), which sizes them."""

    def __init__(self, seq_dim: int, sizing: Mapping[int, _SequenceRecvMeta]) -> None:
        self.seq_dim = seq_dim
        self._sizing = dict(sizing)

    @classmethod
    def of(
        cls, seq_dim: int, stages: Sequence[PipelineStageBase], sizing: Sequence[_SequenceRecvMeta]
    ) -> ReceiveCheck:
        """The check of a schedule's stages, each sized by its ``_SequenceRecvMeta``."""
        return cls(seq_dim, {s.stage_index: r for s, r in zip(stages, sizing, strict=True)})

    def size_units(self, unit_lengths: Sequence[int]) -> None:
        """Size every stage's receives for this step: unit ``u`` has ``unit_lengths[u]``."""
        for sizing in self._sizing.values():
            sizing.lengths = tuple(unit_lengths)

    def length(self, key: _Key, shape: torch.Size) -> int | None:
        """Positions the receive ``key`` holds at ``seq_dim`` for its unit (None: not a
        per-token tensor); ``shape``: its shape now (the first one seen is torch's)."""
        stage_index, backward, unit, slot = key
        kind = "gradient" if backward else "activation"
        try:
            return self._sizing[stage_index]._positions(unit, kind, slot, shape)
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
