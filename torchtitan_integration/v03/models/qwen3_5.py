"""Qwen3.5 (``torchtitan.models.qwen3_5``): a hybrid stack of Gated DeltaNet layers and, every
4th layer, gated full attention with partial MRoPE; dense or MoE FFNs; a vision encoder.

Two kinds of layer carry something between segments. The full-attention layers call
``inner_attention(q, k, v, ...)`` like every other family and get the chunk-aware attention
(their MRoPE takes the dataloader's ``positions``, which the schedule cuts per segment). Each
Gated DeltaNet layer carries two states (:func:`seq1f1b.carried_state`): the last three
inputs of its q/k/v convolutions and the delta-rule state (value heads x key dim x value
dim); its forward becomes :func:`chunk_aware_deltanet_forward`, torchtitan's own projections,
convolution weights, gates and norm around Seq1F1B's kernels (FLA's chunked kernel with an
initial and a final state on CUDA, the pure-torch chunked form on CPU), with packed documents
restarting both states. Under context parallelism both states also pass from CP rank to CP
rank within each segment (a scan over the ranks, :mod:`seq1f1b.attention.carried_cp`).
The text-only language model trains; the vision encoder is not part of a pipeline stage
(torchtitan's ``pipeline_vlm`` puts it on the first stage, for images).
``debugmodel_cpu`` is Seq1F1B's own: torchtitan's ``debugmodel`` with its 248,320-token
vocabulary cut to 2,048 (the shipped tokenizer's), for a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seq1f1b import LinearAttention, ModelShape, add_layer_key
from seq1f1b.attention.gated_deltanet import gated_deltanet_core

from ..model import make_chunk_aware
from .base import ModelFamily, Resized, decoder_shape


def chunk_aware_deltanet_forward(
    self: nn.Module, x_BLD: torch.Tensor, attention_masks: Any = None
) -> torch.Tensor:
    """torchtitan 0.3's ``GatedDeltaNet.forward`` with the convolution tails and the
    delta-rule state carried across segments; the documents come with the step (as for the
    attention), so ``attention_masks`` is not read."""
    del attention_masks
    b, length, _ = x_BLD.shape
    dk, dv = self.key_head_dim, self.value_head_dim
    q, k, v = self.in_proj_q(x_BLD), self.in_proj_k(x_BLD), self.in_proj_v(x_BLD)
    n_k, n_v = q.shape[-1] // dk, v.shape[-1] // dv
    weight = torch.cat([self.conv_q.weight, self.conv_k.weight, self.conv_v.weight], 0)
    g = -torch.exp(self.A_log.float()) * F.softplus(self.in_proj_a(x_BLD).float() + self.dt_bias)
    beta = torch.sigmoid(self.in_proj_b(x_BLD))
    out = gated_deltanet_core(
        self.seq1f1b_state, torch.cat([q, k, v], -1), weight, g, beta, (n_k, dk, n_v, dv),
        anchor=x_BLD,
    )  # fmt: skip
    out = self.norm(out, self.in_proj_z(x_BLD).view(b, length, n_v, dv))
    return self.out_proj(out.reshape(b, length, n_v * dv))


def text_embeds(
    self: nn.Module,
    tokens: torch.Tensor,
    *,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen35Model._prepare_multimodal_embeds`` for text: the token embeddings (torchtitan's
    reads the image and video token ids from ``special_tokens``, which only its multimodal
    dataloader passes)."""
    del kwargs
    if pixel_values is not None or pixel_values_videos is not None:
        raise NotImplementedError(
            "Seq1F1B trains Qwen3.5's language model on text: images and videos would need "
            "the vision encoder on the first stage and the vision tokens cut per segment"
        )
    return self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens


