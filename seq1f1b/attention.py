"""Chunk-aware causal attention: the one entry point a model needs for Seq1F1B.

Inside a ``ScheduleSeq1F1B`` unit, segment ``k`` of a sample attends to the cached K/V of
segments ``0..k-1`` (all visible) plus its own K/V (causal). The causal mask is therefore
aligned bottom-right. Outside a unit it is plain causal SDPA, so the same model also runs
unpipelined or under torch's own schedules.

Memory: the attention never concatenates the K/V prefix. It runs one kernel call per cached
block plus one causal call on its own block and merges the partial outputs by log-sum-exp; the
backward reuses the merged output and LSE, so each block's gradient comes out exact. It saves
only q, k, v, the output and the LSE; the cached blocks are referenced, not copied.

Kernels (``(out, lse)`` forward and ``(dq, dk, dv)`` backward of one block):
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), any float dtype;
* CUDA with flash-attn installed: its forward/backward kernels (not run in this project's CI:
  no GPU here);
* CUDA fp16/bf16 without flash-attn: ``aten._scaled_dot_product_flash_attention`` (not run here);
* anything else: a plain-torch math kernel (also the test oracle).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Hashable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _runtime as rt
from .kv import SegmentKV, current_unit

try:  # optional, CUDA only
    from flash_attn import flash_attn_interface as _fa  # type: ignore[import-not-found]
except Exception:
    _fa = None

__all__ = ["ChunkAwareAttention", "block_attention_kernels", "chunk_aware_attention"]

_Block = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- block kernels
def _math_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc))
    return out.to(q.dtype), lse


def _math_bwd(g, q, k, v, out, lse, causal: bool, scale: float):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_, k_, v_, g_ = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    s = torch.matmul(q_, k_.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), g_)
    dp = torch.matmul(g_, v_.transpose(-1, -2))
    delta = (g_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return ds.matmul(k_).to(q.dtype), ds.transpose(-1, -2).matmul(q_).to(k.dtype), dv.to(v.dtype)


def _cpu_fwd(q, k, v, causal: bool, scale: float):
    return rt.flash_cpu_forward(q, k, v, causal, scale)


def _cpu_bwd(g, q, k, v, out, lse, causal: bool, scale: float):
    return rt.flash_cpu_backward(g, q, k, v, out, lse, causal, scale)


def _cuda_aten_fwd(q, k, v, causal: bool, scale: float):  # pragma: no cover - GPU only
    res = rt.flash_cuda_forward(q, k, v, causal, scale)
    return res[0], res[1]


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


def _flash_attn_fwd(q, k, v, causal: bool, scale: float):  # pragma: no cover - GPU only
    # flash-attn wants (B, S, H, D)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, *_ = _fa.flash_attn_func(
        qt, kt, vt, causal=causal, softmax_scale=scale, return_attn_probs=True
    )
    return out.transpose(1, 2), lse


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
    return "math", _math_fwd, _math_bwd


# ----------------------------------------------------------------------------- autograd pieces
def _expand_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def _reduce_kv(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // n_rep, n_rep, s, d).sum(2)


class _SegmentAttention(torch.autograd.Function):
    """softmax(q [K_0..K_{k-1}, K_own]^T) [V_0..V_{k-1}, V_own], own block causal."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, kernels: tuple, *prefix: torch.Tensor):
        _, fwd, _ = kernels
        n_rep = q.shape[1] // k.shape[1]
        blocks: list[tuple[torch.Tensor, torch.Tensor, bool]] = [
            (prefix[i], prefix[i + 1], False) for i in range(0, len(prefix), 2)
        ]
        blocks.append((k, v, True))
        out_acc: torch.Tensor | None = None
        lse_acc: torch.Tensor | None = None
        for kb, vb, causal in blocks:
            o, lse = fwd(q, _expand_kv(kb, n_rep), _expand_kv(vb, n_rep), causal, scale)
            if out_acc is None:
                out_acc, lse_acc = o.to(lse.dtype), lse
                continue
            new_lse = torch.logaddexp(lse_acc, lse)
            out_acc = out_acc * torch.exp(lse_acc - new_lse).unsqueeze(-1) + o.to(
                lse.dtype
            ) * torch.exp(lse - new_lse).unsqueeze(-1)
            lse_acc = new_lse
        out = out_acc.to(q.dtype)
        ctx.scale, ctx.kernels, ctx.n_rep, ctx.n_prefix = scale, kernels, n_rep, len(prefix)
        ctx.save_for_backward(q, k, v, out, lse_acc, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        _, _, bwd = ctx.kernels
        n_rep, scale = ctx.n_rep, ctx.scale
        grads: list[torch.Tensor | None] = []
        dq = torch.zeros_like(q, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
        for i in range(0, len(prefix), 2):
            kb, vb = prefix[i], prefix[i + 1]
            dqi, dki, dvi = bwd(
                grad_out, q, _expand_kv(kb, n_rep), _expand_kv(vb, n_rep), out, lse, False, scale
            )
            dq += dqi
            grads.append(_reduce_kv(dki, n_rep) if kb.requires_grad else None)
            grads.append(_reduce_kv(dvi, n_rep) if vb.requires_grad else None)
        dqo, dko, dvo = bwd(
            grad_out, q, _expand_kv(k, n_rep), _expand_kv(v, n_rep), out, lse, True, scale
        )
        dq += dqo
        return (dq.to(q.dtype), _reduce_kv(dko, n_rep), _reduce_kv(dvo, n_rep), None, None, *grads)


class _InjectKVGrad(torch.autograd.Function):
    """Identity on (k, v) whose backward adds the grads later segments left on the cache."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, entry: SegmentKV):
        ctx.entry = entry
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        entry: SegmentKV = ctx.entry
        if entry.k.grad is not None:
            gk = entry.k.grad if gk is None else gk + entry.k.grad
        if entry.v.grad is not None:
            gv = entry.v.grad if gv is None else gv + entry.v.grad
        return gk, gv, None


# ----------------------------------------------------------------------------- entry points
def chunk_aware_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer: Hashable,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention over ``(batch, heads, seq, head_dim)`` tensors that Seq1F1B can chunk.

    ``layer`` identifies the attention layer within its stage (the calling module works), so
    checkpoint recomputation finds the same cache. ``k``/``v`` may have fewer heads than ``q``
    (grouped-query attention); they are cached un-repeated. Outside a Seq1F1B unit this is
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.
    """
    ctx = current_unit()
    n_rep = q.shape[1] // k.shape[1]
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads and k has {k.shape[1]}: the number of query heads must "
            "be a multiple of the number of K/V heads"
        )
    if ctx is None or ctx.info.num_segments == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=n_rep > 1
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    info, state = ctx.info, ctx.state
    seg = info.segment
    entries = state.layer_entries(info.microbatch, layer)
    if ctx.phase == "forward":
        if len(entries) != seg:
            raise RuntimeError(
                f"Seq1F1B: attention layer {layer!r} of stage {state.stage_index} has cached "
                f"{len(entries)} segments of sample {info.microbatch} but runs segment {seg}; "
                "each attention layer must run exactly once per unit forward"
            )
        own: SegmentKV | None = None
        if seg < info.num_segments - 1:  # later segments will read this one
            own = SegmentKV(
                k.detach().requires_grad_(ctx.keep_kv), v.detach().requires_grad_(ctx.keep_kv)
            )
        entries.append(own)
    else:  # recomputation inside this unit's backward (activation checkpointing)
        if len(entries) <= seg:
            raise RuntimeError(
                f"Seq1F1B: recomputing segment {seg} of sample {info.microbatch} on stage "
                f"{state.stage_index} but its K/V cache is gone"
            )
        own = entries[seg]
    prefix: list[torch.Tensor] = []
    for j in range(seg):
        e = entries[j]
        if e is None:
            raise RuntimeError(
                f"Seq1F1B: K/V of segment {j} (sample {info.microbatch}, stage "
                f"{state.stage_index}) was freed before segment {seg} used it"
            )
        prefix += [e.k, e.v]
    if own is not None and ctx.keep_kv:
        k, v = _InjectKVGrad.apply(k, v, own)
    return _SegmentAttention.apply(q, k, v, scale, block_attention_kernels(q), *prefix)


class ChunkAwareAttention(nn.Module):
    """Module form of :func:`chunk_aware_attention`: drop-in for a causal SDPA call.

    ``forward(q, k, v, scale=None)`` with ``(batch, heads, seq, head_dim)`` tensors; the module
    itself is the layer key, so give every attention layer its own instance.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        return chunk_aware_attention(q, k, v, layer=self, scale=scale)
