"""Causal attention patterns as FlexAttention ``mask_mod`` objects for
``ChunkAwareAttention(mask_mod=...)`` (docs/masks.md).

Why objects: a mask is planned once per segment shape and cached by its value, and runs on
every pipeline rank, so it must be hashable and picklable; frozen dataclasses are both. Each is
causal (a key never after its query) and reads absolute positions only. ``block``: the
planning granularity, the size of the blocks that are skipped whole or computed whole.

The third source document (sequence parallelism with ring self-attention) pairs ring attention
with sparse attentions: BigBird (global + window + random blocks) made causal is
:class:`CausalBigBird`; Linformer's projection of the keys along the whole sequence is not a
mask and cannot be cut into segments (a segment's output would depend on later positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import MASK_BLOCK

__all__ = ["CausalBigBird", "VisiblePrefix"]


@dataclass(frozen=True)
class CausalBigBird:
    """BigBird made causal: the first ``global_tokens`` positions visible to every later query,
    a sliding ``window`` (keys per query, itself included), and random blocks: each earlier key
    block of ``block`` positions is visible to a query block with probability ``density``,
    drawn by hashing the two block numbers with ``seed`` (the same on every rank, step and
    sequence length)."""

    global_tokens: int
    window: int
    density: float
    seed: int = 0
    block: int = MASK_BLOCK

    def __call__(self, b: object, h: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        del b, h
        qb, kb = q // self.block, k // self.block
        mixed = (qb * 1_000_003 + kb * 998_244_353 + self.seed * 7_919 + 12_345) % 1_000_033
        random = (mixed % 1000 < int(self.density * 1000)) & (kb < qb)
        return (k <= q) & ((k < self.global_tokens) | (q - k < self.window) | random)


@dataclass(frozen=True)
class VisiblePrefix:
    """The first ``prefix`` positions (a shared prompt) visible to every later query, a sliding
    ``window`` for the rest: causal, so the prefix's own queries see only what precedes them
    (a bidirectional prefix looks forward and is refused)."""

    prefix: int
    window: int
    block: int = MASK_BLOCK

    def __call__(self, b: object, h: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        del b, h
        return (k <= q) & ((k < self.prefix) | (q - k < self.window))
