"""GPT-OSS (``torchtitan.models.gpt_oss``): learned attention sinks, sliding windows, MoE.

Its attention calls ``inner_attention(q, k, v, ..., out_transform=...)``, the transform being
the sink rescale ``out * sigmoid(lse - sink)`` of each head: the chunk-aware attention hands
it the log-sum-exp merged over every segment's keys, so the sinks apply once to the whole
softmax (never per tile or per segment) and their gradient, and the LSE's, are exact; with
context parallelism that LSE is merged over the ring too (each CP rank's queries over every
key they see, ``seq1f1b.attention.context_parallel``), so the sinks apply once there as well.
Even layers attend within a sliding window of 128 keys, odd ones to everything: each layer's
chunk-aware attention gets its window from the model config, and an earlier segment's K/V is
kept only from the first position a later query still sees: at most its last window - 1 (127)
positions, each held until that segment's backward, so a windowed layer caches up to
(K - 1) x (window - 1) positions of a sample (``seq1f1b.attention.masks.first_seen``,
``seq1f1b.attention.kv.cache_entry``; docs/masks.md), against K - 1 whole segments for a full
layer. torchtitan 0.3's ``GptOssGroupedExperts`` returns its bf16 GEMM result
uncast (``GroupedExperts`` casts it back with ``.type_as(x)``), which breaks the experts'
combine in an fp32 run: a forward hook casts it back (upstream fix: the same ``type_as`` in
``GptOssGroupedExperts.forward``). ``debugmodel_cpu`` is Seq1F1B's own: torchtitan's
``debugmodel`` with its 8 experts of width 2880 (top 4) narrowed to width 256, top 2, for a
2-core CPU.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch import nn

from seq1f1b import ModelShape

from ..model import make_chunk_aware
from .base import ModelFamily, Resized, decoder_shape, resize_experts

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _input_dtype(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    del module
    return out.to(args[0].dtype)


def experts_in_input_dtype(model: nn.Module) -> int:
    """Cast each ``GptOssGroupedExperts``' output to its input's dtype (see the module
    docstring); returns how many. Idempotent."""
    count = 0
    for module in model.modules():
        if type(module).__name__ == "GptOssGroupedExperts":
            if not getattr(module, "_seq1f1b_cast", False):
                module.register_forward_hook(_input_dtype)
                module._seq1f1b_cast = True
            count += 1
    return count


def chunk_aware_with_windows(model: nn.Module) -> int:
    """:func:`make_chunk_aware` with each layer's sliding window (``sliding_window_size`` of
    its attention config; None on full-attention layers), and :func:`experts_in_input_dtype`.
    Idempotent."""
    experts_in_input_dtype(model)
    layers = model.config.layers

    def window_of(name: str, attention: nn.Module) -> int | None:
        del attention
        found = _LAYER.search(name)
        if found is None:
            raise ValueError(f"{name}: an attention outside layers.<i> (GPT-OSS has none)")
        return layers[int(found.group(1))].attention.sliding_window_size

    return make_chunk_aware(model, window_of)


def windowed_shape(config: Any) -> ModelShape:
    """The FLOPs shape of a GPT-OSS config, its windowed layers' window included."""
    windows = [layer.attention.sliding_window_size for layer in config.layers]
    sizes = {w for w in windows if w is not None}
    shape = decoder_shape(config)
    if not sizes:
        return shape
    if len(sizes) > 1:
        raise ValueError(f"GPT-OSS layers with different windows {sorted(sizes)}: one expected")
    return dataclasses.replace(
        shape, window=sizes.pop(), window_layers=sum(w is not None for w in windows)
    )


def cpu_sized(model_config: Any) -> list[str]:
    """``debugmodel`` at a 2-core CPU's size (see the module docstring)."""
    return resize_experts(model_config, num_experts=8, top_k=2, hidden_dim=256)


FAMILY = ModelFamily(
    name="gpt_oss",
    configs="gptoss_configs",
    make_chunk_aware=chunk_aware_with_windows,
    shape=windowed_shape,
    resized={"debugmodel_cpu": Resized("debugmodel", cpu_sized)},
    debug_flavor="debugmodel_cpu",
    tensor_parallel_note=(
        "torchtitan 0.3's GptOssGroupedExperts reads its TP degree from DTensor parameters "
        "only, which spmd_types does not make, so each TP rank adds the experts' output bias "
        "to its partial sum: the bias counts tensor_parallel_degree times (step 1's loss on "
        "the debug model: 8.121 with TP = 2, 8.147 without). Seq1F1B matches torchtitan's "
        "PP=1 under the same TP; the fix is upstream (the degree from the TP mesh)"
    ),
)
