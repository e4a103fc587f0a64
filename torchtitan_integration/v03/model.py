"""Make torchtitan 0.3's attention chunk-aware, and its packed documents explicit.

In 0.3 every attention layer (``GQAttention``) calls ``inner_attention(q, k, v, *,
attention_masks, scale, enable_gqa)`` on ``(batch, seq, heads, head_dim)`` tensors, and RoPE
rotates by the ``positions`` the dataloader yields (reset to 0 at each packed document). So a
segment needs no RoPE shift: the schedule cuts ``positions`` with the tokens. The inner
attention (FlexAttention, varlen or SDPA) becomes :class:`ChunkAwareInnerAttention`, which
takes the documents from the step (``document_ids`` derived from ``positions``) instead of a
full-sequence BlockMask, so no mask built for the whole sequence reaches a segment.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seq1f1b import add_layer_key, chunk_aware_attention


class ChunkAwareInnerAttention(nn.Module):
    """Drop-in for 0.3's inner attention modules: causal attention within packed documents.

    ``attention_masks`` is ignored on purpose: the documents it would encode come from the
    step (or :func:`seq1f1b.packed_documents` outside one), where the schedule cut them per
    segment. Its ``seq1f1b_layer_key`` buffer names the layer under torch.compile.
    """

    def __init__(self) -> None:
        super().__init__()
        add_layer_key(self)

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("out_transform") is not None:  # GPT-OSS's learned sinks, on the LSE
            raise NotImplementedError(
                "inner attention called with out_transform (learned attention sinks): the "
                "chunk-aware attention cannot apply it on the log-sum-exp merged over the "
                "segments yet, and dropping it would train a different model"
            )
        del attention_masks, enable_gqa, kwargs  # documents come with the step; GQA by shape
        out = chunk_aware_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            layer=self,
            scale=scale,
            documents=True,
        )
        return out.transpose(1, 2)


def make_chunk_aware(model: nn.Module) -> int:
    """Replace every attention layer's inner attention; returns how many. Idempotent."""
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    known = (FlexAttention, ScaledDotProductAttention, VarlenAttention)
    converted = 0
    for module in model.modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, ChunkAwareInnerAttention) or inner is None:
            continue
        if not isinstance(inner, known):
            raise ValueError(
                f"{type(inner).__name__} inner attention cannot be chunked by Seq1F1B: use a "
                "model whose attention backend is flex, varlen or sdpa (the model_registry's "
                "attn_backend=...)"
            )
        if getattr(inner, "window_size", (-1, 0)) not in ((-1, 0), None):
            raise ValueError(
                f"{type(inner).__name__} with window_size={inner.window_size} is not plain "
                "causal attention; Seq1F1B's torchtitan integration trains causal models"
            )
        module.inner_attention = ChunkAwareInnerAttention()
        converted += 1
    return converted


def document_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document index of each token, as torchtitan 0.3 numbers packed documents: a position
    of 0 starts a new document (``get_document_mask_mod``)."""
    ids = torch.cumsum((positions == 0).to(torch.int64), dim=-1)
    return ids - ids[..., :1]  # the first document is 0 even if a row starts mid-document


def default_positions(tokens: torch.Tensor) -> torch.Tensor:
    """0..S-1 on every row: one document per sample, for data without ``positions``."""
    s = tokens.shape[1]
    return torch.arange(s, device=tokens.device).expand(tokens.shape[0], s)
