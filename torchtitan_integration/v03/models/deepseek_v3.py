"""DeepSeek-V3 (``torchtitan.models.deepseek_v3``): multi-head latent attention and MoE.

MLA expands each head's key and value from a compressed latent (``wkv_b``) and adds a shared
RoPE key part, then calls ``inner_attention(q, k, v, ...)`` like ``GQAttention`` does, with a
query/key head dim (``qk_nope_head_dim + qk_rope_head_dim``, 192) other than the value's
(``v_head_dim``, 128): the shared inner-attention swap makes it chunk-aware, and the
chunk-aware attention takes the two widths (``seq1f1b/attention/head_dims.py``). The FLOPs
shape counts one head dim, the mean of the two (QK^T runs at 192, PV at 128), every head its
own K/V, and the FFN width averaged over the dense first layers and the MoE rest.
Multi-token prediction stays refused under pipeline parallelism, as torchtitan refuses it.

``[seq1f1b] kv_cache = "latent"`` (:func:`latent_mla`): the K/V cache keeps, for earlier
segments, what MLA compresses K and V into (the normalised ``kv_lora_rank`` latent and the
rotated shared RoPE key) and each later segment re-expands them through ``wkv_b``
(:func:`seq1f1b.latent_attention`). The layer's forward is torchtitan's with the expansion
handed to the attention; tensor parallelism (which shards ``wkv_b`` by heads) is not supported
with it.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from seq1f1b import LatentKV, ModelShape

from .base import ModelFamily, decoder_shape


def mla_shape(config: Any) -> ModelShape:
    """The FLOPs shape of a DeepSeek-V3 config (see the module docstring)."""
    attn = config.layers[0].attention
    qk = attn.qk_nope_head_dim + attn.qk_rope_head_dim
    shape = decoder_shape(config, head_dim=(qk + attn.v_head_dim) // 2, n_kv_heads=attn.n_heads)
    expanded = attn.n_heads * (attn.qk_nope_head_dim + attn.v_head_dim)
    return replace(shape, latent_kv=LatentKV(attn.kv_lora_rank, attn.qk_rope_head_dim, expanded))


def _expand_kv(self: Any, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V ``(B, N, L, H)`` of any run of positions from its latent ``c`` (normalised) and
    rotated RoPE key ``k_pe`` (both ``(B, L, width)``), as torchtitan's MLA forward builds them."""
    bsz, seqlen, _ = c.shape
    kv = self.wkv_b(c).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
    k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, k_nope.size(2), -1)], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


def _latent_forward(
    self: Any, x: torch.Tensor, attention_masks: Any, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """torchtitan 0.3's MLA forward, the K/V expansion done by the attention (see above)."""
    del attention_masks  # the documents come with the step
    bsz, seqlen, _ = x.size()
    q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
    q = q.view(bsz, seqlen, -1, self.qk_head_dim)
    q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(2), positions)
    q = torch.cat([q_nope, q_pe], dim=-1)
    latent = (self.kv_norm(kv), k_pe.squeeze(2))
    out = self.inner_attention.latent(q, latent, self.expand_kv, scale=self.softmax_scale)
    return self.wo(out.contiguous().view(bsz, seqlen, -1))


@functools.cache
def _latent_class(base: type) -> type:
    """``base`` (torchtitan's MLA ``Attention``) with the latent-caching forward."""
    doc = f"{base.__name__} whose K/V cache keeps the latent (seq1f1b kv_cache = 'latent')."
    attrs = {"forward": _latent_forward, "expand_kv": _expand_kv, "__doc__": doc}
    return type(f"LatentCache{base.__name__}", (base,), attrs)


def latent_mla(model: nn.Module) -> int:
    """Make every MLA layer of a chunk-aware DeepSeek-V3 ``model`` cache its latent (same
    parameters, its class swapped); returns how many. Idempotent."""
    from torchtitan.models.deepseek_v3.model import Attention

    converted = 0
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = _latent_class(Attention)
            converted += 1
    return converted


FAMILY = ModelFamily(
    name="deepseek_v3", configs="deepseekv3_configs", shape=mla_shape, latent_kv=latent_mla
)
