"""The shipped TOML files parse with torchtitan's ConfigManager and pass Seq1F1B's start-up
checks (the real-size ones cannot run here, so this is what keeps them honest)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan 0.2.2 (extra 'titan') not installed", allow_module_level=True)

from torchtitan_integration import cpu

_CPU = cpu.install()  # torchtitan must see "cpu" when it is first imported (undone below)

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402

from seq1f1b import ModelShape  # noqa: E402
from torchtitan_integration.bitpipe import check_bitpipe  # noqa: E402
from torchtitan_integration.pipeline import check_config, check_schedule_name  # noqa: E402

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_validates(path: Path) -> None:
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    par = job.parallelism
    assert job.seq1f1b.seq_chunks >= 1
    check_schedule_name(par.pipeline_parallel_schedule)
    args = llama3_args[job.model.flavor]
    shape = ModelShape(
        hidden=args.dim, n_heads=args.n_heads, n_layers=args.n_layers, vocab=args.vocab_size
    )
    lengths = check_config(
        job, par.pipeline_parallel_degree, args.n_layers, par.tensor_parallel_degree, shape
    )
    assert sum(lengths) == job.training.seq_len
    assert len(lengths) == job.seq1f1b.seq_chunks
    assert all(n % par.tensor_parallel_degree == 0 for n in lengths)
    assert job.training.local_batch_size % par.pipeline_parallel_microbatch_size == 0


def test_unknown_schedule_names_the_toml_key() -> None:
    with pytest.raises(ValueError, match=r"\[parallelism\] pipeline_parallel_schedule"):
        check_schedule_name("Seq2F2B")
    check_schedule_name("interleaved1f1b")  # torch's names still work


def test_bitpipe_start_up_check_names_the_key() -> None:
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="pipeline_parallel_degree = 3: BitPipe pairs rank r"):
        check_bitpipe(SimpleNamespace(pp=3))
    check_bitpipe(SimpleNamespace(pp=4))  # FSDP/TP/DP-replicate degrees are not refused


def teardown_module() -> None:
    if _CPU is not None:
        _CPU.uninstall()


def test_cpu_patches_are_undone_and_redone() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    patched = (metrics.DeviceMemoryMonitor, dist_utils.set_pg_timeouts)
    with cpu.cpu_support() as patches:
        assert patches is not None  # no CUDA here
        assert metrics.DeviceMemoryMonitor is cpu.CPUMemoryMonitor
    # leaving the block restores what was there before it (the module-level install)
    assert (metrics.DeviceMemoryMonitor, dist_utils.set_pg_timeouts) == patched
    patches = cpu.install()
    assert patches is not None
    patches.uninstall()
    patches.uninstall()  # twice is harmless
    assert metrics.DeviceMemoryMonitor is cpu.CPUMemoryMonitor  # the module-level one remains


def test_cpu_peak_flops_is_measured() -> None:
    import torchtitan.tools.utils as utils

    assert utils.get_peak_flops is cpu.measured_peak_flops
    import torch

    rng = torch.get_rng_state()
    assert 1e8 < cpu.measured_peak_flops("cpu", size=128, seconds=0.05) < 1e14
    assert torch.equal(rng, torch.get_rng_state())  # the model's seeded init is untouched
