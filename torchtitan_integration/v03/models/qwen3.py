"""Qwen3 (``torchtitan.models.qwen3``), dense and mixture-of-experts.

Its attention is torchtitan's ``GQAttention`` with q/k norms applied before RoPE and before the
inner attention, so the shared inner-attention swap makes it chunk-aware; a head dim of 128
whatever the width (``head_dim`` is in the shape). Its small flavors tie the embedding to the
output head, which torchtitan refuses under pipeline parallelism (the two live on the first and
the last stage): Seq1F1B trains them untied, pipelined or not, so that PP=1 and PP>1 train the
same model (Qwen3 8B and larger ship untied).
"""

from __future__ import annotations

from typing import Any

from .base import ModelFamily


def untie_embeddings(model_config: Any) -> list[str]:
    """Untie ``tok_embeddings`` and ``lm_head`` (torchtitan: no weight tying under PP)."""
    if not model_config.enable_weight_tying:
        return []
    model_config.enable_weight_tying = False
    return [
        "enable_weight_tying = False: tok_embeddings and lm_head are separate weights "
        "(torchtitan ties them in no pipelined run; the first and the last stage hold them)"
    ]


FAMILY = ModelFamily(name="qwen3", adapt=untie_embeddings)
