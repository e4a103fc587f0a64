"""Chunk-aware causal attention: the one entry point a model needs for Seq1F1B.

Inside a ``ScheduleSeq1F1B`` unit, segment ``k`` of a sample attends to the cached K/V of
segments ``0..k-1`` (all visible) plus its own K/V (causal). The causal mask is therefore
aligned bottom-right. Outside a unit it is plain causal SDPA, so the same model also runs
unpipelined or under torch's own schedules.

Memory: the attention never concatenates the K/V prefix. It runs one kernel call per cached
block plus one causal call on its own block and merges the partial outputs by log-sum-exp; the
backward reuses the merged output and LSE, so each block's gradient comes out exact. It saves
only q, k, v, the output and the LSE; the cached blocks are referenced, not copied.

The path reads downward: this entry point asks the K/V cache (:mod:`seq1f1b.attention.kv`) what the
segment keeps for later segments and which earlier ones it reads, the planner
(:mod:`seq1f1b.attention.masks`) for the segment's tiles, and runs them on one device (the tile loop
of :mod:`seq1f1b.attention.tiles`) or around the context-parallel ring
(:mod:`seq1f1b.attention.context_parallel`). Nothing below calls back up.

Kernels (``(out, lse)`` forward and ``(dq, dk, dv)`` backward of one block):
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), any float dtype;
* CUDA with flash-attn installed: its forward/backward kernels (not run in this project's CI:
  no GPU here);
* CUDA fp16/bf16 without flash-attn: ``aten._scaled_dot_product_flash_attention`` (not run here);
* anything else: a plain-torch math kernel (also the test oracle).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention_op import add_layer_key, compiled_attention
from .context_parallel import cp_attention
from .kernels import block_attention_kernels
from .kv import (
    CachedPrefix,
    ExpandedKV,
    accumulate_cache_grads,
    attend_cache,
    attention_call,
    current_unit,
    inferring_metadata,
    reexpanded_prefix,
    saved_prefix,
    send_through_expansions,
)
from .masks import (
    CHECKED_POSITIONS,
    MASK_BLOCK,
    MaskMod,
    MaskSpec,
    RowGroups,
    check_causal,
    plan_segment,
)
from .tiles import (
    accumulator_dtype,
    kv_blocks,
    merge,
    output_shape,
    run_tiles_backward,
    run_tiles_forward,
)

__all__ = ["ChunkAwareAttention", "chunk_aware_attention", "latent_attention"]

_Block = tuple[torch.Tensor, torch.Tensor]


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

    window, sinks, user = spec.window, spec.sinks, spec.mask_mod

    def mask_mod(b, h, qi, ki):
        qa, ka = qi + q0, ki + k0
        vis = (ka <= qa) & (docs[b, qa] == docs[b, ka])
        if window is not None:
            vis = vis & ((qa - ka < window) | (ka < sinks))
        if user is not None:
            vis = vis & user(0, 0, qa, ka)
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
        blocks = kv_blocks(k, v, prefix)
        if flex_docs is not None:  # one FlexAttention call per block the plan touches
            out_acc = torch.zeros(output_shape(q, blocks), dtype=acc, device=q.device)
            lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            starts = tuple(e.start for e in entries)
            for block in sorted({entry[0] for entry in plan}):
                kb, vb = blocks[block]
                off = q_start if block < 0 else starts[block]
                o, lse = _flex_block_fwd(q, kb, vb, q_start, off, flex_docs, spec, scale)
                out_acc, lse_acc = merge(out_acc, lse_acc, o, lse.to(acc))
        else:  # a single tile over the whole segment is the kernel's result as it is
            out_acc, lse_acc = run_tiles_forward(q, blocks, plan, spec, scale, kernels, final=True)
        out = out_acc.to(q.dtype)
        ctx.scale, ctx.kernels, ctx.plan, ctx.spec = scale, kernels, plan, spec
        ctx.entries = entries
        ctx.save_for_backward(q, k, v, out, lse_acc, *saved_prefix(entries, prefix))
        ctx.set_materialize_grads(False)  # an LSE nobody reads has no gradient: None
        return out, lse_acc

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        dkv: dict[int, list[torch.Tensor]] = {}
        prefix, graphs = reexpanded_prefix(ctx.entries, saved)  # a latent's K/V: expanded again
        blocks = kv_blocks(k, v, prefix)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq = run_tiles_backward(  # grad_lse: an out_transform read the LSE (learned sinks)
            grad_out, q, out, lse, blocks, ctx.plan, ctx.spec, ctx.scale, ctx.kernels, None,
            dkv, final=True, grad_lse=grad_lse,
        )  # fmt: skip
        own = dkv.get(-1)
        dk = None if own is None else own[0].to(k.dtype)
        dv = None if own is None else own[1].to(v.dtype)
        accumulate_cache_grads(ctx.entries, dkv)
        send_through_expansions(graphs, dkv)
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
    return_lse: bool = False,
    mask_mod: MaskMod | None = None,
) -> Any:
    """Causal attention over ``(batch, heads, seq, head_dim)`` tensors that Seq1F1B can chunk.

    ``layer`` identifies the attention layer within its stage (the calling module works), so
    checkpoint recomputation finds the same cache. ``k``/``v`` may have fewer heads than ``q``
    (grouped-query attention); they are cached un-repeated.

    Masks beyond causal: ``window`` (sliding window: keys per query, itself included) with
    ``sinks`` first positions always visible, per layer; packed documents come with the batch
    (``step(..., document_ids=...)``, or :func:`seq1f1b.packed_documents` outside a step).
    ``documents=True`` says this layer needs them (an error if the batch has none), ``False``
    that it must ignore them. ``mask_mod``: any causal pattern as a FlexAttention
    ``mask_mod(b, h, q_idx, kv_idx)`` over absolute positions (docs/masks.md): its hidden
    blocks are never computed, and cached blocks no later segment sees are freed; one that
    looks forward is refused at its first step. Outside a unit and without masks this is
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

    ``return_lse``: return ``(out, lse)``, the log-sum-exp of every query's scores over all
    the keys it sees (every segment's, merged), ``(batch, heads, seq)`` in fp32, with a
    gradient (an ``out_transform`` such as GPT-OSS's learned sinks, ``out * sigmoid(lse -
    sink)``, applies to the whole softmax only this way: never per tile or per segment).

    ``mask_backend`` for masked attention: "tiles" (whole-tile flash kernels, thin masked
    strips), "flex" (one FlexAttention call per visible block for the forward; the backward
    runs the tiles), or "auto": flex on CUDA, tiles elsewhere.

    Under ``torch.compile`` the call is the custom op of :mod:`seq1f1b.attention.attention_op`
    (tiles, or the context-parallel ring run inside the op); ``layer`` must then carry a key
    buffer (ChunkAwareAttention does; :func:`seq1f1b.add_layer_key` gives one to any module).
    A layer with a ``mask_mod`` runs eagerly there (a graph break per call: the op's schema
    carries no function).
    """
    if mask_backend not in ("auto", "tiles", "flex"):
        raise ValueError(f"mask_backend={mask_backend!r}: use 'auto', 'tiles' or 'flex'")
    if torch.compiler.is_compiling():  # one opaque op: nothing of the unit is traced
        if mask_mod is not None:
            return _eager_attention(q, k, v, layer=layer, scale=scale, window=window,
                                    sinks=sinks, documents=documents, mask_backend=mask_backend,
                                    return_lse=return_lse, mask_mod=mask_mod)  # fmt: skip
        return compiled_attention(q, k, v, layer, scale, window, sinks, documents, return_lse)
    ctx = current_unit()
    n_rep = q.shape[1] // k.shape[1]
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads and k has {k.shape[1]}: the number of query heads must "
            "be a multiple of the number of K/V heads"
        )
    spec = MaskSpec(window, sinks, mask_mod)
    if q.device.type == "meta" or (ctx is None and inferring_metadata()):
        # the pipeline stage's shape inference: only shapes matter
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_rep > 1)
        return (out, q.new_zeros(q.shape[:-1], dtype=torch.float32)) if return_lse else out
    call = attention_call(ctx, documents, spec, q.shape[0], q.shape[-2], layer)
    if mask_mod is not None:
        check_causal(mask_mod, min(call.seq_len, CHECKED_POSITIONS))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    unit, plain, groups = call.unit, call.plain, call.groups
    if unit is None and plain and not return_lse:  # nothing cached, nothing to cache, no mask
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=n_rep > 1
        )
    kernels = block_attention_kernels(q)
    start, end, seq_len = call.start, call.end, call.seq_len
    cp = unit is not None and unit.info.cp is not None
    docs = None if plain or cp else _flex_documents(mask_backend, q, groups, seq_len)
    prefix, skip = CachedPrefix(), True
    if unit is not None:
        skip = unit.state.skip_invisible or plain
        k, v, prefix = attend_cache(unit, layer, k, v, groups, spec, skip)
        if cp:  # sharded over a context-parallel group: the ring runs the plan (and merges
            # the LSE over the ring and the cached segments, so return_lse holds as below)
            return cp_attention(q, k, v, unit.info, prefix, groups, spec, scale, kernels, skip,
                                return_lse)  # fmt: skip
    plan = plan_segment(start, end, prefix.key_runs(), groups, spec, skip)
    out, lse = _SegmentAttention.apply(
        q, k, v, scale, kernels, plan, spec, start, prefix.entries, docs, *prefix.tensors()
    )
    return (out, lse) if return_lse else out


#: :func:`chunk_aware_attention` run eagerly under torch.compile (a ``mask_mod`` layer)
_eager_attention = torch.compiler.disable(chunk_aware_attention, recursive=True)


@torch.compiler.disable(recursive=True)  # eager under torch.compile: a graph break per call
def latent_attention(
    q: torch.Tensor,
    latent: tuple[torch.Tensor, torch.Tensor],
    expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    layer: Hashable,
    scale: float | None = None,
    window: int | None = None,
    sinks: int = 0,
    documents: bool | None = None,
    return_lse: bool = False,
) -> Any:
    """:func:`chunk_aware_attention` over ``(k, v) = expand(*latent)`` whose K/V cache keeps,
    for earlier segments, the ``latent`` instead of K and V: DeepSeek's multi-head latent
    attention caches the compressed K/V and the shared RoPE key (``kv_lora_rank +
    qk_rope_head_dim`` values a token, 576, instead of ``n_heads * (qk_head_dim + v_head_dim)``,
    40,960 at 671B) and re-expands them for every later segment that reads them, forward and
    backward. Exact as the expanded cache; it trades the K/V memory of earlier segments for the
    re-expansion's matmuls.

    ``latent``: two ``(batch, seq, width)`` tensors; ``expand`` maps them (any run of positions)
    to ``(batch, heads, seq, head_dim)`` K and V with the layer's own modules. Under context
    parallelism each CP rank caches the latent of its own shard of an earlier segment's
    positions and expands it for the ring (which passes expanded K/V or the queries, as for
    the expanded cache); under ``torch.compile`` the call runs eagerly."""
    for t in latent:
        if t.dim() != 3:
            raise ValueError(
                f"latent_attention: each latent tensor must be (batch, seq, width), got shape "
                f"{tuple(t.shape)}: flatten its head dims (expand restores them)"
            )
    ctx = current_unit()
    if ctx is None or q.device.type == "meta" or ctx.info.num_segments == 1:
        k, v = expand(*latent)
        return chunk_aware_attention(q, k, v, layer=layer, scale=scale, window=window,
                                     sinks=sinks, documents=documents,
                                     return_lse=return_lse)  # fmt: skip
    spec = MaskSpec(window, sinks)
    call = attention_call(ctx, documents, spec, q.shape[0], q.shape[-2], layer)
    skip = ctx.state.skip_invisible or call.plain
    c, rope, cached = attend_cache(ctx, layer, *latent, call.groups, spec, skip)
    k, v = expand(c, rope)
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q has {q.shape[1]} heads and the expanded k {k.shape[1]}")
    prefix = replace(cached, entries=tuple(ExpandedKV(e, expand) for e in cached.entries))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kernels = block_attention_kernels(q)
    if ctx.info.cp is not None:  # each CP rank caches the latent of its own shard of positions
        return cp_attention(q, k, v, ctx.info, prefix, call.groups, spec, scale, kernels, skip,
                            return_lse)  # fmt: skip
    plan = plan_segment(call.start, call.end, prefix.key_runs(), call.groups, spec, skip)
    out, lse = _SegmentAttention.apply(q, k, v, scale, kernels, plan, spec, call.start,
                                       prefix.entries, None, *prefix.tensors())  # fmt: skip
    return (out, lse) if return_lse else out


def _flex_documents(backend: str, q: torch.Tensor, groups: RowGroups, seq_len: int):
    """The document index FlexAttention's mask reads, when that backend runs; else None."""
    use = backend == "flex" or (backend == "auto" and q.device.type == "cuda")
    if not use or not _flex_available():
        return None
    return _document_index(groups, q.shape[0], seq_len, q.device)


class ChunkAwareAttention(nn.Module):
    """Module form of :func:`chunk_aware_attention`: drop-in for a causal SDPA call.

    ``forward(q, k, v, scale=None)`` with ``(batch, heads, seq, head_dim)`` tensors; the module
    itself is the layer key, so give every attention layer its own instance. ``window`` /
    ``sinks``: this layer's sliding window (Mistral / Gemma local layers); ``mask_mod``: any
    causal pattern, FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` (docs/masks.md).
    """

    def __init__(self, window: int | None = None, sinks: int = 0, mask_backend: str = "auto",
                 mask_mod: MaskMod | None = None):  # fmt: skip
        super().__init__()
        MaskSpec(window, sinks, mask_mod)  # validate now, not at the first step
        if mask_mod is not None:  # a mask that looks forward early on: refused at build time
            check_causal(mask_mod, 4 * getattr(mask_mod, "block", MASK_BLOCK))
        self.window, self.sinks, self.mask_backend = window, sinks, mask_backend
        self.mask_mod = mask_mod
        add_layer_key(self)  # names the layer under torch.compile

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
            mask_mod=self.mask_mod,
        )
