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

from seq1f1b import add_layer_key, chunk_aware_attention, current_segment, segment_positions


class ChunkAwareSDPA(nn.Module):
    """Drop-in for torchtitan's ScaledDotProductAttentionWrapper (causal only).

    ``documents=True`` (flavors with ``attn_mask_type = "block_causal"``): attention stays
    inside each packed document; the trainer passes the document ids, and a step without them
    fails naming the fix instead of attending across documents.
    """

    def __init__(self, documents: bool | None = None) -> None:
        super().__init__()
        self.documents = documents
        add_layer_key(self)  # names the layer under torch.compile

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
        return chunk_aware_attention(q, k, v, layer=self, scale=scale, documents=self.documents)


def _shift_rope(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """Pre-hook on Attention(x, freqs_cis, attention_masks, positions=None): the RoPE rows of
    the segment's positions (with context parallelism, of this rank's two chunks of it)."""
    positions = kwargs.get("positions", args[3] if len(args) > 3 else None)
    if positions is not None:
        return None  # the caller already gave absolute positions
    freqs = kwargs["freqs_cis"] if "freqs_cis" in kwargs else args[1]
    if torch.compiler.is_compiling():  # an op: a compiled block is not specialised per segment
        freqs = freqs.index_select(0, segment_positions(args[0], dim=1).to(freqs.device))
    else:
        info = current_segment()
        if info is None or (info.start == 0 and info.cp is None):
            return None
        freqs = freqs[info.start :] if info.cp is None else freqs[info.positions(freqs.device)]
    if "freqs_cis" in kwargs:
        kwargs = {**kwargs, "freqs_cis": freqs}
    else:
        args = (args[0], freqs, *args[2:])
    return args, kwargs


def make_chunk_aware(model: nn.Module, block_causal: bool = False) -> int:
    """Convert every attention layer of a torchtitan Llama3 model; returns how many.

    SDPA layers become chunk-aware causal attention. FlexAttention / varlen layers (the
    ``*_flex_attn`` / ``*_varlen_attn`` flavors) become chunk-aware attention too, masked by
    packed documents when ``block_causal``: the layer then runs torchtitan's "sdpa" branch and
    takes no ``attention_masks``; the trainer supplies the documents instead. Idempotent.
    """
    from torchtitan.models.attention import (
        FlexAttentionWrapper,
        ScaledDotProductAttentionWrapper,
        VarlenAttentionWrapper,
    )

    converted = 0
    for module in model.modules():
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, ScaledDotProductAttentionWrapper):
            module.inner_attention = ChunkAwareSDPA()
        elif isinstance(inner, (FlexAttentionWrapper, VarlenAttentionWrapper)):
            module.inner_attention = ChunkAwareSDPA(documents=True if block_causal else None)
            module.attn_type = "sdpa"
        elif inner is None or isinstance(inner, ChunkAwareSDPA):
            continue
        else:
            raise ValueError(
                f"{type(inner).__name__} attention cannot be chunked by Seq1F1B: set "
                "[model] flavor to an sdpa or flex attention flavor (e.g. debugmodel, "
                "debugmodel_flex_attn, 8B)"
            )
        module.register_forward_pre_hook(_shift_rope, with_kwargs=True)
        converted += 1
    return converted


def block_causal(model_args: object) -> bool:
    """Whether the flavor masks attention at document boundaries (torchtitan's naming)."""
    return getattr(model_args, "attn_mask_type", "causal") == "block_causal"


def document_ids_from_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each token: the number of EOS tokens before it, as torchtitan's
    ``get_document_mask_mod`` numbers the documents of a packed batch (an EOS ends its
    document)."""
    ids = torch.zeros_like(tokens, dtype=torch.int64)
    ids[:, 1:] = torch.cumsum(tokens == eos_id, dim=1)[:, :-1]
    return ids


def skip_output_head(part: nn.Module) -> nn.Module:
    """The last stage's ``Transformer`` returns its normed hidden states: ``output`` stays a
    registered submodule (initialised, checkpointed, sharded and optimised as before) but the
    model's ``self.output(h) if self.output is not None else h`` reads ``None`` during the
    part's forward, so a chunked loss runs the head itself. torchtitan 0.2.2's counterpart of
    0.3's ``Decoder._skip_lm_head``; returns the head."""
    head = part.output

    def hide(module: nn.Module, _args: Any) -> None:
        module.__dict__["output"] = None  # an instance attribute shadows the submodule

    def show(module: nn.Module, _args: Any, _output: Any) -> None:
        module.__dict__.pop("output", None)

    part.register_forward_pre_hook(hide)
    part.register_forward_hook(show, always_call=True)
    return head
