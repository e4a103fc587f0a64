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
from .context_parallel import cp_attention
from .kv import (
    InjectKVGrad,
    SegmentInfo,
    SegmentKV,
    accumulate_cache_grads,
    cached_entry,
    current_documents,
    current_unit,
    inferring_metadata,
    segment_entries,
)
from .masks import MaskSpec, RowGroups, plan_tiles
from .tiles import (
    PlanEntry,
    accumulator_dtype,
    kv_blocks,
    math_backward,
    math_forward,
    merge,
    place_tiles,
    run_tiles_backward,
    run_tiles_forward,
)

try:  # optional, CUDA only
    from flash_attn import flash_attn_interface as _fa  # type: ignore[import-not-found]
except Exception:
    _fa = None

__all__ = ["ChunkAwareAttention", "block_attention_kernels", "chunk_aware_attention"]

_Block = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- block kernels
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
    return "math", math_forward, math_backward


# ---------------------------------------------------------------------- FlexAttention forward
def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return True


_COMPILED_FLEX: list[Any] = []


def _flex_fn(device: torch.device) -> Any:
    """torch's flex_attention: compiled on GPU (its fast path), eager elsewhere (CPU: unfused,
    forward only; used here to check the GPU path's masks and merge)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if not _COMPILED_FLEX:  # pragma: no cover - GPU only
        _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED_FLEX[0]  # pragma: no cover


def _document_index(groups: RowGroups, batch: int, seq_len: int, device: torch.device):
    """(batch, seq_len) document number of every position (for FlexAttention's mask_mod)."""
    out = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
    for r0, r1, runs in groups:
        for doc, (s, e) in enumerate(runs):
            out[r0:r1, s:e] = doc
    return out


def _flex_block_fwd(q, k, v, q0: int, k0: int, docs, spec: MaskSpec, scale: float):
    """One (segment, block) pair in one FlexAttention call: causal + documents + window +
    sinks at absolute offsets ``q0`` / ``k0``; rows that see nothing come back as -inf LSE."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    window, sinks = spec.window, spec.sinks

    def mask_mod(b, h, qi, ki):
        qa, ka = qi + q0, ki + k0
        vis = (ka <= qa) & (docs[b, qa] == docs[b, ka])
        if window is not None:
            vis = vis & ((qa - ka < window) | (ka < sinks))
        return vis

    lq, lk = q.shape[-2], k.shape[-2]
    mask = create_block_mask(mask_mod, q.shape[0], None, lq, lk, device=q.device)
    out, aux = _flex_fn(q.device)(
        q.detach(), k.detach(), v.detach(), block_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    lse = aux.lse
    empty = ~torch.isfinite(lse) | (lse == 0) & (out == 0).all(-1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


class _SegmentAttention(torch.autograd.Function):
    """softmax(q [K_0..K_{k-1}, K_own]^T) [V_0..V_{k-1}, V_own] over the planned tiles only.

    ``plan`` says which rectangles run (block -1: the segment's own K/V, block j: prefix block
    j); ``entries`` are the cache entries of the prefix blocks (their ``start``: absolute
    position of the first cached key), ``q_start`` the segment's. Outputs and LSEs of the tiles
    are merged per query row, so no K/V is ever concatenated or copied.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, kernels, plan, spec, q_start, entries, flex_docs, *prefix):
        acc = accumulator_dtype(q)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        blocks = kv_blocks(k, v, prefix)
        if flex_docs is not None:  # one FlexAttention call per block the plan touches
            starts = tuple(e.start for e in entries)
            for block in sorted({entry[0] for entry in plan}):
                kb, vb = blocks[block]
                off = q_start if block < 0 else starts[block]
                o, lse = _flex_block_fwd(q, kb, vb, q_start, off, flex_docs, spec, scale)
                out_acc, lse_acc = merge(out_acc, lse_acc, o, lse.to(acc))
        else:
            run_tiles_forward(q, blocks, plan, spec, scale, kernels, out_acc, lse_acc)
        out = out_acc.to(q.dtype)
        ctx.scale, ctx.kernels, ctx.plan, ctx.spec = scale, kernels, plan, spec
        ctx.entries = entries
        ctx.save_for_backward(q, k, v, out, lse_acc, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=accumulator_dtype(q), device=q.device)
        dkv: dict[int, list[torch.Tensor]] = {}
        run_tiles_backward(
            grad_out, q, out, lse, kv_blocks(k, v, prefix), ctx.plan, ctx.spec, ctx.scale,
            ctx.kernels, dq, dkv,
        )  # fmt: skip
        own = dkv.get(-1)
        dk = None if own is None else own[0].to(k.dtype)
        dv = None if own is None else own[1].to(v.dtype)
        accumulate_cache_grads(ctx.entries, dkv)
        nones = (None,) * len(prefix)
        return (dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None, *nones)


