"""The decoder families other than Llama3 that the integration trains on torchtitan 0.3
(``torchtitan_integration/v03/models``), end to end on CPU/gloo: PP=2 under the Seq1F1B
schedules equals PP=1 from one seed checkpoint (fp32: losses and grad norms, steps 1-4; the
mixtures of experts 1-3), with the mix users run (tensor parallelism, zero-bubble V placement,
compiled blocks with full activation checkpointing, the chunked loss of the shipped TOML, the
start-up self-check).
Qwen3 dense and MoE share the attention: the plain Seq1F1B run is the MoE one. Llama3's grid:
tests/test_titan.py and tests/test_titan03.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from titan_utils import (
    assert_same_curve,
    needs_sharding,
    run_titan,
    seed_checkpoint,
    titan_available,
)

titan_available("0.3")
pytestmark = pytest.mark.titan_grid

NO_PP = ["--parallelism.pipeline_parallel_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
STEPS = 4
#: the mixtures of experts: three steps, the expert bias updated twice before a step routes
MOE_STEPS = 3
# Qwen3's debug flavor (8 layers, 16 query heads of 128, q/k norms) at 128 tokens: its blocks
# are 4x Llama3's debug blocks, so the runs keep to what tells (4 steps, K = 4 segments)
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.seq_len", "128",
         "--training.steps", str(STEPS)]  # fmt: skip
# Qwen3 MoE at a CPU's size (debugmodel_moe_cpu: torchtitan's debugmodel_moe with 8 routed
# experts of width 256, top 2; torchtitan's 64 of 768, top 8 take 30 s a step here)
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_cpu",
             "--training.seq_len", "128", "--training.steps", str(MOE_STEPS)]  # fmt: skip
# GPT-OSS at a CPU's size (debugmodel_cpu: 4 layers, 64 heads of 64, a learned sink per
# head, 128-key windows on layers 0 and 2; 8 experts narrowed to 256, top 2), at 256 tokens so
# that the windows cut through the K = 4 segments
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel_cpu",
           "--training.steps", str(MOE_STEPS)]  # fmt: skip
# DeepSeek-V3's debug flavor: MLA (q/k head dim 192, v 128, K/V from a 512-wide latent), a
# dense first layer, then MoE layers of 8 experts (top 3, 2 shared)
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
            "--training.seq_len", "128", "--training.steps", str(MOE_STEPS)]  # fmt: skip


#: torchtitan's routed experts cast their GEMM operands to bf16 in any run, so an fp32
#: difference of one ulp can round to a bf16 ulp: over steps, Adam turns the experts' bf16
#: gradient noise into parameter differences, and the grad norm of step 2 on differs by up to
#: 0.5% (the losses keep 1e-4; Seq1F1B with and without AC agree to every printed digit, and
#: the start-up self-check, with the experts in fp32, bounds every gradient at 1e-4)
MOE_GRAD_TOL = 1e-2


def _seed(model: list[str], dump, save_at: int = 1000) -> list[str]:
    """A seed checkpoint of ``model`` (saving its state at step ``save_at``)."""
    return seed_checkpoint(*model, dump=dump, save_at=save_at)


def _expert_biases(dump: Path, step: int) -> dict[str, torch.Tensor]:
    """Every MoE layer's expert bias in the checkpoint a run saved at ``step``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", dump / "state.pt")
    state = torch.load(dump / "state.pt", weights_only=False)
    return {k: v for k, v in state.items() if k.endswith("expert_bias_E")}


@pytest.fixture(scope="module")
def qwen3_seed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _seed(QWEN3, tmp_path_factory.mktemp("qwen3_seed"))


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_seed, tmp_path_factory: pytest.TempPathFactory):
    return run_titan(1, *NO_PP, *QWEN3, *qwen3_seed, dump=tmp_path_factory.mktemp("qwen3_ref"))


