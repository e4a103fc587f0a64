"""torchtitan 0.3: the 0.2.2-style TOML and overrides mapped onto 0.3's config, in process.

The shipped TOML files (the real-size ones cannot run here) and the planner's output must map
onto ``Seq1F1BTrainer.Config`` and pass the start-up checks; a key 0.3 has no place for is an
error that names it. Importing torchtitan 0.3 fixes nothing here: the trainer patches the
device only while it runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from titan_utils import titan_available

titan_available("0.3")

from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: E402

from torchtitan_integration.v03.models import decoder_shape as model_shape  # noqa: E402
from torchtitan_integration.v03.toml import (  # noqa: E402
    TomlKeyError,
    build_config,
    parse_overrides,
)
from torchtitan_integration.v03.trainer import Seq1F1BTrainer  # noqa: E402
from torchtitan_integration.v03.validate import validate_before_start  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))
DEBUG = ROOT / "train_configs" / "llama3_debug_seq1f1b.toml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_toml_maps_and_validates(path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import tomllib

    raw = tomllib.loads(path.read_text())
    config = build_config(path)
    assert isinstance(config, Seq1F1BTrainer.Config)
    par, want = config.parallelism, raw["parallelism"]
    for key, value in want.items():
        assert getattr(par, key) == value, key
    assert config.training.seq_len == raw["training"]["seq_len"]
    assert config.dataloader.dataset == raw["training"]["dataset"]
    assert config.seq1f1b.seq_chunks == raw["seq1f1b"]["seq_chunks"]
    assert config.model_spec.flavor == raw["model"]["flavor"]
    assert config.hf_assets_path == raw["model"]["hf_assets_path"]
    lr = config.optimizer.param_groups[0].optimizer_kwargs["lr"]
    assert lr == pytest.approx(raw["optimizer"]["lr"])
    mode = raw.get("activation_checkpoint", {}).get("mode", "selective")
    ac = config.activation_checkpoint
    assert (ac is None) == (mode == "none") and isinstance(ac, FullAC.Config) == (mode == "full")
    with caplog.at_level(logging.WARNING, logger="torchtitan_integration"):
        validate_before_start(config)  # the split of the real model's shape, its RoPE length
    # a shipped config never warns about its own segments (the debug ones are 58-72 tokens
    # on debug-sized models, which the warning knows)
    assert "segments as short as" not in caplog.text, caplog.text


def test_overrides_on_top_of_the_toml() -> None:
    config = build_config(
        DEBUG,
        [
            "--training.steps", "7",
            "--seq1f1b.seq_split=uniform",
            "--checkpoint.enable",
            "--checkpoint.no_last_save_model_only",
            "--training.dataset", "pycode_blocks",  # 0.2.2's key, moved
            "--dataloader.dataset_path", "/data",  # 0.3's own key
            "--job.dump_folder", "./out",
            "--optimizer.lr", "1e-4",
        ],
    )  # fmt: skip
    assert config.training.steps == 7
    assert config.seq1f1b.seq_split == "uniform"
    assert config.checkpoint.enable is True
    assert config.checkpoint.last_save_model_only is False
    assert (config.dataloader.dataset, config.dataloader.dataset_path) == ("pycode_blocks", "/data")
    assert config.dump_folder == "./out"
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.tokenizer_path", "x"], "[model] tokenizer_path has no equivalent in "
         "torchtitan 0.3; instead: put tokenizer.json in hf_assets_path"),
        (["--activation_checkpoint.selective_ac_option", "2"], "no every-n-layers option"),
        (["--training.no_such_key", "1"], "[training] no_such_key has no equivalent"),
        (["--optimizer.beta1", "0.9"], "[optimizer] beta1 has no equivalent"),
        (["--activation_checkpoint.mode", "some"], "use 'none', 'selective' or 'full'"),
        (["--model.name", "kimi_k2_7"], "integration trains llama3, qwen3, deepseek_v3, gpt_oss"),
        (["--training.steps", "many"], "training.steps = 'many': expected int"),
        (["steps"], "is not of the form --section.key value"),
    ],
)  # fmt: skip
def test_keys_without_a_home_are_errors(args: list[str], message: str) -> None:
    with pytest.raises(TomlKeyError) as err:
        build_config(DEBUG, args)
    assert message in str(err.value)


def test_override_parser_matches_tyro_spelling() -> None:
    got = parse_overrides(["--a.b", "--c.no_d", "--e.f=1", "--g-h.i-j", "x"])
    assert got == {"a.b": True, "c.d": False, "e.f": "1", "g_h.i_j": "x"}


QWEN3_5 = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_cpu"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parallelism.pipeline_parallel_schedule", "BitPipe",
          "--parallelism.pipeline_parallel_degree", "3"], "BitPipe pairs rank r with rank"),
        (["--parallelism.pipeline_parallel_schedule", "BitPipe",
          "--parallelism.pipeline_parallel_microbatch_size", "4"],
         "gives 1 microbatches: BitPipe runs half of them on each replica"),
        (["--seq1f1b.seq_chunks", "0"], "[seq1f1b] seq_chunks = 0 must be >= 1"),
        (["--parallelism.pipeline_parallel_schedule", "Seq2F2B"], "is unknown: use one of"),
        (["--seq1f1b.seq_split", "100,100"], "[training] seq_len = 512 cannot be split"),
        (["--seq1f1b.split", "uniform"], "[seq1f1b] split is now [seq1f1b] seq_split"),
        (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_cpu",
          "--parallelism.expert_parallel_degree", "2"], "Set --parallelism.spmd_backend partial"),
        (["--parallelism.pipeline_parallel_degree", "1",
          "--parallelism.context_parallel_degree", "2"], "so it needs pipeline parallelism"),
        (["--parallelism.pipeline_parallel_schedule", "BitPipe",
          "--parallelism.context_parallel_degree", "2"], "does not shard them over the cp mesh"),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len",
          "32768"], "exceeds the RoPE table of deepseek_v3 debugmodel (16384 positions): set "
         "[model] max_seq_len = 32768"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_before_start(args: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_before_start(build_config(DEBUG, args))
    assert message in str(err.value)


def test_qwen3_5_shape_prices_its_hybrid_stack() -> None:
    """Qwen3.5's debug model: its full-attention layers' heads (4 of 64, 2 K/V heads) and the
    six Gated DeltaNet layers (2 key heads, 4 value heads of 64); the CPU flavor has the
    shipped tokenizer's vocabulary."""
    from torchtitan_integration.v03.models import family

    config = build_config(DEBUG, QWEN3_5)
    shape = family("qwen3_5").shape(config.model_spec.model)
    assert (shape.n_heads, shape.head_dim, shape.n_kv_heads, shape.vocab) == (4, 64, 2, 2048)
    la = shape.linear_attention
    assert (shape.n_layers, shape.softmax_layers, shape.window) == (8, 2, None)
    assert (la.layers, la.key_heads, la.value_heads, la.key_dim, la.conv_width) == (6, 2, 4, 64, 4)
    validate_before_start(config)


