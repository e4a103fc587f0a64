"""BitPipe placement: two V-shaped replicas on the same ``pp`` ranks, as torch stage ids.

Each replica is cut into ``2*pp`` stages (``s = 0 .. 2*pp-1``, layer chunk ``s``). Replica 0
("down", A) runs ranks 0 -> pp-1 -> 0, replica 1 ("up", B) runs pp-1 -> 0 -> pp-1. In torch's IR
the global stage id is ``g = 2*pp*replica + s`` and ``num_stages = 4*pp``, so rank ``r`` owns

    A: s = r, 2pp-1-r        B: s = pp-1-r, pp+r        (g in {r, 2pp-1-r, 3pp-1-r, 3pp+r})

Stage ``s`` of A lives on rank ``r`` and stage ``s`` of B on rank ``pp-1-r``: partner ranks hold
the same four layer chunks, one as A and one as B, which is what the gradient sync pairs up.
Stage ``g`` feeds ``g+1`` only inside a replica; nothing crosses ``g = 2pp-1 -> 2pp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from .._runtime.topology import StageTopology

__all__ = ["BitPipeLayout", "BitPipeStage", "ReplicaBoundaries"]


@dataclass(frozen=True)
class BitPipeLayout:
    """Where BitPipe puts every stage, and which stages are twins (same layers)."""

    pp: int

    def __post_init__(self) -> None:
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 2:
            raise ValueError(f"BitPipe needs pp >= 2 pipeline ranks (got {self.pp!r})")
        if self.pp % 2:
            raise ValueError(
                f"BitPipe needs an even pp (got {self.pp}): ranks r and pp-1-r hold the same "
                "layers and average their gradients, and with an odd pp the middle rank would "
                "pair with itself. Use an even pipeline degree, or another schedule."
            )

    @property
    def replica_stages(self) -> int:
        """Stages per replica (2*pp): also the number of layer chunks of the model."""
        return 2 * self.pp

    @property
    def num_stages(self) -> int:
        return 4 * self.pp

    def stage_id(self, replica: int, s: int) -> int:
        return self.replica_stages * replica + s

    def replica(self, g: int) -> int:
        return g // self.replica_stages

    def chunk(self, g: int) -> int:
        """Layer chunk (stage within its replica) of global stage ``g``."""
        return g % self.replica_stages

    def is_first(self, g: int) -> bool:
        return self.chunk(g) == 0

    def is_last(self, g: int) -> bool:
        return self.chunk(g) == self.replica_stages - 1

    def prev_stage(self, g: int) -> int | None:
        return None if self.is_first(g) else g - 1

    def next_stage(self, g: int) -> int | None:
        return None if self.is_last(g) else g + 1

    def rank_of(self, g: int) -> int:
        s, p = self.chunk(g), self.pp
        down = s if s < p else 2 * p - 1 - s  # replica A's V: 0 .. p-1, p-1 .. 0
        return down if self.replica(g) == 0 else p - 1 - down

    def stages_of(self, rank: int) -> list[int]:
        p = self.pp
        return sorted((rank, 2 * p - 1 - rank, 3 * p - 1 - rank, 3 * p + rank))

    def stage_to_rank(self) -> dict[int, int]:
        return {g: self.rank_of(g) for g in range(self.num_stages)}

    def topology(self) -> StageTopology:
        """Two chains of ``2*pp`` stages (one per replica) on BitPipe's ranks."""
        return StageTopology.chains(self.num_stages, self.rank_of, self.replica_stages)

    def partner(self, rank: int) -> int:
        return self.pp - 1 - rank

    def twin(self, g: int) -> int:
        """The stage with the same layers in the other replica (on the partner rank)."""
        return self.stage_id(1 - self.replica(g), self.chunk(g))

    def microbatches(self, replica: int, n_microbatches: int) -> range:
        """Global microbatch ids a replica runs: A the first half, B the second."""
        half = n_microbatches // 2
        return range(replica * half, (replica + 1) * half)


class ReplicaBoundaries:
    """``is_first``/``is_last`` per replica (stage ``g % 2pp``), for any torch stage class.

    torch's stage calls a stage first/last only at ``g == 0`` / ``g == num_stages - 1``; with
    two replicas in one id space, each replica's ends must count as pipeline ends so that the
    first stage takes root inputs, the last computes the loss, and neither sends across.
    """

    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage_index % (self.num_stages // 2) == 0

    @property
    def is_last(self) -> bool:
        half = self.num_stages // 2
        return self.stage_index % half == half - 1


class BitPipeStage(ReplicaBoundaries, PipelineStage):
    """A ``PipelineStage`` of a BitPipe pipeline: global id ``g``, ``num_stages = 4 * pp``.

    Peers come from the BitPipe placement (not torch's looped default), so ``g-1``/``g+1``
    resolve to the right ranks before any schedule exists.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        **kwargs,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group, **kwargs)
        if num_stages != 4 * self.group_size:
            raise ValueError(
                f"BitPipeStage: num_stages={num_stages} but the pipeline group has "
                f"{self.group_size} ranks; BitPipe has num_stages = 4 * pp "
                f"(= {4 * self.group_size}): 2 replicas x 2*pp stages"
            )
        layout = BitPipeLayout(self.group_size)
        if layout.rank_of(stage_index) != self.group_rank:
            raise ValueError(
                f"BitPipeStage: stage {stage_index} belongs on rank "
                f"{layout.rank_of(stage_index)}, not rank {self.group_rank}; rank r holds "
                f"stages {layout.stages_of(self.group_rank)} (see build_bitpipe_stages)"
            )
        self.stage_index_to_group_rank = layout.stage_to_rank()
