"""DeepSeek-V3 (``torchtitan.models.deepseek_v3``): multi-head latent attention and MoE.

MLA expands each head's key and value from a compressed latent (``wkv_b``) and adds a shared
RoPE key part, then calls ``inner_attention(q, k, v, ...)`` like ``GQAttention`` does, with a
query/key head dim (``qk_nope_head_dim + qk_rope_head_dim``, 192) other than the value's
(``v_head_dim``, 128): the shared inner-attention swap makes it chunk-aware, and the
chunk-aware attention takes the two widths (``seq1f1b/attention/head_dims.py``). The FLOPs
shape counts one head dim, the mean of the two (QK^T runs at 192, PV at 128), every head its
own K/V, and the FFN width averaged over the dense first layers and the MoE rest.
Multi-token prediction stays refused under pipeline parallelism, as torchtitan refuses it.
"""

from __future__ import annotations

from typing import Any

from seq1f1b import ModelShape

from .base import ModelFamily, decoder_shape


def mla_shape(config: Any) -> ModelShape:
    """The FLOPs shape of a DeepSeek-V3 config (see the module docstring)."""
    attn = config.layers[0].attention
    qk = attn.qk_nope_head_dim + attn.qk_rope_head_dim
    return decoder_shape(config, head_dim=(qk + attn.v_head_dim) // 2, n_kv_heads=attn.n_heads)


FAMILY = ModelFamily(name="deepseek_v3", configs="deepseekv3_configs", shape=mla_shape)