# ----------------------------------------------------------------------------- entry points
def chunk_aware_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layer: Hashable,
    scale: float | None = None,
    window: int | None = None,
    sinks: int = 0,
    documents: bool | None = None,
    mask_backend: str = "auto",
) -> torch.Tensor:
    """Causal attention over ``(batch, heads, seq, head_dim)`` tensors that Seq1F1B can chunk.

    ``layer`` identifies the attention layer within its stage (the calling module works), so
    checkpoint recomputation finds the same cache. ``k``/``v`` may have fewer heads than ``q``
    (grouped-query attention); they are cached un-repeated.

    Masks beyond causal: ``window`` (sliding window: keys per query, itself included) with
    ``sinks`` first positions always visible, per layer; packed documents come with the batch
    (``step(..., document_ids=...)``, or :func:`seq1f1b.packed_documents` outside a step).
    ``documents=True`` says this layer needs them (an error if the batch has none), ``False``
    that it must ignore them. Outside a unit and without masks this is
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

    ``mask_backend`` for masked attention: "tiles" (whole-tile flash kernels, thin masked
    strips), "flex" (one FlexAttention call per visible block for the forward; the backward
    runs the tiles), or "auto": flex on CUDA, tiles elsewhere.
    """
    if mask_backend not in ("auto", "tiles", "flex"):
        raise ValueError(f"mask_backend={mask_backend!r}: use 'auto', 'tiles' or 'flex'")
    ctx = current_unit()
    n_rep = q.shape[1] // k.shape[1]
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads and k has {k.shape[1]}: the number of query heads must "
            "be a multiple of the number of K/V heads"
        )
    spec = MaskSpec(window, sinks)
    if q.device.type == "meta" or (ctx is None and inferring_metadata()):
        # the pipeline stage's shape inference: only shapes matter
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
    groups = None if documents is False else current_documents()
    if documents and groups is None:
        raise ValueError(
            f"attention layer {layer!r} needs packed-document ids (documents=True) but the batch "
            "has none: pass step(..., document_ids=ids), or wrap the call in "
            "seq1f1b.packed_documents(ids) outside a pipeline step"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    plain = groups is None and spec.window is None
    if ctx is not None and ctx.info.cp is not None:  # sharded over a context-parallel group
        groups = groups or ((0, q.shape[0], ((0, ctx.info.seq_len),)),)
        skip = ctx.state.skip_invisible or plain
        kernels = block_attention_kernels(q)
        return cp_attention(q, k, v, ctx, layer, groups, spec, scale, kernels, skip)
    if ctx is None or ctx.info.num_segments == 1:
        if plain:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=n_rep > 1
            )
        seq = q.shape[-2]
        start = 0 if ctx is None else ctx.info.start
        groups = groups or ((0, q.shape[0], ((0, start + seq),)),)
        run = ((start, start + seq),)
        plan = tuple(place_tiles(run, run, groups, spec, -1))
        docs = _flex_documents(mask_backend, q, groups, start + seq)
        return _SegmentAttention.apply(
            q, k, v, scale, block_attention_kernels(q), plan, spec, start, (), docs
        )
    info, state = ctx.info, ctx.state
    groups = groups or ((0, q.shape[0], ((0, info.seq_len),)),)
    seg = info.segment
    entries, own = segment_entries(
        ctx,
        layer,
        lambda: _cache_entry(k, v, info, groups, spec, ctx.keep_kv, state.skip_invisible or plain),
    )
    prefix: list[torch.Tensor] = []
    used: list[SegmentKV] = []
    plan: list[PlanEntry] = []
    bounds, skip = info.bounds, state.skip_invisible or plain
    own_run = ((info.start, info.end),)
    for j in range(seg):
        tiles = plan_tiles(info.start, info.end, bounds[j], bounds[j + 1], groups, spec, skip)
        if not tiles:
            continue  # nothing of segment j is visible: no kernel call, no K/V needed
        e = cached_entry(ctx, entries, j)
        cached = ((e.start, bounds[j + 1]),)
        plan += place_tiles(own_run, cached, groups, spec, len(used), skip)
        prefix += [e.k, e.v]
        used.append(e)
    plan += place_tiles(own_run, own_run, groups, spec, -1, skip)
    if own is not None and ctx.keep_kv:
        k, v = InjectKVGrad.apply(k, v, own, own.start - info.start)
    return _SegmentAttention.apply(
        q,
        k,
        v,
        scale,
        block_attention_kernels(q),
        tuple(plan),
        spec,
        info.start,
        tuple(used),
        None if plain else _flex_documents(mask_backend, q, groups, info.seq_len),
        *prefix,
    )


