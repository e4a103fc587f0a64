"""The decoder families Seq1F1B trains in torchtitan 0.3, one module each, holding only what
differs between them (:class:`.base.ModelFamily`). Supporting another decoder is one module
here, one entry in :data:`FAMILIES` and a test."""

from __future__ import annotations

from typing import Any

from . import deepseek_v3, gpt_oss, llama3, qwen3, qwen3_5
from .base import (
    ModelFamily,
    NoBf16Casts,
    Resized,
    active_ffn_hidden,
    decoder_shape,
    has_moe,
    mean_ffn_hidden,
    resize_experts,
)

__all__ = [
    "FAMILIES",
    "ModelFamily",
    "NoBf16Casts",
    "Resized",
    "active_ffn_hidden",
    "decoder_shape",
    "family",
    "family_of",
    "has_moe",
    "mean_ffn_hidden",
    "resize_experts",
]

FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (llama3.FAMILY, qwen3.FAMILY, deepseek_v3.FAMILY, gpt_oss.FAMILY, qwen3_5.FAMILY)
}


def family(name: str) -> ModelFamily:
    """The family called ``name`` (``[model] name``), or a refusal listing the supported ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"[model] name = {name!r}: Seq1F1B's torchtitan integration trains "
            f"{', '.join(FAMILIES)} (torchtitan.models.<name>); a decoder it does not know "
            "could be adapted wrongly, so it is refused (docs/models.md: adding one is a "
            "module in torchtitan_integration/v03/models)"
        ) from None


def family_of(model_spec: Any, kv_cache: str = "expanded") -> ModelFamily:
    """The family of a torchtitan ``ModelSpec`` (by its ``name``), with ``[seq1f1b] kv_cache``."""
    return family(model_spec.name).with_kv_cache(kv_cache)
