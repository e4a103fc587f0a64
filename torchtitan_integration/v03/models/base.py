"""What a decoder family gives Seq1F1B in torchtitan 0.3 (:class:`ModelFamily`), and the
parts most families share: the chunk-aware swap of ``inner_attention`` and the FLOPs shape of
a ``Decoder`` config with dense or mixture-of-experts FFNs."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from seq1f1b import ModelShape

from ..model import make_chunk_aware


def _unchanged(model_config: Any) -> list[str]:
    del model_config
    return []


def decoder_shape(
    config: Any, *, head_dim: int | None = None, n_kv_heads: int | None = None
) -> ModelShape:
    """The FLOPs shape of a 0.3 ``Decoder`` config: GQA heads and head dim of its (first)
    attention layers (or the family's ``head_dim`` / ``n_kv_heads``), and the FFN width a
    token goes through (SwiGLU; for MoE layers the active width, ``top_k`` routed experts plus
    the shared ones, so FLOPs follow active parameters)."""
    attn = next(layer.attention for layer in config.layers if layer.attention is not None)
    return ModelShape(
        hidden=config.dim,
        n_heads=attn.n_heads,
        n_layers=len(config.layers),
        vocab=config.vocab_size,
        ffn_hidden=mean_ffn_hidden(config),
        ffn_total=mean_ffn_hidden(config, total_ffn_hidden),
        head_dim=head_dim or getattr(attn, "head_dim", None) or config.dim // attn.n_heads,
        n_kv_heads=n_kv_heads or getattr(attn, "n_kv_heads", None) or attn.n_heads,
        gated_ffn=True,
    )


def mean_ffn_hidden(config: Any, width: Callable[[Any], int] | None = None) -> int:
    """The FFN width a token computes (or, given :func:`total_ffn_hidden`, a layer holds),
    averaged over the layers (DeepSeek-V3's first layers are dense and wide, the rest MoE):
    the shape has one width, and FLOPs and weights add up by layer."""
    widths = [(width or active_ffn_hidden)(layer) for layer in config.layers]
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


def has_moe(config: Any) -> bool:
    """Whether any layer of a 0.3 ``Decoder`` config is a mixture of experts."""
    return any(getattr(layer, "moe", None) is not None for layer in config.layers)


def resize_experts(config: Any, *, num_experts: int, top_k: int, hidden_dim: int) -> list[str]:
    """Give every MoE layer of ``config`` ``num_experts`` routed experts of ``hidden_dim``,
    ``top_k`` a token (the router, its gate, the experts and the token dispatcher agree);
    returns what changed. The attention, the shared experts and the routing rules stay."""
    changed = 0
    for layer in config.layers:
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        router, routed = moe.router, moe.routed_experts
        layer.moe = replace(
            moe,
            num_experts=num_experts,
            router=replace(router, num_experts=num_experts, top_k=top_k,
                           gate=replace(router.gate, out_features=num_experts)),
            routed_experts=replace(
                routed,
                inner_experts=replace(routed.inner_experts, num_experts=num_experts,
                                      hidden_dim=hidden_dim),
                token_dispatcher=replace(routed.token_dispatcher, num_experts=num_experts,
                                         top_k=top_k),
            ),
        )  # fmt: skip
        changed += 1
    return [f"{changed} MoE layers: {num_experts} routed experts of width {hidden_dim}, "
            f"top {top_k}"]  # fmt: skip


class NoBf16Casts(TorchFunctionMode):
    """Within it, ``Tensor.bfloat16()`` returns the tensor as it is: a model that casts to
    bf16 by hand whatever the run's precision (torchtitan's routed experts cast their GEMM
    operands) runs in fp32. The start-up self-check bounds errors at 1e-4, and a difference
    of one fp32 ulp (a sum taken over segments) can round to one bf16 ulp (4e-3) and grow;
    the model's own code still runs, only without the casts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.bfloat16 and not kwargs and len(args) == 1:
            return args[0]
        return func(*args, **(kwargs or {}))


def total_ffn_hidden(layer: Any) -> int:
    """The SwiGLU width whose weights ``layer`` holds: dense, or MoE's every routed expert
    plus the shared ones."""
    moe = getattr(layer, "moe", None)
    if moe is None:
        return layer.feed_forward.w1.out_features
    inner = moe.routed_experts.inner_experts
    width = inner.num_experts * inner.hidden_dim
    if moe.shared_experts is not None:
        width += moe.shared_experts.w1.out_features
    return width


@dataclass(frozen=True)
class Resized:
    """A flavor of Seq1F1B's own: torchtitan's ``base`` flavor with ``resize`` applied to its
    config (a CPU-sized variant; ``resize`` returns what it changed, logged at start-up)."""

    base: str
    resize: Callable[[Any], list[str]]


@dataclass(frozen=True)
class ModelFamily:
    """One torchtitan model family (``torchtitan.models.<name>``) as Seq1F1B trains it.

    ``name`` is torchtitan's ``ModelSpec.name`` and the TOML's ``[model] name``;
    ``make_chunk_aware`` turns a built model's attention into chunk-aware attention (returns
    how many layers it converted); ``shape`` reads the FLOPs-model shape from the model config
    (for the compute split and the planner); ``adapt`` edits a model config so that it can be
    pipelined, returning what it changed (logged at start-up); ``resized`` adds flavors of
    the family's own, each a torchtitan flavor resized; the start-up self-check runs
    ``debug_flavor``, or ``debug_flavor_moe`` for a run of a mixture of experts. Positions
    come from torchtitan's dataloader in every 0.3 family (reset at each packed document), so
    no segment needs a position offset; stages are cut by torchtitan's own module names.
    """

    name: str
    configs: str = ""  # the module's flavor table, when not ``<name>_configs``
    make_chunk_aware: Callable[[nn.Module], int] = make_chunk_aware
    shape: Callable[[Any], ModelShape] = decoder_shape
    adapt: Callable[[Any], list[str]] = _unchanged
    resized: Mapping[str, Resized] = field(default_factory=dict)
    debug_flavor: str = "debugmodel"
    debug_flavor_moe: str | None = None
    #: makes a chunk-aware model's attention cache its compressed latent (``kv_cache =
    #: "latent"``; returns how many layers), for the families whose attention has one
    latent_kv: Callable[[nn.Module], int] | None = None
    #: why the family does not run with context parallelism (None: it does)
    no_context_parallel: str | None = None
    #: wraps torchtitan's parallelize_fn when the Seq1F1B schedule runs the context
    #: parallelism and torchtitan's own function would refuse it (None: called as it is)
    parallelize_under_cp: Callable[[Any], Any] | None = None
    #: what torchtitan's own tensor parallelism (``spmd_types`` backend) gets wrong in this
    #: family, warned at start-up on every rank (None: nothing known)
    tensor_parallel_note: str | None = None

    def with_kv_cache(self, kv_cache: str) -> ModelFamily:
        """This family as ``[seq1f1b] kv_cache`` wants it: unchanged for "expanded"; for
        "latent", its attention made chunk-aware and then latent-caching."""
        if kv_cache == "expanded":
            return self
        if kv_cache != "latent":
            raise ValueError(f"[seq1f1b] kv_cache = {kv_cache!r}: use 'expanded' or 'latent'")
        if self.latent_kv is None:
            raise ValueError(
                f"[seq1f1b] kv_cache = 'latent': {self.name}'s attention has no compressed "
                "K/V latent to cache (multi-head latent attention: deepseek_v3); use 'expanded'"
            )
        latent, chunk_aware = self.latent_kv, self.make_chunk_aware

        def make(model: nn.Module) -> int:
            from torchtitan.tools.logging import logger

            chunk_aware(model)
            n = latent(model)
            logger.info("Seq1F1B: %s: latent K/V cache on %d attention layers", self.name, n)
            return n

        return replace(self, make_chunk_aware=make)

    def model_spec(self, flavor: str, attn_backend: str = "flex") -> Any:
        """torchtitan's ``ModelSpec`` of ``flavor`` (or of the flavor a :attr:`resized` one
        starts from, resized), adapted (:attr:`adapt`)."""
        registry = self.module().model_registry
        flavors = self.flavors()
        if flavor not in flavors:
            raise ValueError(
                f"[model] flavor = {flavor!r} is not a {self.name} flavor: use one of "
                f"{', '.join(flavors)}"
            )
        own = self.resized.get(flavor)
        spec = registry(own.base if own else flavor, attn_backend=attn_backend)
        changes = []
        if own is not None:
            spec.flavor = flavor
            changes = [f"{own.base} resized: {c}" for c in own.resize(spec.model)]
        from torchtitan.tools.logging import logger

        for change in changes + self.adapt(spec.model):
            logger.info("Seq1F1B: %s %s: %s", self.name, flavor, change)
        return spec

    def flavors(self) -> list[str]:
        """The flavors torchtitan ships for this family, then the :attr:`resized` ones."""
        module = self.module()
        return [*getattr(module, self.configs or f"{self.name}_configs"), *self.resized]

    def module(self) -> Any:
        """``torchtitan.models.<name>``; a dependency it imports and the venv lacks is named
        (Qwen3.5 imports FLA's kernels even on CPU)."""
        try:
            return importlib.import_module(f"torchtitan.models.{self.name}")
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] == "torchtitan":
                raise
            raise ModuleNotFoundError(
                f"[model] name = {self.name!r}: torchtitan.models.{self.name} imports "
                f"{exc.name!r}, which this environment lacks (Qwen3.5: pip install fla-core, "
                "FLA's kernels, which torchtitan imports even on CPU)",
                name=exc.name,
            ) from exc

    def check_flavor(self, model_config: Any) -> str:
        """The flavor the start-up self-check runs for a run of ``model_config``: the debug
        model of the same kind (a mixture of experts when the run's model is one)."""
        if self.debug_flavor_moe is not None and has_moe(model_config):
            return self.debug_flavor_moe
        return self.debug_flavor