def _flex_documents(backend: str, q: torch.Tensor, groups: RowGroups, seq_len: int):
    """The document index FlexAttention's mask reads, when that backend runs; else None."""
    use = backend == "flex" or (backend == "auto" and q.device.type == "cuda")
    if not use or not _flex_available():
        return None
    return _document_index(groups, q.shape[0], seq_len, q.device)


def _cache_entry(
    k: torch.Tensor,
    v: torch.Tensor,
    info: SegmentInfo,
    groups: RowGroups,
    spec: MaskSpec,
    keep: bool,
    skip: bool = True,
) -> SegmentKV | None:
    """What later segments will read of this segment's K/V: nothing (no later segment sees
    it), or its positions from the first one any later segment sees. A short tail is copied so
    the rest of the segment's K/V can be freed when nothing else holds it (checkpointing)."""
    bounds, seg = info.bounds, info.segment
    if not skip:  # mask-alone baseline: every segment but the last is kept whole
        last = seg == info.num_segments - 1
        return (
            None
            if last
            else SegmentKV(
                k.detach().requires_grad_(keep), v.detach().requires_grad_(keep), info.start
            )
        )
    first = None
    for later in range(seg + 1, info.num_segments):
        for t in plan_tiles(bounds[later], bounds[later + 1], info.start, info.end, groups, spec):
            first = t.k0 if first is None else min(first, t.k0)
    if first is None:
        return None
    offset = first - info.start
    kd, vd = k.detach()[..., offset:, :], v.detach()[..., offset:, :]
    if 2 * (info.length - offset) <= info.length:
        kd, vd = kd.clone(), vd.clone()
    return SegmentKV(kd.requires_grad_(keep), vd.requires_grad_(keep), first)


class ChunkAwareAttention(nn.Module):
    """Module form of :func:`chunk_aware_attention`: drop-in for a causal SDPA call.

    ``forward(q, k, v, scale=None)`` with ``(batch, heads, seq, head_dim)`` tensors; the module
    itself is the layer key, so give every attention layer its own instance. ``window`` /
    ``sinks``: this layer's sliding window (Mistral / Gemma local layers).
    """

    def __init__(self, window: int | None = None, sinks: int = 0, mask_backend: str = "auto"):
        super().__init__()
        MaskSpec(window, sinks)  # validate now, not at the first step
        self.window, self.sinks, self.mask_backend = window, sinks, mask_backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        return chunk_aware_attention(
            q,
            k,
            v,
            layer=self,
            scale=scale,
            window=self.window,
            sinks=self.sinks,
            mask_backend=self.mask_backend,
        )
