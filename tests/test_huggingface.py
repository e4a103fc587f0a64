"""Hugging Face decoders (transformers, the test extra) under Seq1F1B: tiny Llama, Qwen3 (its
own q/k norms), Qwen3-MoE, DeepSeek-V3 (MLA: value head dim other than q/k's; MoE with a
shared expert) and GPT-OSS (learned sinks, sliding windows of 12 on alternate layers, MoE),
random init with grouped-query attention, cut into two stages by seq1f1b.huggingface, train
exactly as the unpipelined transformers model with its own attention (SDPA; eager for
GPT-OSS's sinks) (loss and every gradient at 1e-5, steps of 64, 48 and 80 tokens); the
self-check passes on them; a model left on another attention implementation is refused."""

from __future__ import annotations

import copy

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


FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"]
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


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """transformers' own forward (its SDPA attention, or eager where the sinks need it; its
    own positions and masks): loss and gradients."""
    ref = copy.deepcopy(model)
    gpt_oss = getattr(ref.config, "model_type", "") == "gpt_oss"
    ref.config._attn_implementation = "eager" if gpt_oss else "sdpa"
    loss = loss_fn(ref(input_ids=x).logits, y)
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
        for name, p in model.named_parameters():
            err = rel_err(p.grad, ref_grads[name])
            assert err <= 1e-5, f"{family} {seq_len} tokens {name}: rel err {err:.2e}"


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