def test_gpt_oss_tensor_parallel_is_warned_on_every_rank(caplog) -> None:
    """torchtitan's GPT-OSS counts its experts' output bias once per TP rank under the
    spmd_types backend: said at start-up (every rank validates), and only for that family."""
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    gpt_oss = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel_cpu"]
    with caplog.at_level("WARNING", logger="torchtitan_integration.v03.validate"):
        validate_before_start(build_config(DEBUG, [*gpt_oss, *tp]))
        assert "the bias counts tensor_parallel_degree times" in caplog.text
        caplog.clear()
        validate_before_start(build_config(DEBUG, gpt_oss))
        validate_before_start(build_config(DEBUG, tp))
        assert "tensor_parallel_degree times" not in caplog.text


def test_compiled_context_parallelism_is_accepted() -> None:
    """``--compile.enable`` with context_parallel_degree = 2 under the Seq1F1B schedules: the
    ring runs inside the compiled attention's custom ops (tests/test_compile.py); and
    DeepSeek-V3's latent K/V cache on the ring (tests/test_latent_kv.py)."""
    for schedule in ("Seq1F1B", "ZBVSeq1F1B"):
        validate_before_start(build_config(DEBUG, [
            "--compile.enable", "--parallelism.context_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", schedule]))  # fmt: skip
    validate_before_start(build_config(DEBUG, [
        "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--seq1f1b.kv_cache",
        "latent", "--parallelism.context_parallel_degree", "2"]))  # fmt: skip


