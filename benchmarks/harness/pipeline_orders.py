"""Real ``pipeline_order`` of every compared schedule, built without processes.

Why: the simulator must run the orders torch and this library actually execute, not a
re-derivation. torch's schedules are constructed on stand-in stages (no process group), the
way PyTorch's own schedule tests do; Seq1F1B's order comes from :mod:`seq1f1b.orders.order`, which
is what ``ScheduleSeq1F1B.pipeline_order`` holds; BitPipe's from :mod:`seq1f1b.bitpipe.order`.
"""

from __future__ import annotations

from dataclasses import dataclass

from seq1f1b._runtime import Action
from seq1f1b.registry import ScheduleEntry, lookup

__all__ = ["ScheduleSpec", "pipeline_order"]

Order = dict[int, list[Action | None]]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule at one size: a registry name, K only for the Seq1F1B family."""

    name: str
    pp: int
    microbatches: int
    seq_chunks: int = 1

    @property
    def entry(self) -> ScheduleEntry:
        return lookup(self.name)

    @property
    def stages_per_rank(self) -> int:
        return self.entry.stages_per_rank

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def replicas(self) -> int:
        """Independent pipelines in the stage id space (BitPipe's two model replicas)."""
        return self.entry.replicas

    @property
    def model_stages(self) -> int:
        """Stages one copy of the model is cut into (BitPipe: 2*pp per replica)."""
        return self.entry.model_stages(self.pp)

    @property
    def label(self) -> str:
        if self.entry.seq_chunked:
            return f"{self.name} K={self.seq_chunks}"
        return self.name


def pipeline_order(spec: ScheduleSpec) -> Order:
    """rank -> actions of ``spec``'s schedule; raises ValueError where torch refuses the size."""
    return spec.entry.compute_orders(spec.pp, spec.microbatches, spec.seq_chunks)
