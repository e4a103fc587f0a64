"""The shipped TOML files parse with torchtitan's ConfigManager and pass Seq1F1B's start-up
checks (the real-size ones cannot run here, so this is what keeps them honest)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from torchtitan_integration.versions import TITAN_0_2, titan_generation

if importlib.util.find_spec("torchtitan") is None or titan_generation() != TITAN_0_2:
    pytest.skip(
        "torchtitan 0.2.2's config (0.3.0's: tests/test_titan03_config.py)",
        allow_module_level=True,
    )

from torchtitan_integration import cpu
from torchtitan_integration.patches import applied
from torchtitan_integration.v022 import patches

_CPU = patches.install_cpu()  # torchtitan must see "cpu" when first imported (undone below)

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.llama3 import llama3_args  # noqa: E402

from torchtitan_integration.bitpipe import check_bitpipe  # noqa: E402
from torchtitan_integration.pipeline import check_config, check_schedule_name  # noqa: E402
from torchtitan_integration.v022.pipeline import model_shape  # noqa: E402
from torchtitan_integration.v022.validate import validate_before_start  # noqa: E402

# 0.2.2 trains llama3 (the other families' TOMLs: tests/test_titan03_config.py)
CONFIGS = sorted((Path(__file__).resolve().parents[1] / "train_configs").glob("llama3_*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_validates(path: Path) -> None:
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    par = job.parallelism
    assert job.seq1f1b.seq_chunks >= 1
    check_schedule_name(par.pipeline_parallel_schedule)
    args = llama3_args[job.model.flavor]
    shape = model_shape(args)
    lengths = check_config(
        job, par.pipeline_parallel_degree, args.n_layers, par.tensor_parallel_degree, shape
    )
    assert sum(lengths) == job.training.seq_len
    assert len(lengths) == job.seq1f1b.seq_chunks
    assert all(n % par.tensor_parallel_degree == 0 for n in lengths)
    assert job.training.local_batch_size % par.pipeline_parallel_microbatch_size == 0


def test_other_model_families_are_refused_naming_0_3() -> None:
    from torchtitan_integration.v022.validate import check_model_name

    check_model_name("llama3")
    with pytest.raises(ValueError, match=r"\[model\] name = 'qwen3': on torchtitan 0.2.2 .* 0.3"):
        check_model_name("qwen3")


def test_unknown_schedule_names_the_toml_key() -> None:
    with pytest.raises(ValueError, match=r"\[parallelism\] pipeline_parallel_schedule"):
        check_schedule_name("Seq2F2B")
    check_schedule_name("interleaved1f1b")  # torch's names still work


def test_bitpipe_start_up_check_names_the_key() -> None:
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="pipeline_parallel_degree = 3: BitPipe pairs rank r"):
        check_bitpipe(SimpleNamespace(pp=3))
    check_bitpipe(SimpleNamespace(pp=4))  # FSDP/TP/DP-replicate degrees are not refused


DEBUG = Path(__file__).resolve().parents[1] / "train_configs" / "llama3_debug_seq1f1b.toml"


@pytest.mark.parametrize(
    ("args", "dims", "message"),
    [
        (
            ["--training.seq_len", "6", "--seq1f1b.seq_chunks", "8"],
            {},
            "[training] seq_len = 6 cannot be split by [seq1f1b] seq_chunks = 8",
        ),
        (
            ["--parallelism.pipeline_parallel_schedule", "Seq2F2B"],
            {},
            "[parallelism] pipeline_parallel_schedule = 'Seq2F2B' is unknown",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedSeq1F1B",
                "--seq1f1b.stages_per_rank",
                "8",
            ],
            {},
            "cannot be placed on a model with 6 layers: at most n_layers + 2 = 8",
        ),
        (
            [
                "--model.flavor",
                "debugmodel_flex_attn",
                "--parallelism.pipeline_parallel_schedule",
                "1F1B",
            ],
            {},
            "masks attention by document (block_causal)",
        ),
        (
            ["--training.seq_len", "250"],
            {"cp": 2},
            "and context_parallel_degree = 2 (each segment a multiple of 4)",
        ),
        (
            ["--parallelism.pipeline_parallel_schedule", "1F1B"],
            {"cp": 2},
            "torch's context_parallel (which torch's schedules use) has no CPU attention",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(args: list, dims: dict, message: str) -> None:
    """Start-up checks (validate_before_start, which the train entry runs before torchtitan
    builds anything) name the TOML key and the fix."""
    from types import SimpleNamespace

    job = ConfigManager().parse_args(["--job.config_file", str(DEBUG), *args])
    cp = dims.get("cp", 1)
    par = SimpleNamespace(pp=2, tp=1, cp=cp, pp_enabled=True, cp_enabled=cp > 1)
    with pytest.raises(ValueError) as err:
        validate_before_start(job, par, llama3_args[job.model.flavor])
    assert message in str(err.value)


def teardown_module() -> None:
    if _CPU is not None:
        _CPU.uninstall()


def test_cpu_patches_are_undone_and_redone() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    before = object()  # what a scope finds is what it leaves
    saved, dist_utils.set_pg_timeouts = dist_utils.set_pg_timeouts, before
    try:
        with applied(patches.CPU):
            assert dist_utils.set_pg_timeouts is cpu.set_pg_timeouts
            assert issubclass(metrics.DeviceMemoryMonitor, cpu.CPUMemoryMonitor)
        assert dist_utils.set_pg_timeouts is before
    finally:
        dist_utils.set_pg_timeouts = saved
    patched = (metrics.DeviceMemoryMonitor, dist_utils.set_pg_timeouts)
    installed = patches.install_cpu()
    assert installed is not None  # no CUDA here
    installed.uninstall()
    installed.uninstall()  # twice is harmless
    assert (metrics.DeviceMemoryMonitor, dist_utils.set_pg_timeouts) == patched
    assert issubclass(metrics.DeviceMemoryMonitor, cpu.CPUMemoryMonitor)  # module-level one
    assert metrics.DeviceMemoryMonitor().get_peak_stats().max_active_gib > 0  # VmHWM, in GiB


def test_cpu_peak_flops_is_measured() -> None:
    import torchtitan.tools.utils as utils

    assert utils.get_peak_flops is cpu.measured_peak_flops
    import torch

    rng = torch.get_rng_state()
    assert 1e8 < cpu.measured_peak_flops("cpu", size=128, seconds=0.05) < 1e14
    assert torch.equal(rng, torch.get_rng_state())  # the model's seeded init is untouched


@pytest.mark.parametrize(
    "argv",
    [
        "--model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80",
        # (70B with full AC: its shipped TOML parses and validates above; the search is minutes)
        "--model llama3-8b --seq-len 8192 --gpus 4 --gpu-memory-gb 80 --pp 1",
    ],
)
def test_planner_toml_reproduces_the_plan(argv: str, tmp_path: Path) -> None:
    """The planner's TOML goes through torchtitan's real loader and our start-up checks, and
    carries every degree and knob of the recommended setting."""
    from seq1f1b.planning.planner import build_parser, problem_from_args
    from torchtitan_integration.planner import TRAINERS
    from torchtitan_integration.planner import main as plan_main

    out = tmp_path / "plan.toml"
    assert plan_main([*argv.split(), "--output", str(out)]) == 0
    args = build_parser(trainers=TRAINERS).parse_args(argv.split())
    _, plan = problem_from_args(args, TRAINERS)
    best = plan.best
    assert best is not None
    s = best.setting
    job = ConfigManager().parse_args(["--job.config_file", str(out)])
    par = job.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (s.pp, s.tp)
    assert par.data_parallel_shard_degree == s.fsdp
    assert job.training.seq_len == plan.seq_len
    assert job.training.global_batch_size == plan.global_batch
    assert job.activation_checkpoint.mode == ("full" if s.recompute else "none")
    args = llama3_args[job.model.flavor]
    assert model_shape(args) == plan.shape  # the preset is torchtitan's flavor, width for width
    if s.pp > 1:
        check_schedule_name(par.pipeline_parallel_schedule)
        assert job.training.local_batch_size // par.pipeline_parallel_microbatch_size == (
            s.microbatches
        )
        lengths = check_config(job, s.pp, args.n_layers, s.tp, model_shape(args))
        assert lengths == best.segment_lengths or s.seq_chunks == 1
        assert job.seq1f1b.seq_chunks == s.seq_chunks or s.seq_chunks == 1
    else:  # no pipeline: one sequence at a time, gradient accumulation to the global batch
        assert job.training.local_batch_size == 1


def test_selective_ac_save_list_gains_the_chunk_aware_attention() -> None:
    """Patch 8: for a ``parallelize_fn`` call, torchtitan 0.2.2's op-level save list holds
    :func:`seq1f1b.checkpoint_save_ops` as well as its own ops; restored afterwards."""
    import seq1f1b
    from torchtitan_integration.v022 import _titan

    before = set(_titan.SAC_SAVE_LIST.get())
    assert not seq1f1b.checkpoint_save_ops() <= before
    with applied(patches.SAC_SAVES_ATTENTION):
        assert _titan.SAC_SAVE_LIST.get() == before | seq1f1b.checkpoint_save_ops()
    assert _titan.SAC_SAVE_LIST.get() == before


def test_help_lists_the_seq1f1b_keys_and_torchtitans_options() -> None:
    """``--help`` on 0.2.2's TOML entry: the [seq1f1b] keys, then torchtitan's own options
    (its tyro help), rc 0, in one process (no torchrun)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torchtitan_integration.train", "--job.config_file",
           str(root / "train_configs" / "llama3_debug_seq1f1b.toml"), "--help"]  # fmt: skip
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--seq1f1b.seq_chunks" in out.stdout and "--seq1f1b.dry_run" in out.stdout
    assert "--checkpoint.enable" in out.stdout and "--training.seq-len" in out.stdout.replace(
        "_", "-"
    )
