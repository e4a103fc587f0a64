"""Qwen3 (``torchtitan.models.qwen3``), dense and mixture-of-experts.

Its attention is torchtitan's ``GQAttention`` with q/k norms applied before RoPE and before the
inner attention, so the shared inner-attention swap makes it chunk-aware; a head dim of 128
whatever the width (``head_dim`` is in the shape). Its small flavors tie the embedding to the
output head, which torchtitan refuses under pipeline parallelism (the two live on the first and
the last stage): Seq1F1B trains them untied, pipelined or not, so that PP=1 and PP>1 train the
same model (Qwen3 8B and larger ship untied).

The MoE flavors route each token to ``top_k`` of the routed experts, with torchtitan's
auxiliary-loss-free balancing (token counts per expert, an expert bias updated from them
before each optimizer step). ``debugmodel_moe_cpu`` is Seq1F1B's own: torchtitan's
``debugmodel_moe`` (64 experts of width 768, top 8: 30 s a step on 2 CPU cores) with 8 experts
of width 256, top 2, everything else as torchtitan's; the start-up self-check of an MoE run
runs it.
"""

from __future__ import annotations

from typing import Any

from .base import ModelFamily, Resized, resize_experts


def untie_embeddings(model_config: Any) -> list[str]:
    """Untie ``tok_embeddings`` and ``lm_head`` (torchtitan: no weight tying under PP)."""
    if not model_config.enable_weight_tying:
        return []
    model_config.enable_weight_tying = False
    return [
        "enable_weight_tying = False: tok_embeddings and lm_head are separate weights "
        "(torchtitan ties them in no pipelined run; the first and the last stage hold them)"
    ]


def cpu_sized_moe(model_config: Any) -> list[str]:
    """``debugmodel_moe`` at a 2-core CPU's size (see the module docstring)."""
    return resize_experts(model_config, num_experts=8, top_k=2, hidden_dim=256)


FAMILY = ModelFamily(
    name="qwen3",
    adapt=untie_embeddings,
    resized={"debugmodel_moe_cpu": Resized("debugmodel_moe", cpu_sized_moe)},
    debug_flavor_moe="debugmodel_moe_cpu",
)
