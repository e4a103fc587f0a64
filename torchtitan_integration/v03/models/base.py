"""What a decoder family gives Seq1F1B in torchtitan 0.3 (:class:`ModelFamily`), and the
parts most families share: the chunk-aware swap of ``inner_attention`` and the FLOPs shape of
a ``Decoder`` config with dense or mixture-of-experts FFNs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from seq1f1b import ModelShape

from ..model import make_chunk_aware


def _unchanged(model_config: Any) -> list[str]:
    del model_config
    return []


def decoder_shape(
    config: Any, *, head_dim: int | None = None, n_kv_heads: int | None = None
) -> ModelShape:
    """The FLOPs shape of a 0.3 ``Decoder`` config: GQA heads and head dim (or the family's
    ``head_dim`` / ``n_kv_heads``), and the FFN width a token goes through (SwiGLU; for MoE
    layers the active width, ``top_k`` routed experts plus the shared ones, so FLOPs follow
    active parameters)."""
    attn = config.layers[0].attention
    return ModelShape(
        hidden=config.dim,
        n_heads=attn.n_heads,
        n_layers=len(config.layers),
        vocab=config.vocab_size,
        ffn_hidden=mean_ffn_hidden(config),
        head_dim=head_dim or getattr(attn, "head_dim", None) or config.dim // attn.n_heads,
        n_kv_heads=n_kv_heads or getattr(attn, "n_kv_heads", None) or attn.n_heads,
        gated_ffn=True,
    )


def mean_ffn_hidden(config: Any) -> int:
    """The FFN width a token computes, averaged over the layers (DeepSeek-V3's first layers
    are dense and wide, the rest MoE): the shape has one width, and FLOPs add up by layer."""
    widths = [active_ffn_hidden(layer) for layer in config.layers]
    return round(sum(widths) / len(widths))


def active_ffn_hidden(layer: Any) -> int:
    """The SwiGLU width one token's FFN computes in ``layer``: dense, or MoE's active experts."""
    moe = getattr(layer, "moe", None)
    if moe is None:
        return layer.feed_forward.w1.out_features
    width = moe.router.top_k * moe.routed_experts.inner_experts.hidden_dim
    if moe.shared_experts is not None:
        width += moe.shared_experts.w1.out_features
    return width


@dataclass(frozen=True)
class ModelFamily:
    """One torchtitan model family (``torchtitan.models.<name>``) as Seq1F1B trains it.

    ``name`` is torchtitan's ``ModelSpec.name`` and the TOML's ``[model] name``;
    ``make_chunk_aware`` turns a built model's attention into chunk-aware attention (returns
    how many layers it converted); ``shape`` reads the FLOPs-model shape from the model config
    (for the compute split and the planner); ``adapt`` edits a model config so that it can be
    pipelined, returning what it changed (logged at start-up). Positions come from torchtitan's
    dataloader in every 0.3 family (reset at each packed document), so no segment needs a
    position offset; stages are cut by torchtitan's own module names.
    """

    name: str
    configs: str = ""  # the module's flavor table, when not ``<name>_configs``
    make_chunk_aware: Callable[[nn.Module], int] = make_chunk_aware
    shape: Callable[[Any], ModelShape] = decoder_shape
    adapt: Callable[[Any], list[str]] = _unchanged

    def model_spec(self, flavor: str, attn_backend: str = "flex") -> Any:
        """torchtitan's ``ModelSpec`` of ``flavor``, adapted (:attr:`adapt`)."""
        registry = importlib.import_module(f"torchtitan.models.{self.name}").model_registry
        flavors = self.flavors()
        if flavor not in flavors:
            raise ValueError(
                f"[model] flavor = {flavor!r} is not a torchtitan {self.name} flavor: use one "
                f"of {', '.join(flavors)}"
            )
        spec = registry(flavor, attn_backend=attn_backend)
        from torchtitan.tools.logging import logger

        for change in self.adapt(spec.model):
            logger.info("Seq1F1B: %s %s: %s", self.name, flavor, change)
        return spec

    def flavors(self) -> list[str]:
        """The flavors torchtitan ships for this family."""
        module = importlib.import_module(f"torchtitan.models.{self.name}")
        return list(getattr(module, self.configs or f"{self.name}_configs"))