def test_bitpipe_settings_that_can_run_are_accepted() -> None:
    validate_before_start(build_config(DEBUG, ["--parallelism.pipeline_parallel_schedule",
                                               "BitPipe"]))  # fmt: skip


def test_model_shape_is_torchtitans_debug_model() -> None:
    shape = model_shape(build_config(DEBUG).model_spec.model)
    assert (shape.hidden, shape.n_heads, shape.n_layers, shape.vocab) == (256, 16, 6, 2048)
    assert (shape.ffn_hidden, shape.head_dim) == (768, 16)


@pytest.mark.parametrize(
    ("flavor", "ffn"),
    [("debugmodel", 3072), ("debugmodel_moe", 8 * 768), ("debugmodel_moe_cpu", 2 * 256)],
)
def test_qwen3_shape_has_its_head_dim_and_active_experts(flavor: str, ffn: int) -> None:
    """Qwen3's debug flavors through ``[model] name = "qwen3"``: head dim 128 at width 256 (not
    256 / 16), and an MoE layer priced by the FFN width a token runs (top 8 of 64 experts of
    width 768); the tied embedding is untied (torchtitan refuses tying under PP)."""
    config = build_config(DEBUG, ["--model.name", "qwen3", "--model.flavor", flavor])
    assert config.model_spec.name == "qwen3"
    assert not config.model_spec.model.enable_weight_tying
    shape = model_shape(config.model_spec.model)
    assert (shape.hidden, shape.n_heads, shape.head_dim, shape.n_kv_heads) == (256, 16, 128, 8)
    assert (shape.n_layers, shape.ffn_hidden) == (8, ffn)
    validate_before_start(config)


@pytest.mark.default_release_only  # torchtitan config glue: the torch 2.13 tier skips it
def test_cpu_sized_moe_is_torchtitans_debug_moe_resized() -> None:
    """``debugmodel_moe_cpu``: torchtitan's ``debugmodel_moe`` whose router, gate, experts and
    dispatcher agree on 8 experts of width 256, top 2, the rest unchanged; an MoE run's
    start-up self-check runs it, with torchtitan's bf16 casts off (exact at 1e-4)."""
    import torch

    from torchtitan_integration.v03.models import NoBf16Casts, family

    qwen3 = family("qwen3")
    theirs = qwen3.model_spec("debugmodel_moe").model
    spec = qwen3.model_spec("debugmodel_moe_cpu")
    assert spec.flavor == "debugmodel_moe_cpu"
    with torch.device("meta"):
        model = spec.model.build()
    moe = model.layers["0"].moe
    assert moe.routed_experts.inner_experts.w1_EFD.shape == (8, 256, 256)
    assert moe.router.gate.weight.shape == (8, 256) and moe.router.top_k == 2
    assert moe.routed_experts.token_dispatcher.num_experts == 8
    assert moe.expert_bias_E.shape == (8,)
    assert len(spec.model.layers) == len(theirs.layers) and spec.model.dim == theirs.dim
    assert qwen3.check_flavor(theirs) == "debugmodel_moe_cpu"
    assert qwen3.check_flavor(qwen3.model_spec("debugmodel").model) == "debugmodel"
    experts = qwen3.model_spec("debugmodel_moe_cpu").model.layers[0].moe.routed_experts.build()
    inner = experts.inner_experts
    for w in (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD):
        torch.nn.init.normal_(w, std=0.1)
    x, counts = torch.randn(6, 256), torch.tensor([2, 0, 1, 0, 3, 0, 0, 0])
    with NoBf16Casts():
        got = inner(x, counts)
    rows = torch.arange(8).repeat_interleave(counts)
    h = torch.einsum("rd,rfd->rf", x, inner.w1_EFD[rows])
    h = torch.nn.functional.silu(h) * torch.einsum("rd,rfd->rf", x, inner.w3_EFD[rows])
    torch.testing.assert_close(got, torch.einsum("rf,rdf->rd", h, inner.w2_EDF[rows]))
    assert (inner(x, counts) - got).abs().max() > 1e-6  # torchtitan's own: bf16 GEMMs


