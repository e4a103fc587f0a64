"""Block attention kernels by device and dtype: torch's CPU flash kernel, flash-attn or
aten's CUDA flash kernel, and the math fallback. Each returns the log-sum-exp the tile merge
needs; the entry point (:mod:`.layer`) and the compiled custom op (:mod:`.attention_op`)
pick theirs here."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import _runtime as rt
from .head_dims import one_head_dim_backward, one_head_dim_forward
from .tiles import math_backward, math_forward

__all__ = ["block_attention_kernels", "library_kernel_ops"]

try:  # optional, CUDA only
    from flash_attn import flash_attn_interface as _fa  # type: ignore[import-not-found]
except Exception:
    _fa = None


@one_head_dim_forward
def _cpu_fwd(q, k, v, causal: bool, scale: float):
    return rt.flash_cpu_forward(q, k, v, causal, scale)


@one_head_dim_backward
def _cpu_bwd(g, q, k, v, out, lse, causal: bool, scale: float):
    return rt.flash_cpu_backward(g, q, k, v, out, lse, causal, scale)


@one_head_dim_forward
def _cuda_aten_fwd(q, k, v, causal: bool, scale: float):  # pragma: no cover - GPU only
    res = rt.flash_cuda_forward(q, k, v, causal, scale)
    return res[0], res[1]


@one_head_dim_backward
def _cuda_aten_bwd(g, q, k, v, out, lse, causal, scale):  # pragma: no cover - GPU only
    empty = torch.empty(0, device=q.device)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = rt.flash_cuda_backward(
        g.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        empty,
        empty,
        q.shape[-2],
        k.shape[-2],
        0.0,
        causal,
        zero,
        zero,
        scale=scale,
    )
    return dq, dk, dv


def _fa_call(fn: Any, **named: Any) -> Any:  # pragma: no cover - GPU only
    """Call a flash-attn internal by parameter name (its argument order varies by version)."""
    params = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in named.items() if name in params})


@one_head_dim_forward
def _flash_attn_fwd(q, k, v, causal: bool, scale: float):  # pragma: no cover - GPU only
    # flash-attn wants (B, S, H, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, *_ = _fa.flash_attn_func(
        qt, kt, vt, causal=causal, softmax_scale=scale, return_attn_probs=True
    )
    return out.transpose(1, 2), lse


@one_head_dim_backward
def _flash_attn_bwd(g, q, k, v, out, lse, causal, scale):  # pragma: no cover - GPU only
    qt, kt, vt, ot, gt = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, g))
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    _fa_call(
        _fa._flash_attn_backward,
        dout=gt,
        q=qt,
        k=kt,
        v=vt,
        out=ot,
        softmax_lse=lse,
        dq=dq,
        dk=dk,
        dv=dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size=(-1, -1),
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def block_attention_kernels(t: torch.Tensor) -> tuple[str, Any, Any]:
    """Pick the (name, forward, backward) block kernels for a tensor's device and dtype."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return "cpu_flash", _cpu_fwd, _cpu_bwd
    if t.device.type == "cuda" and t.dtype in (torch.float16, torch.bfloat16):  # pragma: no cover
        if _fa is not None:
            return "flash_attn", _flash_attn_fwd, _flash_attn_bwd
        return "cuda_flash", _cuda_aten_fwd, _cuda_aten_bwd
    return "math", math_forward, math_backward


def library_kernel_ops() -> set[Any]:
    """The op overloads of the block kernels that come from an installed library, not torch:
    flash-attn's forward where it registers one with torch (empty without flash-attn). torch's
    own flash kernels are on every selective-checkpointing policy's save list already."""
    if _fa is None:
        return set()
    op = rt.flash_attn_forward_op()  # pragma: no cover - flash-attn is CUDA only
    return set() if op is None else {op}  # pragma: no cover
