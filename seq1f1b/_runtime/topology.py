"""Which stage feeds which, on which rank: the one input the lowering and the replay share.

torch's runtime assumes a chain (stage ``s`` feeds ``s+1``). BitPipe's two replicas live in one
stage-id space and must not feed each other, so the graph is explicit here: ``next_of[s]`` is
the stage that consumes ``s``'s forward output (``-1`` at a pipeline end) and ``prev_of`` its
inverse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["StageTopology"]


@dataclass(frozen=True)
class StageTopology:
    rank_of: tuple[int, ...]
    next_of: tuple[int, ...]
    prev_of: tuple[int, ...] = field(init=False, default=(), compare=False)

    @classmethod
    def chain(cls, rank_of: Sequence[int]) -> StageTopology:
        """torch's topology: every stage feeds the next one."""
        n = len(rank_of)
        return cls(tuple(rank_of), tuple(s + 1 if s + 1 < n else -1 for s in range(n)))

    @classmethod
    def chains(
        cls, num_stages: int, stage_to_rank: Callable[[int], int], per_chain: int
    ) -> StageTopology:
        """Independent chains of ``per_chain`` stages each (BitPipe: two replicas)."""
        if per_chain < 1 or num_stages % per_chain:
            raise ValueError(f"{num_stages} stages do not form chains of {per_chain}")
        nxt = tuple(-1 if (s + 1) % per_chain == 0 else s + 1 for s in range(num_stages))
        return cls(tuple(stage_to_rank(s) for s in range(num_stages)), nxt)

    def __post_init__(self) -> None:
        if len(self.rank_of) != len(self.next_of):
            raise ValueError("rank_of and next_of must have one entry per stage")
        prev = [-1] * len(self.next_of)
        for s, t in enumerate(self.next_of):
            if t >= 0:
                if prev[t] >= 0:
                    raise ValueError(f"stage {t} is fed by stages {prev[t]} and {s}")
                prev[t] = s
        object.__setattr__(self, "prev_of", tuple(prev))

    @property
    def num_stages(self) -> int:
        return len(self.rank_of)

    @property
    def is_chain(self) -> bool:
        n = len(self.next_of)
        return all(t == (s + 1 if s + 1 < n else -1) for s, t in enumerate(self.next_of))

    def stage_to_rank(self, stage: int) -> int:
        return self.rank_of[stage]

    def is_first(self, stage: int) -> bool:
        return self.prev_of[stage] < 0

    def is_last(self, stage: int) -> bool:
        return self.next_of[stage] < 0

    def sends_forward(self, stage: int) -> int:
        """The stage on another rank that ``stage``'s forward output goes to (-1: none)."""
        t = self.next_of[stage]
        return t if t >= 0 and self.rank_of[t] != self.rank_of[stage] else -1

    def sends_backward(self, stage: int) -> int:
        """The stage on another rank that ``stage``'s input gradient goes to (-1: none)."""
        t = self.prev_of[stage]
        return t if t >= 0 and self.rank_of[t] != self.rank_of[stage] else -1
