"""Hugging Face ``transformers`` decoders under the Seq1F1B schedules.

These make a ``...ForCausalLM`` of the Llama family (Llama, Qwen2/3, Mistral, DeepSeek-V3,
GPT-OSS, the hybrids Qwen3-Next and Qwen3.5: a ``model.model`` with ``embed_tokens``,
``layers``, ``norm``, ``rotary_emb``, and an ``lm_head``) chunkable, without editing
transformers:

* its attention goes through transformers' own ``AttentionInterface`` as a call to
  :func:`seq1f1b.chunk_aware_attention` (:func:`register_attention`, then
  ``attn_implementation="seq1f1b"``), so each segment attends to the K/V of the earlier ones;
* each pipeline stage (:class:`DecoderStage`) computes the rotary embeddings from the running
  segment's absolute positions (:func:`seq1f1b.segment_positions`), not from ``0..len-1``;
* the hybrid decoders' Gated DeltaNet layers (Qwen3-Next, Qwen3.5: ``layer.linear_attn``) run
  :func:`linear_attention_forward`, their own projections, convolution weight, gates and
  norm around Seq1F1B's kernels, carrying the convolution tail and the delta-rule state from
  segment to segment (:func:`seq1f1b.carried_state`).

    register_attention()
    model = LlamaForCausalLM(config)                # config._attn_implementation = "seq1f1b"
    stages = decoder_stages(model, num_stages=2)    # modules for PipelineStage
    ScheduleSeq1F1B([PipelineStage(stages[r], r, 2, device)], n_microbatches, seq_chunks, ...)

:func:`seq1f1b.verify_model` checks the result against the unpipelined model in one call.
``transformers`` is imported only by :func:`register_attention`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention.attention_op import add_layer_key, segment_positions
from .attention.gated_deltanet import gated_deltanet_core
from .attention.layer import chunk_aware_attention

__all__ = [
    "ATTENTION",
    "DecoderStage",
    "decoder_stages",
    "linear_attention_forward",
    "register_attention",
    "seq1f1b_attention",
]

#: the ``attn_implementation`` name :func:`register_attention` registers
ATTENTION = "seq1f1b"


def seq1f1b_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over chunk-aware causal attention.

    ``attention_mask`` is not read: the attention is causal, and packed documents come with
    the batch (``step(..., document_ids=...)``). ``sliding_window`` (keys per query, itself
    included, as transformers counts it) is the layer's window. ``s_aux`` (GPT-OSS's learned
    sinks, one logit per head in every softmax's normaliser) rescales the output by
    ``sigmoid(lse - s_aux)`` on the log-sum-exp merged over every segment's keys."""
    del attention_mask
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} under Seq1F1B: the chunk-aware attention has none; "
            "set config.attention_dropout = 0.0"
        )
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by Seq1F1B's chunk-aware attention")
    sinks = kwargs.get("s_aux")
    out = chunk_aware_attention(
        query, key, value, layer=module, scale=scaling, window=sliding_window,
        return_lse=sinks is not None,
    )  # fmt: skip
    if sinks is not None:
        out, lse = out
        # in the LSE's dtype (fp32, fp64 in an fp64 run): a cast to fp32 would round an fp64
        # model's sinks, and their gradients, to fp32
        sink = sinks.view(1, -1, 1).to(lse.dtype)
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).contiguous(), None  # transformers wants (batch, seq, heads, dim)


