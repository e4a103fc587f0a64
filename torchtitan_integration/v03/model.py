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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from seq1f1b import add_layer_key, chunk_aware_attention, latent_attention
from seq1f1b.attention.masks import MaskSpec


class ChunkAwareInnerAttention(nn.Module):
    """Drop-in for 0.3's inner attention modules: causal attention within packed documents,
    within a sliding ``window`` of keys (itself included) on windowed layers.

    ``attention_masks`` is ignored on purpose: the documents it would encode come from the
    step (or :func:`seq1f1b.packed_documents` outside one), where the schedule cut them per
    segment, and the window is the layer's. An ``out_transform(out, lse)`` (GPT-OSS's learned
    sinks) gets the log-sum-exp merged over every segment's keys, so it applies once to the
    whole softmax. Its ``seq1f1b_layer_key`` buffer names the layer under torch.compile.
    """

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        MaskSpec(window)  # a bad window fails when the model is adapted, not at step 1
        self.window = window
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
        out_transform = kwargs.pop("out_transform", None)
        del attention_masks, enable_gqa, kwargs  # documents come with the step; GQA by shape
        res = chunk_aware_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            layer=self,
            scale=scale,
            window=self.window,
            documents=True,
            return_lse=out_transform is not None,
        )
        if out_transform is None:
            return res.transpose(1, 2)
        out, lse = res  # (B, N, L, H) and (B, N, L): torchtitan's transform takes B, L first
        return out_transform(out.transpose(1, 2), lse.transpose(1, 2))

    def latent(
        self,
        q_BLNH: torch.Tensor,
        latent: tuple[torch.Tensor, torch.Tensor],
        expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """The attention over ``expand(*latent)``'s K/V whose cache keeps the latent of
        earlier segments (:func:`seq1f1b.latent_attention`); ``expand`` returns K/V as
        ``(B, N, L, H)``."""
        out = latent_attention(q_BLNH.transpose(1, 2), latent, expand, layer=self, scale=scale,
                               window=self.window, documents=True)  # fmt: skip
        return out.transpose(1, 2)


def make_chunk_aware(
    model: nn.Module, window_of: Callable[[str, nn.Module], int | None] | None = None
) -> int:
    """Replace every attention layer's inner attention; returns how many. Idempotent.
    ``window_of(name, attention)``: the sliding window of the attention module ``name``
    (None: full causal), for families with windowed layers."""
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
        VarlenAttention,
    )

    known = (FlexAttention, ScaledDotProductAttention, VarlenAttention)
    converted = 0
    for name, module in model.named_modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, ChunkAwareInnerAttention) or inner is None:
            continue
        if not isinstance(inner, known):
            raise ValueError(
                f"{type(inner).__name__} inner attention cannot be chunked by Seq1F1B: use a "
                "model whose attention backend is flex, varlen or sdpa (the model_registry's "
                "attn_backend=...)"
            )
        window = None if window_of is None else window_of(name, module)
        if window is None and getattr(inner, "window_size", (-1, 0)) not in ((-1, 0), None):
            raise ValueError(
                f"{name}: {type(inner).__name__} with window_size={inner.window_size} is not "
                "plain causal attention, and the model family names no window for it"
            )
        module.inner_attention = ChunkAwareInnerAttention(window)
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
