"""torchtitan + Seq1F1B end to end on CPU/gloo, against unpipelined runs, on whichever
torchtitan the venv holds (0.2.2 or 0.3.0: the same TOML and overrides drive both).

All runs start from one seed checkpoint, so a pipelined run must print the same loss and
grad_norm at steps 1-5 as the unpipelined one (fp32, relative 1e-4) — which also shows that
torchtitan's own PP gradient scaling by the global token count (its issue 2972) is gone.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from titan_utils import (
    assert_same_curve,
    needs_sharding,
    only_titan,
    run_titan,
    seed_checkpoint,
    titan_available,
)

from torchtitan_integration.versions import titan_generation

titan_available()
pytestmark = pytest.mark.titan_grid

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
#: a run whose glue another run also covers on torchtitan 0.2.2: CI runs it on 0.3 only
CURRENT = pytest.mark.titan_current_only
NO_PP = ["--parallelism.pipeline_parallel_degree", "1"]


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return seed_checkpoint("--parallelism.data_parallel_shard_degree", "1",
                           dump=tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="module")
def reference(seed: list[str], tmp_path_factory: pytest.TempPathFactory):
    return run_titan(1, *NO_PP, *seed, dump=tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def reference_dp2(seed: list[str], tmp_path_factory: pytest.TempPathFactory):
    return run_titan(2, *NO_PP, *seed, dump=tmp_path_factory.mktemp("ref_dp2"))


def test_pp2_seq1f1b_matches_unpipelined_and_logs_tensorboard(seed, reference, tmp_path):
    run = run_titan(2, *PP2, *seed, "--seq1f1b.verify", dump=tmp_path)
    assert "Seq1F1B: pp=2 stages/rank=1 M=2 K=4" in run.output
    # the start-up self-check ran on every rank; the short-segment warning once per rank
    assert run.output.count("[seq1f1b] verify: Seq1F1B verify: OK") == 2, run.output[-3000:]
    assert run.output.count("segments as short as") == 2, run.output[-3000:]
    if titan_generation() == "0.3":  # the precision that trains, said once per rank
        assert run.output.count("Seq1F1B: precision: parameters and compute in float32") == 2
        peaks = dict(re.findall(r"stage (\d): K/V cache of earlier segments peaked at "
                                r"([\d.]+) MiB", run.output))  # fmt: skip
        assert sorted(peaks) == ["0", "1"] and all(float(p) > 0 for p in peaks.values()), peaks
        # the first step checked each stage's outputs against the whole sequence (fp32: 1e-3)
        checked = re.findall(r"stage (\d): first-step check passed.*error ([\d.e+-]+), "
                             r"torch.float32", run.output)  # fmt: skip
        assert sorted(s for s, _ in checked) == ["0", "1"], run.output[-3000:]
        assert all(float(e) <= 1e-5 for _, e in checked), checked
    assert_same_curve(run, reference)
    if titan_generation() == "0.3":  # packed documents: the compute split follows each batch
        splits = re.findall(r"segment lengths(?: per sample)? (\[[\[\]\d, ]+\]) "
                            r"\(seq_split=compute, by document\)", run.output)  # fmt: skip
        assert len(set(splits)) > 1, splits  # changed between steps (logged when it does)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    # one directory per run (tb/<start time to the second>-<pid>/...), shared by no other run
    assert len({p.relative_to(tmp_path / "tb").parts[0] for p in events}) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("loss_metrics/global_avg_loss")}
    assert logged == pytest.approx(run.losses, rel=1e-5)
    memory = [e.value for e in acc.Scalars("memory/max_reserved(GiB)")]
    assert min(memory) > 0.05, "CPU memory metric should be a real measurement"


def test_interleaved_with_selective_ac(seed, reference, tmp_path):
    """InterleavedSeq1F1B (two stages a rank, uniform split) with torchtitan's selective
    activation checkpointing: both in one run. (Full AC runs under the zero-bubble schedules.)"""
    run = run_titan(2, *PP2, *seed, "--parallelism.pipeline_parallel_schedule",
                    "InterleavedSeq1F1B", "--seq1f1b.seq_split", "uniform",
                    "--activation_checkpoint.mode", "selective", dump=tmp_path)  # fmt: skip
    assert "stages/rank=2" in run.output
    assert_same_curve(run, reference)


@pytest.mark.parametrize("mode", [pytest.param("full", marks=CURRENT), "selective"])
def test_compiled_blocks_match_unpipelined(seed, reference, tmp_path, mode):
    """``--compile.enable`` (each block compiled, ``fullgraph=True``) under Seq1F1B with full
    or op-level selective AC (whose save list then holds the chunk-aware attention: patch 8)
    equals the unpipelined eager run (0.3 compares with compiled PP=1: test_titan03.py)."""
    if titan_generation() == "0.3":
        pytest.skip("0.3: test_titan03.py::test_compiled_blocks_match_compiled_unpipelined")
    op = ["--activation_checkpoint.selective_ac_option", "op"] if mode == "selective" else []
    run = run_titan(2, *PP2, *seed, "--compile.enable", "--activation_checkpoint.mode", mode,
                    *op, dump=tmp_path, timeout=600)  # fmt: skip
    assert_same_curve(run, reference)


@needs_sharding
def test_pp2_x_tp2(seed, reference, tmp_path):
    """PP=2 x TP=2 with ``[seq1f1b] loss_chunks = 4``: the output head and the loss per segment
    in chunks of 64 tokens (0.2.2: the last stage skips its head, seq1f1b.ChunkedLoss runs it on
    the sequence-parallel hidden states; 0.3: the ChunkedLossWrapper's num_chunks), equal to
    the unpipelined run. (The debug TOML's loss_chunks = 8 runs under the rest of the grid.)"""
    run = run_titan(4, *PP2, *seed, "--seq1f1b.loss_chunks", "4",
                    "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1", dump=tmp_path)  # fmt: skip
    assert "in chunks of 64 tokens (ChunkedLoss)" in run.output
    assert_same_curve(run, reference)


@needs_sharding
def test_pp2_x_fsdp2_on_gloo(seed, reference_dp2, tmp_path):
    # FSDP's reduce-scatter must not use PREMUL_SUM (gloo lacks it) and grads must not change
    run = run_titan(4, *PP2, *seed, "--parallelism.data_parallel_shard_degree", "2", dump=tmp_path)
    assert_same_curve(run, reference_dp2)


@CURRENT  # DDP-style replication on 0.2.2: BitPipe's fsdp2 twin reduction and FSDP
@needs_sharding
def test_pp2_x_dp_replicate2(seed, reference_dp2, tmp_path):
    run = run_titan(
        4,
        *PP2,
        *seed,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        dump=tmp_path,
    )
    assert_same_curve(run, reference_dp2)


@CURRENT  # torchtitan's own CheckpointManager resumes; the seed load runs in every 0.2.2 test
def test_checkpoint_resume_reproduces_loss_curve(seed, tmp_path):
    common = [*PP2, "--checkpoint.enable", "--checkpoint.no_last_save_model_only",
              "--checkpoint.interval", "3", "--training.steps", "6"]  # fmt: skip
    run_dir = tmp_path / "run"
    full = run_titan(2, *common, *seed[:3], dump=run_dir)
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6]
    # as if the job had died after its step-3 checkpoint: drop everything saved later ...
    ckpt = run_dir / "checkpoint"
    assert (ckpt / "step-3").is_dir()
    shutil.rmtree(ckpt / "step-6")
    # ... and restarted: it resumes from its own checkpoint folder at step 4
    resumed = run_titan(2, *common, dump=run_dir)
    assert sorted(resumed.losses) == [4, 5, 6], resumed.output[-2000:]
    for s in (4, 5, 6):
        assert resumed.losses[s] == pytest.approx(full.losses[s], rel=1e-5)
        assert resumed.grad_norms[s] == pytest.approx(full.grad_norms[s], rel=1e-4)


def test_bad_config_fails_at_startup(tmp_path: Path) -> None:
    # end to end through torchrun; the other refusals are checked in-process in
    # tests/test_titan_config.py::test_bad_settings_are_refused_naming_the_key
    run = run_titan(2, *PP2, "--seq1f1b.seq_chunks", "0", dump=tmp_path, check=False, timeout=120)
    message = "[seq1f1b] seq_chunks = 0 must be >= 1"
    assert message in run.output, run.output[-3000:]
    assert not run.losses
    # refused before torchtitan created anything for the run: no empty TensorBoard run
    assert not (tmp_path / "tb").exists(), sorted(p.name for p in tmp_path.rglob("*"))


BITPIPE = ["--parallelism.pipeline_parallel_schedule", "BitPipe",
           "--parallelism.pipeline_parallel_microbatch_size", "1"]  # fmt: skip


DP1 = ["--parallelism.data_parallel_shard_degree", "1"]


@pytest.mark.parametrize(
    ("dims", "dp2"),
    [
        # FSDP reduce-scatters each chunk over dp in REDUCE_GRAD, then the twins sum their shards
        pytest.param(["--parallelism.data_parallel_shard_degree", "2"], True, id="fsdp2"),
        # TP: the twins sum their TP shards; loss-parallel losses are DTensors
        pytest.param(
            ["--parallelism.tensor_parallel_degree", "2", *DP1], False, marks=CURRENT, id="tp2"
        ),
        # FSDP2 replicate: all-reduce over dp in REDUCE_GRAD, then the twins sum
        pytest.param(
            ["--parallelism.data_parallel_replicate_degree", "2", *DP1],
            True,
            marks=CURRENT,
            id="dp_replicate2",
        ),
    ],
)
@needs_sharding
def test_bitpipe_composes(seed, reference, reference_dp2, tmp_path, dims, dp2):
    run = run_titan(4, *PP2, *seed, *BITPIPE, *dims, dump=tmp_path)
    assert_same_curve(run, reference_dp2 if dp2 else reference)


# attn_mask_type = "block_causal", on documents of tens of tokens (blank-line blocks of code)
FLEX = ["--model.flavor", "debugmodel_flex_attn", "--training.dataset", "pycode_blocks"]


@only_titan("0.2", "block_causal flavors (0.3 always packs documents: every 0.3 test has them)")
def test_block_causal_documents_pp2_match_unpipelined(seed, tmp_path):
    """torchtitan's packed-document flavor: PP=2 Seq1F1B equals PP=1 with the same document
    mask (both through chunk-aware attention, which equals a dense-mask reference in
    tests/test_masks.py), and the mask is active: the curve differs from plain causal."""
    ref = run_titan(1, *NO_PP, *FLEX, *seed, dump=tmp_path / "pp1")
    run = run_titan(2, *PP2, *FLEX, *seed, dump=tmp_path / "pp2")
    assert_same_curve(run, ref)
    # the same data under plain causal attention differs at every step by more than the
    # curve tolerance: a pipeline that dropped the mask could not have matched
    causal = run_titan(1, *NO_PP, *FLEX[2:], *seed, dump=tmp_path / "causal")
    gaps = {s: abs(ref.losses[s] - causal.losses[s]) / causal.losses[s] for s in ref.losses}
    assert min(gaps.values()) > 1e-4, gaps
    # (torch's own schedules cannot carry the documents to their stages: refused at start-up,
    # tests/test_titan_config.py::test_bad_settings_are_refused_naming_the_key)


ZBV_ON_0_2 = pytest.param(
    "ZBVSeq1F1B",
    marks=pytest.mark.skipif(
        titan_generation() != "0.2",
        reason="on 0.3: tests/test_titan03.py's ZBVSeq1F1B run (training and validation)",
    ),
)


@pytest.mark.parametrize("schedule", [pytest.param("ZBSeq1F1B", marks=CURRENT), ZBV_ON_0_2])
def test_zero_bubble_seq1f1b_from_toml(seed, reference, tmp_path, schedule):
    """pipeline_parallel_schedule = "ZBSeq1F1B" (split backward) or "ZBVSeq1F1B" (V placement:
    4 stages on 2 ranks, rank 0 holding the first and the last) with full activation
    checkpointing, through the registry, equals the unpipelined run. Checkpointed blocks run
    each backward whole (split, torch's weight half would recompute a block once for each
    group of weights it differentiates apart)."""
    run = run_titan(
        2, *PP2, *seed, "--parallelism.pipeline_parallel_schedule", schedule,
        "--activation_checkpoint.mode", "full", dump=tmp_path,
    )  # fmt: skip
    if schedule == "ZBVSeq1F1B":
        assert "Seq1F1B: pp=2 stages/rank=2" in run.output, run.output[-2000:]
    assert "stages hold checkpointed modules, so each backward runs whole" in run.output
    assert_same_curve(run, reference)


@needs_sharding
def test_pp2_x_cp2_matches_unpipelined(seed, reference, tmp_path):
    """context_parallel_degree = 2 with Seq1F1B on 4 processes (PP 2 x CP 2, FSDP over the
    CP ranks): the schedule's ring attention, from one seed checkpoint, equals PP=1, CP=1."""
    run = run_titan(4, *PP2, *seed, "--parallelism.context_parallel_degree", "2", dump=tmp_path)
    assert "Seq1F1B: pp=2 stages/rank=1 M=2 K=4 cp=2 segments" in run.output
    assert_same_curve(run, reference)