def register_attention() -> None:
    """Register :func:`seq1f1b_attention` as ``attn_implementation="seq1f1b"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, seq1f1b_attention)


def linear_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` forward for
    training under Seq1F1B: the same projections (Qwen3-Next's interleaved ``in_proj_qkvz``
    and ``in_proj_ba``, or Qwen3.5's separate ones), convolution weight, gates, gated norm and
    output projection, with the short convolution and the delta rule continuing from the
    previous segment's state. ``attention_mask`` is not read (packed documents come with the
    step); a generation cache is refused."""
    del attention_mask, kwargs
    if cache is not None:
        raise ValueError("Seq1F1B's Gated DeltaNet trains without a generation cache")
    b, n, _ = hidden_states.shape
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved by key head
        q, k, v, z, beta, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        qkv = torch.cat([t.reshape(b, n, -1) for t in (q, k, v)], -1)
    else:
        qkv, z = self.in_proj_qkv(hidden_states), self.in_proj_z(hidden_states)
        beta, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    dims = (self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
    out = gated_deltanet_core(
        self, qkv, self.conv1d.weight, g, beta.sigmoid(), dims, anchor=hidden_states
    )
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(b, n, -1))


def _chunk_aware_linear_attention(module: nn.Module) -> None:
    """Give a transformers Gated DeltaNet layer :func:`linear_attention_forward` (idempotent);
    refuses what that forward does not compute."""
    if getattr(module, "_seq1f1b_chunk_aware", False):
        return
    if module.activation != "silu" or module.conv1d.bias is not None:
        raise ValueError(
            f"{type(module).__name__}: Seq1F1B's short convolution is bias-free with a SiLU "
            f"(this layer: activation {module.activation!r}, bias "
            f"{module.conv1d.bias is not None})"
        )
    module.forward = linear_attention_forward.__get__(module)
    module._seq1f1b_chunk_aware = True
    add_layer_key(module)  # names its carried state under torch.compile


class DecoderStage(nn.Module):
    """Layers ``start:stop`` of a transformers causal LM as one pipeline stage: the token
    embedding on the first stage, the final norm and ``lm_head`` on the last (``skip_head``
    leaves the head to a :class:`seq1f1b.ChunkedLoss`). The modules are the model's own (no
    copy): the stages of one model share nothing else."""

    def __init__(self, causal_lm: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        base = causal_lm.model
        n = len(base.layers)
        self.embed_tokens = base.embed_tokens if start == 0 else None
        self.layers = nn.ModuleList(base.layers[start:stop])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if stop == n else None
        self.lm_head = causal_lm.lm_head if stop == n else None
        self.skip_head = False
        for layer in self.layers:
            if getattr(layer, "linear_attn", None) is not None:  # Gated DeltaNet (hybrids)
                _chunk_aware_linear_attention(layer.linear_attn)
            else:
                add_layer_key(layer.self_attn)  # names the layer under torch.compile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = segment_positions(h, dim=1).unsqueeze(0).expand(h.shape[0], -1)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:
            out = layer(h, position_embeddings=rotary, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None and not self.skip_head:
            h = self.lm_head(h)
        return h


def decoder_stages(causal_lm: nn.Module, num_stages: int) -> list[DecoderStage]:
    """``causal_lm`` cut into ``num_stages`` stages of consecutive layers (the first ones one
    layer longer when they do not divide evenly). Refuses what would train wrongly: another
    attention implementation, and embeddings tied to the head across two stages."""
    config = causal_lm.config
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTENTION:
        raise ValueError(
            f"the model's attention implementation is {impl!r}, which Seq1F1B cannot chunk "
            "(each segment would attend only to itself): call seq1f1b.huggingface."
            "register_attention() and build the model with attn_implementation='seq1f1b' "
            "(or model.set_attn_implementation('seq1f1b'))"
        )
    layers = len(causal_lm.model.layers)
    if not 1 <= num_stages <= layers:
        raise ValueError(f"num_stages = {num_stages}: use 1 .. {layers} (the decoder's layers)")
    if num_stages > 1 and getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "tie_word_embeddings = True: the embedding (first stage) and lm_head (last stage) "
            "share one weight, whose two gradients no pipeline schedule adds up; build the "
            "model with tie_word_embeddings=False (untied copies of the weight)"
        )
    base, extra = divmod(layers, num_stages)
    cuts = [0]
    for s in range(num_stages):
        cuts.append(cuts[-1] + base + (s < extra))
    return [DecoderStage(causal_lm, a, b) for a, b in pairwise(cuts)]