def test_deepseek_v3_shape_counts_mla_and_dense_then_moe_layers() -> None:
    """DeepSeek-V3's debug flavor: one head dim for the FLOPs model, the mean of q/k's 192 and
    v's 128; every head its own K/V (MLA expands them); the FFN width a token computes averaged
    over the dense first layer (1024) and the MoE layers (top 3 of width 256 plus 2 shared)."""
    from torchtitan_integration.v03.models import family

    config = build_config(DEBUG, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    shape = family("deepseek_v3").shape(config.model_spec.model)
    moe = 3 * 256 + config.model_spec.model.layers[1].moe.shared_experts.w1.out_features
    assert (shape.head_dim, shape.n_heads, shape.n_kv_heads) == (160, 16, 16)
    assert shape.ffn_hidden == round((1024 + 5 * moe) / 6)
    validate_before_start(config)


def test_unknown_model_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'flux'.* trains llama3, qwen3.*qwen3_5"):
        build_config(DEBUG, ["--model.name", "flux"])
    with pytest.raises(ValueError, match=r"flavor = 'tiny' is not a qwen3 flavor.*_moe_cpu"):
        build_config(DEBUG, ["--model.name", "qwen3", "--model.flavor", "tiny"])


@pytest.mark.parametrize(
    "argv",
    [
        "--model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80",
        # a sequence-chunked plan with several looped stages per rank (layers per stage); the
        # larger searches (pure Python, whatever the torch) on the default release only (70B
        # with full AC: train_configs/llama3_70b_seq1f1b_64k.toml maps and validates above)
        pytest.param(
            "--model llama3-8b --seq-len 65536 --gpus 8 --gpu-memory-gb 80",
            marks=pytest.mark.default_release_only,
        ),
        # torchtitan's selective (op-level) activation checkpointing
        "--model llama3-8b --seq-len 8192 --gpus 8 --gpu-memory-gb 80 --pp 1 --ac selective",
    ],
)
def test_planner_toml_is_accepted_on_0_3(argv: str, tmp_path: Path, monkeypatch) -> None:
    import torchtitan_integration.planner as titan_planner

    searched = []  # the plan the TOML was written from (one search, not two)

    def search(args, trainers):
        searched.append(problem_from_args(args, trainers))
        return searched[-1]

    problem_from_args = titan_planner.problem_from_args
    monkeypatch.setattr(titan_planner, "problem_from_args", search)
    out = tmp_path / "plan.toml"
    assert titan_planner.main([*argv.split(), "--output", str(out)]) == 0
    ((_, plan),) = searched
    s = plan.best.setting
    config = build_config(out)
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (s.pp, s.tp)
    assert config.training.seq_len == plan.seq_len
    assert model_shape(config.model_spec.model) == plan.shape
    if s.selective:
        assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    validate_before_start(config)


def test_spmd_parallelism_on_an_old_torch_is_refused_naming_both_versions(monkeypatch) -> None:
    """TP / FSDP / CP need torch 2.15 on torchtitan 0.3: an older torch is refused at start-up
    with both versions and the fix; PP alone is not."""
    from types import SimpleNamespace

    from torchtitan_integration.v03 import validate

    par = SimpleNamespace(
        pipeline_parallel_degree=2,
        tensor_parallel_degree=2,
        context_parallel_degree=1,
        data_parallel_replicate_degree=1,
        data_parallel_shard_degree=-1,
    )
    monkeypatch.setattr(validate, "_torch_release", lambda: (2, 13))
    with pytest.raises(ValueError, match=r"tensor_parallel_degree = 2 needs torch >= 2\.15"):
        validate.check_torch_for_parallelism(par, world=4)
    fsdp = SimpleNamespace(**{**vars(par), "tensor_parallel_degree": 1})
    with pytest.raises(ValueError, match="data_parallel_shard_degree = 2"):
        validate.check_torch_for_parallelism(fsdp, world=4)
    validate.check_torch_for_parallelism(fsdp, world=2)  # PP alone: fine on 2.13
    monkeypatch.setattr(validate, "_torch_release", lambda: (2, 15))
    validate.check_torch_for_parallelism(par, world=4)


def test_chunked_loss_wrapper_becomes_a_per_segment_chunked_loss() -> None:
    """0.3's ChunkedLossWrapper (torchtitan's llama3 configs, and ours) is kept under Seq1F1B:
    the schedule's loss is seq1f1b.ChunkedLoss over the wrapper's lm_head and inner loss, with
    its chunk length; any other loss is called as it is."""
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from seq1f1b import ChunkedLoss
    from torchtitan_integration.v03.configs import seq1f1b_llama3
    from torchtitan_integration.v03.pipeline import unit_loss

    assert isinstance(seq1f1b_llama3().loss, ChunkedLossWrapper.Config)
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=8))
    head = torch.nn.Linear(8, 16, bias=False)
    wrapper.set_lm_head(head)
    loss = unit_loss(wrapper, 512)
    assert isinstance(loss, ChunkedLoss)
    assert loss.chunk_tokens == 64 and loss.normalize == "none" and loss.head is head
    hidden = torch.randn(2, 40, 8, requires_grad=True)
    labels = torch.randint(0, 16, (2, 40))
    gvt = torch.tensor(80.0)
    want, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(head(hidden), labels, gvt)
    got = loss(hidden, labels, global_valid_tokens=gvt)
    assert torch.allclose(got, want.float(), rtol=1e-6)
    plain = unit_loss(CrossEntropyLoss(CrossEntropyLoss.Config()), 512)
    assert not isinstance(plain, ChunkedLoss)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_start_check_names_positions_taken_from_the_segment(name: str) -> None:
    """``[seq1f1b] verify``'s check on each family's 0.3 debug model passes as adapted, and
    fails naming the positions when each stage's RoPE restarts at every segment (no positions
    passed)."""
    from types import SimpleNamespace

    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    from torchtitan_integration.config import Seq1F1B
    from torchtitan_integration.v03.models import family
    from torchtitan_integration.v03.validate import check_titan03, titan03_debug_model
    from torchtitan_integration.verify import run_start_check

    check_titan03(SimpleNamespace(seq1f1b=Seq1F1B(seq_chunks=4)), 2, family(name))
    build, n_layers = titan03_debug_model(family(name))
    names = _generate_llm_fqn_per_model_part(2, n_layers)
    with pytest.raises(ValueError, match="positions are probably taken from the segment"):
        run_start_check(build, names, 4, True, positions_kwarg=False)


