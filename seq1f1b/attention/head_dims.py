"""Attention whose values have another head dim than its queries and keys (DeepSeek-V3's
MLA: q/k 192, v 128) through flash kernels that take one head dim for all three.

The smaller side is padded with zeros to the larger for the kernel call only (the K/V cache
keeps the model's widths): zero value columns give zero output columns, sliced off, with the
same log-sum-exp; zero query/key columns add nothing to a score. The scale is the caller's
(always explicit here), so padding never changes it. Backward pads the output and its gradient
the same way and slices each gradient back to its input's width. Upstream hook that would
remove this: flash kernels taking ``v.shape[-1] != q.shape[-1]`` (aten's CPU and CUDA flash
attention check "Q/K/V should have the same head size").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["one_head_dim_backward", "one_head_dim_forward"]


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def one_head_dim_forward(fwd: Callable[..., Any]) -> Callable[..., Any]:
    """``fwd(q, k, v, ...) -> (out, lse)`` for any value head dim."""

    @functools.wraps(fwd)
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return fwd(q, k, v, *args, **kwargs)
        d = max(dqk, dv)
        out, lse = fwd(_pad(q, d), _pad(k, d), _pad(v, d), *args, **kwargs)
        return out[..., :dv], lse

    return run


def one_head_dim_backward(bwd: Callable[..., Any]) -> Callable[..., Any]:
    """``bwd(g, q, k, v, out, lse, ...) -> (dq, dk, dv)`` for any value head dim."""

    @functools.wraps(bwd)
    def run(g, q, k, v, out, lse, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return bwd(g, q, k, v, out, lse, *args, **kwargs)
        d = max(dqk, dv)
        grads = bwd(_pad(g, d), _pad(q, d), _pad(k, d), _pad(v, d), _pad(out, d), lse,
                    *args, **kwargs)  # fmt: skip
        dq, dk, dvv = grads[0], grads[1], grads[2]
        return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]

    return run
