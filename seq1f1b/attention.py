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
from .kv import SegmentInfo, SegmentKV, current_documents, current_unit, inferring_metadata
from .masks import MaskSpec, RowGroups, Tile, plan_tiles, tile_mask

try:  # optional, CUDA only
    from flash_attn import flash_attn_interface as _fa  # type: ignore[import-not-found]
except Exception:
    _fa = None

__all__ = ["ChunkAwareAttention", "block_attention_kernels", "chunk_aware_attention"]

_Block = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- block kernels
def _math_scores(q, k, causal: bool, scale: float, visible: torch.Tensor | None, acc):
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _math_fwd(q, k, v, causal: bool, scale: float, visible: torch.Tensor | None = None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = _math_scores(q, k, causal, scale, visible, acc)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc))
    return out.nan_to_num(0.0).to(q.dtype), lse


def _math_bwd(g, q, k, v, out, lse, causal: bool, scale: float, visible=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_, k_, v_, g_ = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    s = _math_scores(q, k, causal, scale, visible, acc)
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


def _masked_fwd(q, k, v, visible: torch.Tensor, scale: float):
    """One masked tile: (out, lse) with out 0 and lse -inf on rows that see no key."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        out, lse = rt.flash_cpu_forward(q, k, v, False, scale, bias)
    else:  # GPU masked tiles: plain torch (the fast GPU paths are whole-tile kernels)
        out, lse = _math_fwd(q, k, v, False, scale, visible)
    empty = ~visible.any(-1)
    if bool(empty.any()):
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _masked_bwd(g, q, k, v, out, lse, visible: torch.Tensor, scale: float):
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        return rt.flash_cpu_backward(g, q, k, v, out, lse, False, scale, bias)
    return _math_bwd(g, q, k, v, out, lse, False, scale, visible)


def _merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor):
    """Combine two partial softmax results by log-sum-exp (rows with -inf on both stay 0)."""
    new = torch.logaddexp(lse_acc, lse)
    finite = torch.isfinite(new)
    w_acc = torch.where(finite, torch.exp(lse_acc - new), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(lse - new), 0.0).unsqueeze(-1)
    return out_acc * w_acc + o.to(out_acc.dtype) * w_new, new


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


# A planned call: (block, tile) with block -1 = the segment's own K/V, j = prefix block j.
_Plan = tuple[tuple[int, Tile], ...]


class _SegmentAttention(torch.autograd.Function):
    """softmax(q [K_0..K_{k-1}, K_own]^T) [V_0..V_{k-1}, V_own] over the planned tiles only.

    ``plan`` says which rectangles run; ``entries`` are the cache entries of the prefix blocks
    (their ``start``: absolute position of the first cached key), ``q_start`` the segment's.
    Outputs and LSEs of the tiles are merged per query row, so no K/V is ever concatenated or
    copied.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, kernels, plan, spec, q_start, entries, flex_docs, *prefix):
        starts = tuple(e.start for e in entries)
        _, fwd, _ = kernels
        n_rep = q.shape[1] // k.shape[1]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        saved_plan = plan
        if flex_docs is not None:  # one FlexAttention call per block the plan touches
            for block in sorted({b for b, _ in plan}):
                kb, vb, off = (k, v, q_start) if block < 0 else (
                    prefix[2 * block], prefix[2 * block + 1], starts[block]
                )  # fmt: skip
                o, lse = _flex_block_fwd(q, kb, vb, q_start, off, flex_docs, spec, scale)
                out_acc, lse_acc = _merge(out_acc, lse_acc, o, lse.to(acc))
            plan = ()  # the tiles below are for backward
        for block, t in plan:
            kb, vb, off = (
                (k, v, q_start)
                if block < 0
                else (*prefix[2 * block : 2 * block + 2], starts[block])
            )
            rows, qs = slice(t.r0, t.r1), slice(t.q0 - q_start, t.q1 - q_start)
            ks = slice(t.k0 - off, t.k1 - off)
            qt = q[rows, :, qs]
            kt, vt = _expand_kv(kb[rows, :, ks], n_rep), _expand_kv(vb[rows, :, ks], n_rep)
            if t.kind == "masked":
                o, lse = _masked_fwd(qt, kt, vt, tile_mask(t, spec, q.device), scale)
            else:
                o, lse = fwd(qt, kt, vt, t.kind == "causal", scale)
            out_acc[rows, :, qs], lse_acc[rows, :, qs] = _merge(
                out_acc[rows, :, qs], lse_acc[rows, :, qs], o, lse.to(acc)
            )
        out = out_acc.to(q.dtype)
        ctx.scale, ctx.kernels, ctx.n_rep = scale, kernels, n_rep
        ctx.plan, ctx.spec, ctx.q_start, ctx.starts = saved_plan, spec, q_start, starts
        ctx.entries = entries
        ctx.save_for_backward(q, k, v, out, lse_acc, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        _, _, bwd = ctx.kernels
        n_rep, scale, q_start = ctx.n_rep, ctx.scale, ctx.q_start
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dkv: dict[int, list[torch.Tensor]] = {}
        for block, t in ctx.plan:
            if block < 0:
                kb, vb, off = k, v, q_start
            else:
                kb, vb, off = prefix[2 * block], prefix[2 * block + 1], ctx.starts[block]
            rows, qs = slice(t.r0, t.r1), slice(t.q0 - q_start, t.q1 - q_start)
            ks = slice(t.k0 - off, t.k1 - off)
            kt, vt = _expand_kv(kb[rows, :, ks], n_rep), _expand_kv(vb[rows, :, ks], n_rep)
            args = (grad_out[rows, :, qs], q[rows, :, qs], kt, vt, out[rows, :, qs])
            if t.kind == "masked":
                visible = tile_mask(t, ctx.spec, q.device)
                dqt, dkt, dvt = _masked_bwd(*args, lse[rows, :, qs], visible, scale)
            else:
                dqt, dkt, dvt = bwd(*args, lse[rows, :, qs], t.kind == "causal", scale)
            dq[rows, :, qs] += dqt
            if block not in dkv:
                dkv[block] = [
                    torch.zeros(kb.shape, dtype=wide, device=kb.device),
                    torch.zeros(vb.shape, dtype=wide, device=vb.device),
                ]
            dkv[block][0][rows, :, ks] += _reduce_kv(dkt, n_rep)
            dkv[block][1][rows, :, ks] += _reduce_kv(dvt, n_rep)
        own = dkv.get(-1)
        dk = None if own is None else own[0].to(k.dtype)
        dv = None if own is None else own[1].to(v.dtype)
        # The cached K/V are leaves: their gradients are accumulated here, not returned, so
        # that a split backward (autograd.grad over the stage inputs only, which would skip
        # these leaves) leaves them for the owning segment exactly as a full backward does.
        # (into the cache entries' own tensors: under checkpointing the saved copies unpacked
        # above are detached aliases, whose .grad nobody reads)
        for block, entry in enumerate(ctx.entries):
            g = dkv.get(block)
            if g is None:
                continue
            for leaf, grad in ((entry.k, g[0]), (entry.v, g[1])):
                if leaf.requires_grad:
                    grad = grad.to(leaf.dtype)
                    leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        nones = (None,) * len(prefix)
        return (dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None, *nones)


class _InjectKVGrad(torch.autograd.Function):
    """Identity on (k, v) whose backward adds the grads later segments left on the cache
    (the cache may hold only the segment's last positions: ``offset`` is where they start)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, entry: SegmentKV, offset: int):
        ctx.entry, ctx.offset = entry, offset
        ctx.shapes = (k.shape, v.shape)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        entry: SegmentKV = ctx.entry
        gk = _add_rows(gk, entry.k.grad, ctx.offset, ctx.shapes[0])
        gv = _add_rows(gv, entry.v.grad, ctx.offset, ctx.shapes[1])
        return gk, gv, None, None


def _add_rows(g, extra, offset: int, shape: torch.Size):
    """``g`` plus ``extra`` added at positions ``offset..`` of the sequence dim (-2)."""
    if extra is None:
        return g
    if offset == 0 and extra.shape == shape:
        return extra if g is None else g + extra
    out = torch.zeros(shape, dtype=extra.dtype, device=extra.device) if g is None else g.clone()
    out[..., offset : offset + extra.shape[-2], :] += extra
    return out


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
    if ctx is None or ctx.info.num_segments == 1:
        if plain:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=n_rep > 1
            )
        seq = q.shape[-2]
        start = 0 if ctx is None else ctx.info.start
        groups = groups or ((0, q.shape[0], ((0, start + seq),)),)
        plan = tuple(
            (-1, t) for t in plan_tiles(start, start + seq, start, start + seq, groups, spec)
        )
        docs = _flex_documents(mask_backend, q, groups, start + seq)
        return _SegmentAttention.apply(
            q, k, v, scale, block_attention_kernels(q), plan, spec, start, (), docs
        )
    info, state = ctx.info, ctx.state
    groups = groups or ((0, q.shape[0], ((0, info.seq_len),)),)
    seg = info.segment
    entries = state.layer_entries(info.microbatch, layer)
    if ctx.phase == "forward":
        if len(entries) != seg:
            raise RuntimeError(
                f"Seq1F1B: attention layer {layer!r} of stage {state.stage_index} has cached "
                f"{len(entries)} segments of sample {info.microbatch} but runs segment {seg}; "
                "each attention layer must run exactly once per unit forward"
            )
        own = _cache_entry(k, v, info, groups, spec, ctx.keep_kv, state.skip_invisible or plain)
        entries.append(own)
    else:  # recomputation inside this unit's backward or weight half (checkpointing)
        if len(entries) <= seg:
            raise RuntimeError(
                f"Seq1F1B: recomputing segment {seg} of sample {info.microbatch} on stage "
                f"{state.stage_index} but its K/V cache is gone"
            )
        own = entries[seg]
    prefix: list[torch.Tensor] = []
    used: list[SegmentKV] = []
    plan: list[tuple[int, Tile]] = []
    bounds, skip = info.bounds, state.skip_invisible or plain
    for j in range(seg):
        tiles = plan_tiles(info.start, info.end, bounds[j], bounds[j + 1], groups, spec, skip)
        if not tiles:
            continue  # nothing of segment j is visible: no kernel call, no K/V needed
        e = entries[j]
        if e is None:
            raise RuntimeError(
                f"Seq1F1B: K/V of segment {j} (sample {info.microbatch}, stage "
                f"{state.stage_index}) was freed before segment {seg} used it"
            )
        plan += [(len(used), t) for t in tiles]
        prefix += [e.k, e.v]
        used.append(e)
    own_tiles = plan_tiles(info.start, info.end, info.start, info.end, groups, spec, skip)
    plan += [(-1, t) for t in own_tiles]
    if own is not None and ctx.keep_kv:
        k, v = _InjectKVGrad.apply(k, v, own, own.start - info.start)
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
