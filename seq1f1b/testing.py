"""A tiny Llama-style causal transformer, cut into pipeline stages, for tests and examples.

It is the smallest model that exercises what Seq1F1B must get right: causal attention through
:func:`seq1f1b.chunk_aware_attention` (grouped-query), RoPE at absolute positions taken from the
running segment, SwiGLU, RMSNorm, optional activation checkpointing per block; optionally a
hybrid stack whose other layers are Gated DeltaNet (a recurrent state carried between segments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention.attention_op import segment_positions
from .attention.gated_deltanet import ChunkAwareGatedDeltaNet
from .attention.layer import ChunkAwareAttention

__all__ = ["TinyConfig", "TinyStage", "build_stages", "full_model", "rope_positions"]


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 4
    ffn: int = 64
    rope_theta: float = 10000.0
    window: int | None = None  # sliding window of the even layers (odd layers: global)
    sinks: int = 0
    #: hybrid stacks (Qwen3.5): layer i attends when i % full_attention_every is the last
    #: residue, the others are Gated DeltaNet (recurrent state carried across segments)
    full_attention_every: int = 1
    #: every attention layer's ``mask_mod`` (:mod:`seq1f1b.attention.mask_mods`), or None
    mask_mod: Any = None


def rope_positions(x: torch.Tensor) -> torch.Tensor:
    """Absolute positions of the tokens of ``x`` (batch, seq, ...): the running segment's, or
    0..S-1 (an op, so compiled blocks are not specialised to one segment)."""
    return segment_positions(x, dim=1)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.dim // cfg.n_heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        every = cfg.full_attention_every
        self.delta_net = None
        if index % every != every - 1:  # a Gated DeltaNet layer: no softmax attention
            self.delta_net = ChunkAwareGatedDeltaNet(cfg.dim, cfg.n_kv_heads, cfg.n_heads, hd, hd)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
            self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
            self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
            self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
            local = cfg.window is not None and index % 2 == 0  # Gemma-style local/global
            self.attn = ChunkAwareAttention(
                cfg.window if local else None, cfg.sinks if local else 0, mask_mod=cfg.mask_mod
            )
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + (self.delta_net(h) if self.delta_net is not None else self._attention(h, x))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def _attention(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        hd = self.cfg.dim // self.cfg.n_heads
        # -1 heads: this rank's under tensor parallelism (ColwiseParallel's local outputs);
        # positions of ``h``, the whole sequence under sequence parallelism (``x``: a shard)
        q = self.wq(h).view(b, s, -1, hd).transpose(1, 2)
        k = self.wk(h).view(b, s, -1, hd).transpose(1, 2)
        v = self.wv(h).view(b, s, -1, hd).transpose(1, 2)
        pos = rope_positions(h)
        q, k = _rope(q, pos, self.cfg.rope_theta), _rope(k, pos, self.cfg.rope_theta)
        return self.wo(self.attn(q, k, v).transpose(1, 2).reshape(b, s, -1))


class TinyStage(nn.Module):
    """Layers ``[lo, hi)`` of the model; the first stage embeds, the last one projects."""

    def __init__(
        self,
        cfg: TinyConfig,
        first: bool,
        last: bool,
        n_layers: int,
        checkpointing: bool = False,
        first_layer: int = 0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim) if first else None
        self.layers = nn.ModuleList(Block(cfg, first_layer + i) for i in range(n_layers))
        self.norm = nn.RMSNorm(cfg.dim) if last else None
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False) if last else None
        self.checkpointing = checkpointing
        self.skip_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        if self.head is not None:
            x = self.norm(x)
            if not self.skip_head:  # (torchtitan's _skip_lm_head: a ChunkedLoss runs the head)
                x = self.head(x)
        return x


def build_stages(
    cfg: TinyConfig, num_stages: int, seed: int = 0, checkpointing: bool = False
) -> list[TinyStage]:
    """All stages of one model, built deterministically so every rank gets the same weights."""
    if cfg.n_layers % num_stages:
        raise ValueError(f"n_layers={cfg.n_layers} is not divisible by num_stages={num_stages}")
    torch.manual_seed(seed)
    per = cfg.n_layers // num_stages
    return [
        TinyStage(cfg, i == 0, i == num_stages - 1, per, checkpointing, i * per)
        for i in range(num_stages)
    ]


def full_model(stages: list[TinyStage]) -> nn.Sequential:
    """The unpipelined reference: the same stage modules run in sequence."""
    return nn.Sequential(*stages)