@needs_sharding
def test_qwen3_zbv_x_tp2_matches_unpipelined(qwen3_seed, qwen3_reference, tmp_path) -> None:
    """ZBVSeq1F1B (two stages a rank, split backward) x TP=2 (Qwen3's sharding: q/k norms on
    sharded heads, loss parallel), with the head and loss in 8 chunks a sample."""
    run = run_titan(4, *PP2, *QWEN3, *qwen3_seed,
                    "--parallelism.pipeline_parallel_schedule", "ZBVSeq1F1B",
                    "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "1", dump=tmp_path)  # fmt: skip
    assert "Seq1F1B: pp=2 stages/rank=2" in run.output, run.output[-3000:]
    assert_same_curve(run, qwen3_reference, steps=STEPS)


@pytest.mark.grid_script  # the grid's rows: Qwen3 compiled, compiled interleaved, compiled full AC
def test_qwen3_compiled_interleaved_matches_unpipelined(qwen3_seed, qwen3_reference, tmp_path):
    """InterleavedSeq1F1B with each Qwen3 block compiled (``fullgraph=True``) and fully
    checkpointed, against the eager PP=1 run (compiling changes no number at fp32's 1e-4)."""
    run = run_titan(2, *PP2, *QWEN3, *qwen3_seed,
                    "--parallelism.pipeline_parallel_schedule", "InterleavedSeq1F1B",
                    "--compile.enable", "--activation_checkpoint.mode", "full",
                    dump=tmp_path, timeout=600)  # fmt: skip
    assert "stages/rank=2" in run.output
    assert_same_curve(run, qwen3_reference, steps=STEPS)


#: expert parallelism over the two data-parallel ranks; on gloo through torchtitan's
#: partial-DTensor backend (its default's list all_to_all needs equal sizes on gloo)
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree",
       "2", "--parallelism.spmd_backend", "partial_dtensor"]  # fmt: skip


def test_qwen3_moe_checkpointed_x_ep2_matches_unpipelined(tmp_path) -> None:
    """Qwen3 MoE under Seq1F1B x expert parallelism (EP = 2 over FSDP = 2) with full activation
    checkpointing (every segment's forward runs twice, and counts its tokens twice: torchtitan
    halves the counts of a recomputed block) against PP=1 x EP = 2 without: equal curves, and
    equal expert biases after the last step, each updated before every optimizer step by the
    sign of each expert's token count against the mean (8 layers x 8 experts x 3 steps). The
    start-up self-check runs the MoE debug model and compares the token counts per expert."""
    seed = _seed(QWEN3_MOE, tmp_path / "seed", save_at=MOE_STEPS)
    ref = run_titan(2, *NO_PP, *QWEN3_MOE, *seed, *EP2, dump=tmp_path / "pp1")
    run = run_titan(4, *PP2, *QWEN3_MOE, *seed, *EP2, "--activation_checkpoint.mode", "full",
                    "--seq1f1b.verify", dump=tmp_path / "pp2")  # fmt: skip
    assert run.output.count("[seq1f1b] verify: Seq1F1B verify: OK") == 4, run.output[-3000:]
    assert "debugmodel_moe resized: 8 MoE layers: 8 routed experts of width 256" in run.output
    assert_same_curve(run, ref, steps=MOE_STEPS, grad_tol=MOE_GRAD_TOL)
    want = _expert_biases(tmp_path / "pp1", MOE_STEPS)
    got = _expert_biases(tmp_path / "pp2", MOE_STEPS)
    assert len(want) == 8 and want.keys() == got.keys(), (want.keys(), got.keys())
    assert any(b.abs().sum() > 0 for b in want.values())
    for key, bias in want.items():
        assert torch.equal(got[key], bias), (key, got[key], bias)


@pytest.fixture(scope="module")
def deepseek_seed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _seed(DEEPSEEK, tmp_path_factory.mktemp("deepseek_seed"))


@pytest.fixture(scope="module")
def deepseek_reference(deepseek_seed, tmp_path_factory: pytest.TempPathFactory):
    return run_titan(1, *NO_PP, *DEEPSEEK, *deepseek_seed,
                     dump=tmp_path_factory.mktemp("deepseek_ref"))  # fmt: skip


def test_deepseek_v3_mla_moe_matches_unpipelined(deepseek_seed, deepseek_reference, tmp_path):
    """DeepSeek-V3 under Seq1F1B: MLA's value head dim (128) differs from its query/key head
    dim (192) in every segment's tiles against the cached K/V, and its MoE layers route each
    segment's tokens, the expert bias updated after every step from the tokens counted (steps
    2-4 route by it). The start-up self-check runs DeepSeek-V3's debug model (its token counts
    per expert compared too). Then the latent K/V cache (``kv_cache = "latent"``: earlier
    segments kept as MLA's 512 + 64 wide latent, re-expanded by each later segment) under
    ZBVSeq1F1B's split backward: the gradients that later segments send back through the
    re-expansion reach the latent, ``wkv_b`` and ``wkv_a`` (with checkpointing:
    tests/test_attention.py's latent tests)."""
    seed, ref = deepseek_seed, deepseek_reference
    run = run_titan(2, *PP2, *DEEPSEEK, *seed, "--seq1f1b.verify", dump=tmp_path / "pp2")
    assert run.output.count("[seq1f1b] verify: Seq1F1B verify: OK") == 2, run.output[-3000:]
    assert_same_curve(run, ref, steps=MOE_STEPS, grad_tol=MOE_GRAD_TOL)
    latent = run_titan(2, *PP2, *DEEPSEEK, *seed, "--seq1f1b.verify", "--seq1f1b.kv_cache",
                       "latent", "--parallelism.pipeline_parallel_schedule", "ZBVSeq1F1B",
                       dump=tmp_path / "latent")  # fmt: skip
    assert "Seq1F1B: deepseek_v3: latent K/V cache on" in latent.output, latent.output[-3000:]
    assert latent.output.count("[seq1f1b] verify: Seq1F1B verify: OK") == 2, latent.output[-3000:]
    assert_same_curve(latent, ref, steps=MOE_STEPS, grad_tol=MOE_GRAD_TOL)


