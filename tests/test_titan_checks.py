"""Start-up checks shared by both torchtitan versions (no torchtitan needed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from torchtitan_integration.pipeline import check_world_size, warn_short_segments


def _par(pp: int = 1, tp: int = 1, cp: int = 1, rep: int = 1, shard: int = -1) -> SimpleNamespace:
    return SimpleNamespace(
        pipeline_parallel_degree=pp,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        data_parallel_replicate_degree=rep,
        data_parallel_shard_degree=shard,
    )


@pytest.mark.parametrize(
    ("par", "world"),
    [(_par(pp=2), 2), (_par(pp=2), 4), (_par(pp=2, tp=2, shard=2), 8), (_par(), 1)],
)
def test_world_sizes_that_fit(par: SimpleNamespace, world: int) -> None:
    check_world_size(par, world)


@pytest.mark.parametrize(
    ("par", "world", "message"),
    [
        # the shipped 8B TOML (PP 4 x TP 2 x FSDP 4) on one 8-GPU node
        (_par(pp=4, tp=2, shard=4), 8, "their product 32 must equal the world size, but 8"),
        (_par(pp=4), 2, "pipeline_parallel_degree = 4: their product 4 must divide the world"),
        (_par(pp=2, cp=2), 6, "context_parallel_degree = 2: their product 4 must divide"),
    ],
)
def test_world_sizes_that_do_not_fit(par: SimpleNamespace, world: int, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_world_size(par, world)
    assert message in str(err.value)
    assert "NGPU" in str(err.value)


def test_short_segments_warn(caplog: pytest.LogCaptureFixture) -> None:
    cfg = SimpleNamespace(seq_chunks=128)
    with caplog.at_level(logging.WARNING):
        warn_short_segments([4] * 128, cfg)
    assert "segments as short as 4 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_short_segments([128] * 4, SimpleNamespace(seq_chunks=4))
    assert not caplog.text