def test_selective_ac_saves_the_chunk_aware_attention() -> None:
    """Where the attention is chunk-aware, torchtitan's ``SelectiveAC.Config`` becomes
    :class:`ChunkAwareSelectiveAC`'s, the same fields, whose save list is torchtitan's plus
    :func:`seq1f1b.checkpoint_save_ops`; any other AC config is left as it is."""
    import dataclasses

    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    import seq1f1b
    from torchtitan_integration.v03.checkpointing import (
        ChunkAwareSelectiveAC,
        saving_chunk_aware_attention,
    )

    theirs = SelectiveAC.Config(preserve_rng_state=False, force_recompute_mm_shapes_by_fqns=[])
    ours = saving_chunk_aware_attention(theirs)
    assert type(ours) is ChunkAwareSelectiveAC.Config
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    saved = ours.build().get_save_ops()
    assert saved == theirs.build().get_save_ops() | seq1f1b.checkpoint_save_ops()
    assert seq1f1b.checkpoint_save_ops() - theirs.build().get_save_ops()  # not on theirs
    full = FullAC.Config()
    assert saving_chunk_aware_attention(full) is full
    assert saving_chunk_aware_attention(None) is None


@pytest.mark.parametrize(
    "preset",
    ["llama3-8b", "llama3-70b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b", "deepseek-v3-671b",
     "gpt-oss-120b"],
)  # fmt: skip
def test_planner_presets_are_torchtitans_flavors(preset: str) -> None:
    """Each planner preset the TOML writer names a torchtitan flavor for has that flavor's
    shape, read from torchtitan 0.3's config the way the integration reads it."""
    from seq1f1b.planning.costmodel import PRESETS
    from torchtitan_integration.planner import FLAVORS
    from torchtitan_integration.v03.models import family

    name, flavor = FLAVORS[preset]
    models = family(name)
    assert models.shape(models.model_spec(flavor).model) == PRESETS[preset]


