"""Hugging Face decoders (transformers, the test extra) under Seq1F1B: tiny Llama, Qwen3 (its
own q/k norms), Qwen3-MoE, DeepSeek-V3 (MLA: value head dim other than q/k's; MoE with a
shared expert), GPT-OSS (learned sinks, sliding windows of 12 on alternate layers, MoE) and
the hybrids Qwen3-Next (MoE) and Qwen3.5 (Gated DeltaNet layers carrying their state),
random init with grouped-query attention, cut into two stages by seq1f1b.huggingface, train
exactly as the unpipelined transformers model with its own attention (SDPA; eager for
GPT-OSS's sinks) (loss and every gradient at 1e-5, steps of 64, 48 and 80 tokens); the
self-check passes on them; a model left on another attention implementation is refused."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
from dist_utils import run_ranks
from equivalence import loss_fn, rel_err
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ScheduleSeq1F1B, verify_model
from seq1f1b.huggingface import decoder_stages, register_attention

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.default_release_only

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             tie_word_embeddings=False, attention_dropout=0.0)  # fmt: skip


FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5"]
#: the hybrids' Gated DeltaNet layers: 2 key heads and 4 value heads of 8 (layers 0-2; 3
#: attends), so their state goes from segment to segment
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, head_dim=8)  # fmt: skip
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)


def _config(family: str):  # type: ignore[no-untyped-def]
    if family == "llama":
        return transformers.LlamaConfig(**SIZES), transformers.LlamaForCausalLM
    if family == "qwen3":
        return transformers.Qwen3Config(**SIZES, head_dim=8), transformers.Qwen3ForCausalLM
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**SIZES, **MOE, head_dim=8, num_experts=4)
        return config, transformers.Qwen3MoeForCausalLM
    if family == "deepseek_v3":  # MLA: q/k head dim 16 + 8 (RoPE), v 12, from latents
        config = transformers.DeepseekV3Config(
            **{**SIZES, "num_key_value_heads": 4}, **MOE, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, n_group=1, topk_group=1,
        )  # fmt: skip
        return config, transformers.DeepseekV3ForCausalLM
    if family == "qwen3_next":  # MoE on every layer, a shared expert
        config = transformers.Qwen3NextConfig(**SIZES, **MOE, **LINEAR, num_experts=4,
                                              shared_expert_intermediate_size=16)  # fmt: skip
        return config, transformers.Qwen3NextForCausalLM
    if family == "qwen3_5":  # dense, partial RoPE (a quarter of the head), MRoPE sections
        config = transformers.Qwen3_5TextConfig(**SIZES, **LINEAR)
        return config, transformers.Qwen3_5ForCausalLM
    config = transformers.GptOssConfig(
        **{**SIZES, "intermediate_size": 16}, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    return config, transformers.GptOssForCausalLM


def _model(family: str, attn: str = "seq1f1b") -> torch.nn.Module:
    register_attention()
    torch.manual_seed(0)
    config, cls = _config(family)
    config._attn_implementation = attn
    model = cls(config).float()
    if family == "gpt_oss":  # sinks large enough to matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


@contextlib.contextmanager
def _torch_delta_rule() -> Iterator[None]:
    """transformers' pure-torch gated delta rule in its hybrids: with FLA importable (the
    titan extra installs it) transformers picks FLA's Triton kernel at import, which needs a
    GPU."""
    import importlib

    saved = []
    for name in ("qwen3_next.modeling_qwen3_next", "qwen3_5.modeling_qwen3_5"):
        module = importlib.import_module(f"transformers.models.{name}")
        fn = module.torch_chunk_gated_delta_rule
        saved.append((module, fn))
        module.torch_chunk_gated_delta_rule = getattr(fn, "__wrapped__", fn)
    try:
        yield
    finally:
        for module, fn in saved:
            module.torch_chunk_gated_delta_rule = fn


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """transformers' own forward (its SDPA attention, or eager where the sinks need it; its
    own positions and masks; its own Gated DeltaNet): loss and gradients."""
    ref = copy.deepcopy(model)
    for module in ref.modules():  # the hybrids' Gated DeltaNet: transformers' own forward
        module.__dict__.pop("forward", None)
    gpt_oss = getattr(ref.config, "model_type", "") == "gpt_oss"
    ref.config._attn_implementation = "eager" if gpt_oss else "sdpa"
    with _torch_delta_rule():
        loss = loss_fn(ref(input_ids=x, use_cache=False).logits, y)
        loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _pipelined_steps(rank: int, world: int, family: str) -> None:
    model = _model(family)
    stages = decoder_stages(model, 2)
    pipe = [PipelineStage(stages[s], s, 2, torch.device("cpu")) for s in range(2)]
    sched = ScheduleSeq1F1B(pipe, 2, 3, loss_fn)
    g = torch.Generator().manual_seed(1)
    for seq_len in (64, 48, 80):
        tokens = torch.randint(0, SIZES["vocab_size"], (2, seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        ref_loss, ref_grads = _reference(model, x, y)
        model.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(x, target=y, losses=losses)
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (family, seq_len, loss, ref_loss)
        truth = _decay_truth(model, x, y) if family in HYBRIDS else {}
        for name, p in model.named_parameters():
            err = rel_err(p.grad, ref_grads[name])
            tol = 1e-5
            if name in truth:  # see DECAY_TOL
                assert rel_err(p.grad.double(), truth[name]) <= 1e-4, (family, seq_len, name)
                tol = DECAY_TOL
            assert err <= tol, f"{family} {seq_len} tokens {name}: rel err {err:.2e}"


HYBRIDS = ("qwen3_next", "qwen3_5")
#: transformers' pure-torch chunked delta rule takes the cumulative log decays in fp32, and a
#: difference of two such sums keeps only about 1e-4 of it under Qwen3.5's strong decays
#: (A up to 16): the gradients of the decay's parameters come out up to 1.2e-2 off the fp64
#: result. Seq1F1B's kernel sums them in fp64, and the pipelined fp32 run is within 1e-4 of
#: the unsegmented fp64 model (3e-5 measured, as is the unsegmented fp32 one: these small
#: gradients of strong decays are fp32's rounding); tests/test_recurrent.py holds the
#: segmented kernel to the whole sequence in fp64 at 1e-12
DECAY_TOL = 2e-2
#: the parameters the decays are computed from (Qwen3-Next's in_proj_ba also gives beta)
DECAY_PARAMETERS = ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_ba.weight")


def _decay_truth(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The gradients of the Gated DeltaNet decay parameters of the unsegmented model in fp64
    (Seq1F1B's kernels, computed in fp64)."""
    ref = copy.deepcopy(model).double()
    ref.config._experts_implementation = "eager"  # grouped_mm has no fp64
    loss_fn(ref(input_ids=x, use_cache=False).logits, y).backward()
    return {n: p.grad for n, p in ref.named_parameters() if n.endswith(DECAY_PARAMETERS)}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_decoder_matches_unpipelined(family: str) -> None:
    run_ranks(_pipelined_steps, 1, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_self_check_passes_on_transformers_stages(family: str) -> None:
    model = _model(family)
    tokens = torch.randint(
        0, SIZES["vocab_size"], (2, 49), generator=torch.Generator().manual_seed(2)
    )
    report = verify_model(decoder_stages(model, 2), tokens[:, :-1], tokens[:, 1:], loss_fn)
    assert report.ok, str(report)


def test_other_attention_implementations_are_refused() -> None:
    with pytest.raises(ValueError, match="attn_implementation='seq1f1b'"):
        decoder_stages(_model("llama", attn="sdpa"), 2)
    tied = _model("llama")
    tied.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        decoder_stages(tied, 2)