def make_hybrid_chunk_aware(model: nn.Module) -> int:
    """The attention layers' inner attention made chunk-aware, every Gated DeltaNet layer's
    forward replaced by :func:`chunk_aware_deltanet_forward`, and the embedding text-only
    (:func:`text_embeds`); returns how many layers of either kind. Idempotent."""
    if hasattr(model, "_prepare_multimodal_embeds"):
        model._prepare_multimodal_embeds = text_embeds.__get__(model)
    converted = make_chunk_aware(model)
    for module in model.modules():
        if type(module).__name__ == "GatedDeltaNet":
            if not getattr(module, "_seq1f1b_chunk_aware", False):
                module.forward = chunk_aware_deltanet_forward.__get__(module)
                module._seq1f1b_chunk_aware = True
                # names its carried state under torch.compile: a plain child module's buffer
                # (torchtitan wants a placement for every buffer of its own modules)
                module.seq1f1b_state = add_layer_key(nn.Module())
            converted += 1
    return converted


def hybrid_shape(config: Any) -> ModelShape:
    """The FLOPs shape of a Qwen3.5 config: the full-attention layers' heads and head dim
    (:func:`decoder_shape`), and the Gated DeltaNet layers (:class:`seq1f1b.LinearAttention`:
    linear in the length, a state carried per sample)."""
    deltanet = [layer.delta_net for layer in config.layers if layer.delta_net is not None]
    if not deltanet:
        return decoder_shape(config)
    dn = deltanet[0]
    linear = LinearAttention(
        len(deltanet),
        dn.in_proj_q.out_features // dn.key_head_dim,
        dn.in_proj_v.out_features // dn.value_head_dim,
        dn.key_head_dim,
        dn.value_head_dim,
        dn.conv_kernel_size,
    )
    return dataclasses.replace(decoder_shape(config), linear_attention=linear)


class _PastTheCPRefusal:
    """torchtitan's ``parallel_dims`` for one ``parallelize_qwen3_5`` call whose first read of
    ``cp_enabled`` (the refusal) says False; every later read (the FSDP mesh over the CP
    ranks, under the ``spmd_types`` backend) and every other name are the real object's."""

    def __init__(self, dims: Any) -> None:
        self._dims = dims
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)

    @property
    def cp_enabled(self) -> bool:
        self.reads += 1
        return self.reads > 1 and bool(self._dims.cp_enabled)


def parallelize_under_cp(parallelize_fn: Callable[..., Any]) -> Callable[..., Any]:
    """torchtitan 0.3's ``parallelize_qwen3_5`` under the Seq1F1B schedule's context
    parallelism. It refuses CP first thing, because torchtitan's own CP would all-gather the
    whole sequence for the Gated DeltaNet layers; here the schedule runs the CP (the ring for
    attention, the state's scan for Gated DeltaNet) and torchtitan's function only has to
    shard over the CP mesh (FSDP), so its refusal is shown ``cp_enabled = False``
    (:class:`_PastTheCPRefusal`; checked against torchtitan 0.3.0: a release that reads it
    nowhere fails here, not silently)."""

    @functools.wraps(parallelize_fn)
    def call(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> nn.Module:
        view = _PastTheCPRefusal(parallel_dims)
        out = parallelize_fn(model, parallel_dims=view, **kwargs)
        if view.reads == 0:
            raise RuntimeError(
                "Seq1F1B: torchtitan's parallelize_qwen3_5 no longer reads "
                "parallel_dims.cp_enabled, so the refusal this integration steps past "
                "(checked against torchtitan 0.3.0) has changed: check what it does under CP"
            )
        return out

    return call


def cpu_sized(model_config: Any) -> list[str]:
    """``debugmodel`` with the shipped tokenizer's 2,048-token vocabulary."""
    vocab = 2048
    model_config.vocab_size = vocab
    model_config.tok_embeddings = dataclasses.replace(
        model_config.tok_embeddings, num_embeddings=vocab
    )
    model_config.lm_head = dataclasses.replace(model_config.lm_head, out_features=vocab)
    return [f"vocabulary {vocab}"]


FAMILY = ModelFamily(
    name="qwen3_5",
    make_chunk_aware=make_hybrid_chunk_aware,
    shape=hybrid_shape,
    resized={"debugmodel_cpu": Resized("debugmodel", cpu_sized)},
    debug_flavor="debugmodel_cpu",
    parallelize_under_cp=parallelize_under_cp,
)