@pytest.mark.default_release_only  # (the attention itself: tests/test_attention.py, every torch)
def test_gpt_oss_chunk_aware_equals_torchtitans_flex_attention(monkeypatch) -> None:
    """GPT-OSS made chunk-aware (each layer's window from its config, the learned sinks on the
    LSE through ``out_transform``) computes what torchtitan's own FlexAttention model does
    with its masks (causal + documents, 128-key windows on even layers, sinks), on 300 tokens
    of two packed documents: the same logits (forward only, torchtitan's FlexAttention run
    eager: compiled on CPU it has neither a backward nor the LSE; the LSE's gradient:
    tests/test_attention.py). The family's shape has the window."""
    import copy

    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    import seq1f1b
    from torchtitan_integration.v03.model import (
        ChunkAwareInnerAttention,
        document_ids_from_positions,
    )
    from torchtitan_integration.v03.models import NoBf16Casts, family
    from torchtitan_integration.v03.models.gpt_oss import experts_in_input_dtype

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_attention)
    gpt_oss = family("gpt_oss")
    spec = gpt_oss.model_spec("debugmodel_cpu")
    torch.manual_seed(0)
    theirs = spec.model.build()
    with torch.no_grad():
        theirs.init_weights(buffer_device=None)
        for layer in theirs.layers.values():  # sinks large enough to matter
            layer.attention.sinks.normal_(0, 2.0)
    mine = copy.deepcopy(theirs)
    assert gpt_oss.make_chunk_aware(mine) == 4
    assert experts_in_input_dtype(theirs) == 4  # (torchtitan's GPT-OSS fails in fp32 without)
    windows = [layer.attention.inner_attention.window for layer in mine.layers.values()]
    assert windows == [128, None, 128, None]
    assert all(isinstance(x.attention.inner_attention, ChunkAwareInnerAttention)
               for x in mine.layers.values())  # fmt: skip
    shape = gpt_oss.shape(spec.model)
    assert (shape.window, shape.window_layers, shape.head_dim, shape.n_kv_heads) == (128, 2, 64, 8)
    tokens = torch.randint(0, 2048, (1, 300))
    positions = torch.cat([torch.arange(170), torch.arange(130)]).unsqueeze(0)
    with torch.no_grad(), NoBf16Casts():  # fp32 experts: compare at fp32's accuracy
        want = theirs(tokens, positions, theirs.get_attention_masks(positions))
        with seq1f1b.packed_documents(document_ids_from_positions(positions)):
            got = mine(tokens, positions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer in mine.layers.values():  # without the windows, another model
        layer.attention.inner_attention.window = None
    with torch.no_grad(), NoBf16Casts():
        with seq1f1b.packed_documents(document_ids_from_positions(positions)):
            assert (mine(tokens, positions) - want).abs().max() > 1e-2


def test_help_lists_the_seq1f1b_keys_and_torchtitans(monkeypatch, capsys) -> None:
    """``--help`` on the TOML command line (what run_train.sh passes) lists the [seq1f1b]
    keys with their docs and torchtitan 0.3's options, instead of refusing '--help' as an
    override (issue 60)."""
    import sys

    from torchtitan_integration import train

    monkeypatch.setattr(sys, "argv", ["train", "--job.config_file", str(DEBUG), "--help"])
    train.run()
    out = capsys.readouterr().out
    for key in ("--seq1f1b.seq_chunks int (default: 4)", "--seq1f1b.first_step_check",
                "--checkpoint.enable", "--debug.seed", "--training.steps",
                "--job.dump_folder -> --dump_folder"):  # fmt: skip
        assert key in out, key
    assert "K: segments each sample's sequence is cut into" in out  # the field's docstring


def test_the_shared_core_reads_0_3s_own_config() -> None:
    """The pipelining function hands the shared core 0.3's trainer config itself, or, where
    torchtitan passed replaced parallelism/training sections (``pipeline_vlm``), a copy of
    that config holding them: never a view in 0.2.2's shape."""
    import dataclasses

    from torchtitan_integration.v03.pipeline import with_sections

    config = build_config(DEBUG)
    assert with_sections(config) is config
    assert with_sections(config, config.parallelism, config.training) is config
    par = dataclasses.replace(config.parallelism, pipeline_parallel_degree=4)
    copy = with_sections(config, par)
    assert type(copy) is type(config) and copy.parallelism is par
    assert copy.training is config.training and copy.seq1f1b is config.seq1f1b


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_dry_runs_planner_line_prices_the_config_as_it_runs(path: Path) -> None:
    """``--seq1f1b.dry_run`` prints the planner's price of the same setting beside each rank
    (torchtitan_integration/v03/plan_check.py): the setting it prices is the TOML's, key by
    key (degrees, schedule, stages per rank, K, split, AC), or it says why it prices none."""
    import tomllib

    from torchtitan_integration.v03.dry_run import world_size_of
    from torchtitan_integration.v03.plan_check import planned, planner_lines

    raw = tomllib.loads(path.read_text())
    config = build_config(path)
    world = world_size_of(config.parallelism)
    cand = planned(config, world)
    par = raw["parallelism"]
    pp = par.get("pipeline_parallel_degree", 1)
    if isinstance(cand, str):  # torchtitan cuts 27 layers unevenly; the planner does not
        assert "does not divide the 27 layers" in cand, cand
        assert "deepseek_v3_16b" in path.name
        return
    s = cand.setting
    assert (s.pp, s.tp, s.cp) == (pp, par.get("tensor_parallel_degree", 1),
                                  par.get("context_parallel_degree", 1))  # fmt: skip
    assert s.pp * s.tp * s.cp * s.fsdp == world
    assert s.schedule == par.get("pipeline_parallel_schedule", "1F1B")
    assert s.seq_chunks == raw["seq1f1b"]["seq_chunks"]
    assert s.ac == raw.get("activation_checkpoint", {}).get("mode", "selective")
    if s.seq_chunks > 1:
        assert s.split == raw["seq1f1b"].get("seq_split", "compute")
    # the interleaved and V schedules run two stages a rank here, the others one
    two = s.schedule.startswith("Interleaved") or s.schedule.startswith("ZBV")
    assert s.stages_per_rank == (2 if two else 1)
    lines = planner_lines(config, world, {0: 2**32})
    assert lines[1].startswith("  pipeline rank 0: planner ") and "dry run 4.00 GiB" in lines[1]
    assert lines[1].endswith(f"planner / dry run {cand.peak_bytes[0] / 2**32:.3f}")
