"""Start-up checks shared by both torchtitan versions (no torchtitan needed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from seq1f1b import ModelShape
from torchtitan_integration.pipeline import check_world_size, warn_short_segments

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds


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
    # a debug-sized model (the shipped debug configs: 58-72 tokens at hidden 256) is told at
    # info level why its short segments are fine; a real-sized one is warned
    debug = ModelShape(hidden=256, n_heads=16, n_layers=6, vocab=2048)
    with caplog.at_level(logging.INFO):
        warn_short_segments([72, 68, 58, 58], SimpleNamespace(seq_chunks=4), debug)
    assert "fine for this debug-sized model" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    real = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=128256)
    with caplog.at_level(logging.WARNING):
        warn_short_segments([58] * 4, SimpleNamespace(seq_chunks=4), real)
    assert "segments as short as 58 tokens" in caplog.text


def _init_group(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def test_process_groups_destroyed_when_training_fails(tmp_path) -> None:
    """A failing rank must not reach interpreter exit with gloo groups alive (their worker
    threads can then abort the process instead of reporting the error: the CI abort of
    issue 20); torchtitan destroys them only after a successful run."""
    import torch.distributed as dist

    from torchtitan_integration.common import process_groups_destroyed

    with pytest.raises(ValueError, match="bad batch"):
        with process_groups_destroyed():
            _init_group(tmp_path)
            assert dist.is_initialized()
            raise ValueError("bad batch")
    assert not dist.is_initialized()


def test_0_3_entry_destroys_groups_on_failure(tmp_path, monkeypatch) -> None:
    pytest.importorskip("torchtitan")
    import torch.distributed as dist

    from torchtitan_integration.versions import TITAN_0_3, titan_generation

    if titan_generation() != TITAN_0_3:
        pytest.skip("torchtitan 0.3's entry")
    from torchtitan_integration.v03 import train

    def failing(config, logger) -> None:
        _init_group(tmp_path)
        raise RuntimeError("training failed")

    monkeypatch.setattr(train, "parse", lambda argv: object())
    monkeypatch.setattr(train, "_train", failing)
    with pytest.raises(RuntimeError, match="training failed"):
        train.run([])
    assert not dist.is_initialized()


def test_input_gradients_are_sent_contiguous() -> None:
    """The TP action context: the input gradients a stage keeps to send after its backward
    (``bwd_cache[chunk]``) become contiguous when strided (gloo and NCCL refuse to send views);
    contiguous ones, None and other chunks are kept as they are."""
    import torch

    from torchtitan_integration.pipeline import contiguous_input_grads

    strided, plain, other = torch.randn(4, 6).t(), torch.randn(3), torch.randn(4, 6).t()
    stage = SimpleNamespace(bwd_cache={1: (strided, None, plain), 2: (other,)})
    with contiguous_input_grads(stage, SimpleNamespace(microbatch_index=1)):
        pass
    got = stage.bwd_cache[1]
    assert got[0].is_contiguous() and torch.equal(got[0], strided)
    assert got[1] is None and got[2] is plain and stage.bwd_cache[2][0] is other
