"""Process-group-free stand-ins for PipelineStage, as torch's own schedule tests use."""

from __future__ import annotations

from torch.distributed.pipelining.stage import _PipelineStageBase


class MockStage(_PipelineStageBase):
    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None
        self.submod = None
        self.has_backward = True

    def _create_grad_recv_info(self, *args, **kwargs):  # pragma: no cover - abstract in torch
        return ()

    def _prepare_forward_infra(self, *args, **kwargs):  # pragma: no cover
        return None

    def _prepare_backward_infra(self, *args, **kwargs):  # pragma: no cover
        return None


def mock_stages(pp: int, stages_per_rank: int, rank: int = 0) -> list[MockStage]:
    n = pp * stages_per_rank
    return [MockStage(s, n, pp, rank) for s in range(rank, n, pp)]