#: the latent cache's PP 2 runs against the one PP=1 run: under TP 2, and under CP 2 (FSDP
#: over the CP ranks)
LATENT_RUNS = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1"],
    "cp2": ["--parallelism.context_parallel_degree", "2"],
}  # fmt: skip


@needs_sharding
@pytest.mark.parametrize("variant", ["tp2", "cp2"])
def test_deepseek_v3_latent_cache_x_tp2_or_cp2_matches_unpipelined(
    deepseek_seed, deepseek_reference, tmp_path, variant: str
) -> None:
    """The latent K/V cache under tensor parallelism (PP 2 x TP 2): MLA's latent and RoPE key
    come out of the replicated ``wkv_a`` and ``kv_norm``, so every TP rank caches the same
    576-wide latent and each later segment expands its own heads with its column shard of
    ``wkv_b``; the latent's gradient, summed over the TP ranks by ``wkv_a``'s replicated
    backward, reaches both shards' weights. Under context parallelism (PP 2 x CP 2) each CP
    rank caches the latent of its own shard of positions (RoPE'd at their absolute
    positions) and expands it for the ring's tiles."""
    run = run_titan(4, *PP2, *DEEPSEEK, *deepseek_seed, "--seq1f1b.kv_cache", "latent",
                    *LATENT_RUNS[variant], dump=tmp_path / f"latent_{variant}")  # fmt: skip
    assert "Seq1F1B: deepseek_v3: latent K/V cache on" in run.output, run.output[-3000:]
    assert_same_curve(run, deepseek_reference, steps=MOE_STEPS, grad_tol=MOE_GRAD_TOL)


@pytest.fixture(scope="module")
def gpt_oss_seed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _seed(GPT_OSS, tmp_path_factory.mktemp("gpt_oss_seed"))


@pytest.fixture(scope="module")
def gpt_oss_reference(gpt_oss_seed, tmp_path_factory: pytest.TempPathFactory):
    return run_titan(1, *NO_PP, *GPT_OSS, *gpt_oss_seed,
                     dump=tmp_path_factory.mktemp("gpt_oss_ref"))  # fmt: skip


#: GPT-OSS's PP=2 runs against the one PP=1 run: processes, arguments, the header they print
# fmt: off
GPT_OSS_RUNS = {
    "zbv": (2, ["--parallelism.pipeline_parallel_schedule", "ZBVSeq1F1B", "--seq1f1b.verify"],
            "Seq1F1B: pp=2 stages/rank=2 M=2 K=4"),
    "cp2": (4, ["--parallelism.context_parallel_degree", "2"],
            "Seq1F1B: pp=2 stages/rank=1 M=2 K=4 cp=2 segments"),
}
# fmt: on


@pytest.mark.parametrize("variant", ["zbv", pytest.param("cp2", marks=needs_sharding)])
def test_gpt_oss_sinks_and_windows_match_unpipelined(
    gpt_oss_seed, gpt_oss_reference, tmp_path, variant: str
) -> None:
    """GPT-OSS under ZBVSeq1F1B (two stages a rank, split backward), and under Seq1F1B x
    context parallelism (PP 2 x CP 2, FSDP over the CP ranks: the ring attention): each
    head's learned sink rescales the softmax merged over every segment's keys, and under CP
    over the ring's too (its gradient, and the LSE's, taken exactly), the windowed layers see
    128 keys back across segment boundaries (and CP shards), the experts route each segment's
    tokens; under ZBV the start-up self-check runs GPT-OSS's debug model too (left out under CP:
    it checks the model, not the ring, and the 4-process run is the longer one)."""
    nproc, extra, header = GPT_OSS_RUNS[variant]
    run = run_titan(nproc, *PP2, *GPT_OSS, *gpt_oss_seed, *extra, dump=tmp_path / variant)
    assert header in run.output, run.output[-3000:]
    verified = run.output.count("[seq1f1b] verify: Seq1F1B verify: OK")
    assert verified == (nproc if "--seq1f1b.verify" in extra else 0), run.output[-3000:]
    # under CP the losses drift 1.1e-4 (relative) from PP = 1 by step 3: 8.40995 against
    # 8.41091, measured on 2026-12-04 here and in a fresh clone, the same at d41d473, whose CI
    # passed at 1e-4 the day before (so the environment's packages moved it, not the code).
    # The experts route each token by its top scores, and the ring's summation order moves
    # the near-ties; a sink or ring error moves the loss by 1e-2 or more. Grad norms: 1e-2
    tol = 1e-3 if variant == "cp2" else 1e-4
    assert_same_curve(run, gpt_oss_reference, steps=MOE_STEPS, tol=tol, grad_tol=MOE_GRAD_TOL)


