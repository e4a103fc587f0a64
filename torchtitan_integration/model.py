"""Make torchtitan's Llama3 attention chunk-aware, without editing torchtitan.

Two small changes per attention layer, both no-ops outside a Seq1F1B step so the same model
trains unpipelined and under torch's schedules:

* its ``inner_attention`` (SDPA wrapper) becomes :class:`ChunkAwareSDPA`, which routes causal
  attention through :func:`seq1f1b.chunk_aware_attention` (K/V of earlier segments);
* a forward pre-hook shifts the RoPE table by the segment's start, so the attention's own
  ``freqs_cis[0:seqlen]`` slice lands on absolute positions ``start .. start + len - 1``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seq1f1b import chunk_aware_attention, current_segment


class ChunkAwareSDPA(nn.Module):
    """Drop-in for torchtitan's ScaledDotProductAttentionWrapper (causal only)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
    ) -> torch.Tensor:
        if not is_causal:
            raise ValueError("Seq1F1B chunk-aware attention is causal only")
        del enable_gqa  # inferred from the head counts
        return chunk_aware_attention(q, k, v, layer=self, scale=scale)


def _shift_rope(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """Pre-hook on Attention(x, freqs_cis, attention_masks, positions=None)."""
    info = current_segment()
    if info is None or info.start == 0:
        return None
    positions = kwargs.get("positions", args[3] if len(args) > 3 else None)
    if positions is not None:
        return None  # the caller already gave absolute positions
    if "freqs_cis" in kwargs:
        kwargs = {**kwargs, "freqs_cis": kwargs["freqs_cis"][info.start :]}
    else:
        args = (args[0], args[1][info.start :], *args[2:])
    return args, kwargs


def make_chunk_aware(model: nn.Module) -> int:
    """Convert every SDPA attention layer of a torchtitan Llama3 model; returns how many."""
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    converted = 0
    for module in model.modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, ScaledDotProductAttentionWrapper):
            module.inner_attention = ChunkAwareSDPA()
            module.register_forward_pre_hook(_shift_rope, with_kwargs=True)
            converted += 1
        elif inner is not None and not isinstance(inner, ChunkAwareSDPA):
            raise ValueError(
                f"{type(inner).__name__} attention cannot be chunked by Seq1F1B: set "
                "[model] flavor to an 'sdpa' attention flavor (e.g. debugmodel, 8B, 70B)"
            )
    return converted