# Qwen3.5 at a CPU's size (debugmodel_cpu: torchtitan's debugmodel, 8 layers, Gated DeltaNet
# on layers 0-2 and 4-6 and gated full attention on 3 and 7, with the shipped tokenizer's
# vocabulary), at 128 tokens: K = 4 segments of 32, each Gated DeltaNet layer carrying its
# convolution tails and delta-rule state from segment to segment
QWEN3_5 = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_cpu",
           "--training.seq_len", "128", "--training.steps", str(MOE_STEPS)]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_5_seed(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _seed(QWEN3_5, tmp_path_factory.mktemp("qwen3_5_seed"))


@pytest.fixture(scope="module")
def qwen3_5_reference(qwen3_5_seed, tmp_path_factory: pytest.TempPathFactory):
    return run_titan(1, *NO_PP, *QWEN3_5, *qwen3_5_seed,
                     dump=tmp_path_factory.mktemp("qwen3_5_ref"))  # fmt: skip


def test_qwen3_5_recurrent_state_matches_unpipelined(
    qwen3_5_seed, qwen3_5_reference, tmp_path
) -> None:
    """Qwen3.5's hybrid stack under Seq1F1B (with the start-up self-check), InterleavedSeq1F1B
    with compiled blocks and full activation checkpointing (stage 0 holds only Gated DeltaNet
    layers: the mixing probe sees their declared state; the compiled op pair carries it) and
    ZBVSeq1F1B (split backward: the state's gradient in the input half) equals PP=1 from one
    seed checkpoint."""
    for name, extra in (
        ("Seq1F1B", ["--seq1f1b.verify"]),
        ("InterleavedSeq1F1B", ["--activation_checkpoint.mode", "full", "--compile.enable"]),
        ("ZBVSeq1F1B", []),
    ):
        run = run_titan(2, *PP2, *QWEN3_5, *qwen3_5_seed, *extra,
                        "--parallelism.pipeline_parallel_schedule", name,
                        dump=tmp_path / name)  # fmt: skip
        assert "first-step check passed" in run.output, run.output[-3000:]
        if extra == ["--seq1f1b.verify"]:
            assert run.output.count("[seq1f1b] verify: Seq1F1B verify: OK") == 2, run.output
        assert_same_curve(run, qwen3_5_reference, steps=MOE_STEPS)


@needs_sharding
def test_qwen3_5_context_parallel_matches_unpipelined(
    qwen3_5_seed, qwen3_5_reference, tmp_path
) -> None:
    """Qwen3.5 under Seq1F1B x context parallelism (PP 2 x CP 2, FSDP over the CP ranks): each
    Gated DeltaNet layer's convolution tails and delta-rule state pass from CP rank to CP rank
    within each of the K = 4 segments (two chunks of 8 tokens a rank, head-tail) and from
    segment to segment, the full-attention layers take the ring; equal to PP=1 without CP."""
    run = run_titan(4, *PP2, *QWEN3_5, *qwen3_5_seed,
                    "--parallelism.context_parallel_degree", "2", dump=tmp_path)  # fmt: skip
    assert "Seq1F1B: pp=2 stages/rank=1 M=2 K=4 cp=2 segments" in run.output, run.output[-3000:]
    assert_same_curve(run, qwen3_5_reference, steps=MOE_STEPS)


@pytest.mark.grid_script  # the grid's Qwen3.5 row: compiled interleaved x FSDP in bf16
def test_qwen3_5_fsdp_compiled_bf16_matches_unpipelined(tmp_path) -> None:
    """The mix users run, on Qwen3.5: PP=2 x FSDP=2 with compiled blocks in bf16 equals
    PP=1 x FSDP=2 in the same configuration (bf16: losses 1e-3, grad norms 1e-2)."""
    seed = _seed(QWEN3_5, tmp_path / "seed")
    mix = ["--parallelism.data_parallel_shard_degree", "2", "--compile.enable",
           "--training.mixed_precision_param", "bfloat16"]  # fmt: skip
    ref = run_titan(2, *NO_PP, *QWEN3_5, *seed, *mix, dump=tmp_path / "pp1")
    run = run_titan(4, *PP2, *QWEN3_5, *seed, *mix, dump=tmp_path / "pp2")
    assert "first-step check passed" in run.output, run.output[-3000:]
    assert_same_curve(run, ref, steps=MOE_STEPS, tol=1e-3, grad_tol=1e-2)
