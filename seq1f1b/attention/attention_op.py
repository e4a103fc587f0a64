"""Chunk-aware attention as torch.compile sees it: opaque custom ops, state kept outside.

A compiled block (torchtitan compiles each one with ``fullgraph=True``) must neither trace
the K/V cache (Python dicts, detached leaves with ``requires_grad_``) nor guard on the running
unit (a guard on the segment's start would recompile per segment). So under
``torch.compile``, :func:`seq1f1b.chunk_aware_attention` calls two ``torch.library`` custom
ops instead of its eager autograd function:

* ``seq1f1b::segment_attention(q, k, v, layer_key, ...) -> (out, lse, handle)`` reads the unit
  context when it runs (never while tracing), caches what later segments see of ``k``/``v``
  and runs the planned tiles; ``handle`` carries what its backward needs (the plan, the cache
  entries read), so nothing about the unit reaches the graph;
* ``seq1f1b::segment_attention_backward(grad, q, k, v, out, lse, handle) -> (dq, dk, dv)``
  runs the tiles' backward, leaves the prefix's gradients on the cache (as the eager path
  does) and adds those later segments left on this segment's own K/V.

Under context parallelism the same two ops run the ring
(:func:`seq1f1b.attention.context_parallel.ring_forward` / ``ring_backward``, the eager path's
own functions): the hops' point-to-point traffic happens inside the op, which the compiler
does not look into, so a compiled block under CP has no graph break. Every CP rank runs the
same units in the same order, so their ops pair their hops as the eager path's do.

Their fake kernels only give shapes, so one graph serves every unit, segment and step (with
dynamic shapes where segment lengths vary). The layer is named by a tensor, the
``seq1f1b_layer_key`` buffer of :class:`seq1f1b.ChunkAwareAttention` (or any module given one
by :func:`add_layer_key`): a buffer is a graph input, so every block shares one graph where an
integer id would be a guard (a recompilation per layer). The buffer's storage address is the
key, its value is never read (meta-device init may leave it uninitialised).

Compiled buffers can be reused by the compiler once an op returns, so the cache holds copies
of what later segments see (the eager path shares storage instead): K/V of the visible
positions, about ``2 * kv_heads / (n_layers' activations)`` of a block's saved bytes.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _runtime as rt
from .context_parallel import RingLayout, ring_backward, ring_forward, ring_layout
from .kernels import block_attention_kernels, library_kernel_ops
from .kv import (
    SegmentKV,
    _add_rows,
    accumulate_cache_grads,
    attend_cache,
    attention_call,
    current_unit,
    inferring_metadata,
)
from .masks import MaskSpec, plan_segment
from .tiles import (
    accumulator_dtype,
    kv_blocks,
    run_tiles_backward,
    run_tiles_forward,
)

__all__ = [
    "LAYER_KEY",
    "add_layer_key",
    "checkpoint_save_ops",
    "compiled_attention",
    "layer_key_of",
    "segment_positions",
]

LAYER_KEY = "seq1f1b_layer_key"
_IDS = itertools.count(1)
# Records of calls outside any Seq1F1B unit (unpipelined compiled runs, torch's schedules):
# a plan and a few numbers each, no tensors; the oldest are dropped past the limit, so the
# store stays bounded whether or not backwards run (a split backward reads a record twice).
_ORPHANS: OrderedDict[int, Any] = OrderedDict()
_ORPHAN_LIMIT = 1 << 16


def add_layer_key(module: nn.Module) -> nn.Module:
    """Give ``module`` the non-persistent buffer that names its attention layer under
    torch.compile (idempotent; not saved in checkpoints)."""
    if not hasattr(module, LAYER_KEY):
        module.register_buffer(LAYER_KEY, torch.zeros(1), persistent=False)
    return module


def layer_key_of(layer: Hashable) -> torch.Tensor:
    """The key buffer of ``layer`` (the ``layer=`` of chunk_aware_attention), or a clear error."""
    key = getattr(layer, LAYER_KEY, None)
    if not isinstance(key, torch.Tensor):
        raise RuntimeError(
            f"chunk_aware_attention under torch.compile needs layer= to be a module with a "
            f"{LAYER_KEY!r} buffer (got {type(layer).__name__}): use seq1f1b.ChunkAwareAttention, "
            "or call seq1f1b.add_layer_key(module) once when building the model"
        )
    return key


@dataclass
class _Record:
    """What one call's backward needs and the graph must not see."""

    plan: tuple
    spec: MaskSpec
    scale: float
    kernels: tuple[str, Any, Any]
    entries: tuple[SegmentKV, ...]
    prefix: list[torch.Tensor]
    own: SegmentKV | None
    offset: int
    ring: RingLayout | None = None  # under context parallelism: the ring's plan (not ``plan``)


def _documents_arg(documents: int) -> bool | None:
    return None if documents < 0 else bool(documents)


def _out_shapes(
    q: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes only: the output has the queries' shape with the values' head dim."""
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=accumulator_dtype(q), device=q.device)
    return out, lse, torch.zeros(1, dtype=torch.int64)  # call 0: no record (shapes only)


@torch.library.custom_op("seq1f1b::segment_attention", mutates_args=())
def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_key: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: int,
    documents: int,
    needs_grad: bool,
    donated: bool,
    lse_read: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of one chunk-aware attention call (see the module docstring); ``handle`` is a
    CPU int64 naming the call's record, kept only when a backward will follow. ``lse_read``:
    the caller uses the LSE (``return_lse``), so its gradient reaches the backward. ``donated``
    (AOTAutograd's donated buffers at trace time) does nothing here: it makes graphs traced
    with and without donated buffers differ, which inductor's FX graph cache does not
    otherwise tell apart (torch 2.13-2.15), so a zero-bubble schedule can never be served a
    backward that consumes its saved tensors."""
    spec = MaskSpec(window, sinks)
    if q.device.type == "meta":
        return _out_shapes(q, v)
    ctx = current_unit()
    if ctx is None and inferring_metadata():
        return _out_shapes(q, v)
    call = attention_call(ctx, _documents_arg(documents), spec, q.shape[0], q.shape[-2], "compiled")
    unit, plain, groups = call.unit, call.plain, call.groups
    start, end = call.start, call.end
    entries: tuple[SegmentKV, ...] = ()
    prefix: list[torch.Tensor] = []
    own, offset, skip, ring = None, 0, True, None
    plan: tuple = ()
    kernels = block_attention_kernels(q)
    if unit is not None:
        skip = unit.state.skip_invisible or plain
        layer = ("compiled", layer_key.untyped_storage().data_ptr())
        _, _, cached = attend_cache(unit, layer, k, v, groups, spec, skip, compiled=True)
        entries, prefix = cached.entries, cached.tensors()
        if unit.keep_kv or unit.phase == "backward_weight":  # a weight half recomputes too
            own = unit.state.layer_entries(unit.info.microbatch, layer)[unit.info.segment]
            offset = 0 if own is None else own.start - start
        if unit.info.cp is not None:  # the ring's hops run here, opaque to the compiler
            ring = ring_layout(q, k, unit.info, cached, groups, spec, scale, kernels, skip,
                               lse_read)  # fmt: skip
        else:
            plan = plan_segment(start, end, cached.key_runs(), groups, spec, skip)
    else:
        plan = plan_segment(start, end, (), groups, spec, skip)
    if ring is not None:
        out, lse = ring_forward(q, k, v, prefix, ring)
    else:
        blocks = kv_blocks(k, v, prefix)
        out, lse = run_tiles_forward(q, blocks, plan, spec, scale, kernels, final=True)
    out = out.to(q.dtype).contiguous()
    rid = next(_IDS)
    if needs_grad:
        record = _Record(plan, spec, scale, kernels, entries, prefix, own, offset, ring)
        if ctx is not None:
            ctx.state.put_record(ctx.info.microbatch, ctx.info.segment, rid, record)
        else:
            _ORPHANS[rid] = record
            while len(_ORPHANS) > _ORPHAN_LIMIT:
                _ORPHANS.popitem(last=False)
    return out, lse.contiguous(), torch.tensor([rid], dtype=torch.int64)


@segment_attention.register_fake
def _(q, k, v, layer_key, scale, window, sinks, documents, needs_grad, donated, lse_read):
    return _out_shapes(q, v)


@torch.library.custom_op("seq1f1b::segment_attention_backward", mutates_args=())
def segment_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
    donated: bool,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`segment_attention`: input grads plus the cache's gradients
    (``donated``: as in the forward, keys the compiled backward graph; ``grad_lse``: the
    LSE's gradient, when an ``out_transform`` read it)."""
    rid, ctx = int(handle.item()), current_unit()
    if rid == 0 and inferring_metadata():  # the stage's backward shape inference
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if ctx is not None:  # a split backward's halves both run a compiled block's backward
        m, seg = ctx.info.microbatch, ctx.info.segment
        split = ctx.phase != "backward"
        rec = ctx.state.get_record(m, seg, rid) if split else ctx.state.pop_record(m, seg, rid)
    else:
        rec = _ORPHANS.get(rid)  # a split backward reads it twice; eviction frees it
    if rec is None:
        raise RuntimeError(
            f"seq1f1b: the backward of compiled attention call {rid} found no record of its "
            "forward: a backward outside the unit that ran the forward (reentrant "
            "checkpointing runs an inner backward that does not see the unit on CUDA: use "
            f"use_reentrant=False), or more than {_ORPHAN_LIMIT} pending unpipelined forwards"
        )
    dkv: dict[int, list[torch.Tensor]] = {}
    if rec.ring is not None:  # every CP rank runs the ring's backward hops here
        dq, dk_own, dv_own, dkv = ring_backward(grad_out, grad_lse, q, k, v, out, lse,
                                                rec.prefix, rec.ring)  # fmt: skip
    else:
        dq = run_tiles_backward(
            grad_out, q, out, lse, kv_blocks(k, v, rec.prefix), rec.plan, rec.spec, rec.scale,
            rec.kernels, None, dkv, final=True, grad_lse=grad_lse,
        )  # fmt: skip
        own = dkv.get(-1)
        dk_own, dv_own = (None, None) if own is None else (own[0], own[1])
    dk = torch.zeros_like(k) if dk_own is None else dk_own.to(k.dtype)
    dv = torch.zeros_like(v) if dv_own is None else dv_own.to(v.dtype)
    if ctx is None or ctx.phase != "backward_weight":  # the input half already left them
        accumulate_cache_grads(rec.entries, dkv)
    if rec.own is not None:  # what later segments left on this segment's cached K/V
        dk = _add_rows(dk, rec.own.k.grad, rec.offset, k.shape)
        dv = _add_rows(dv, rec.own.v.grad, rec.offset, v.shape)
    return dq.to(q.dtype).contiguous(), dk.contiguous(), dv.contiguous()


@segment_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, handle, donated, grad_lse=None):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v = inputs[:3]
    out, lse, handle = output
    ctx.save_for_backward(q, k, v, out, lse, handle)
    ctx.donated, ctx.lse_read = inputs[-2], inputs[-1]


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: Any, _grad_handle: Any) -> tuple:
    q, k, v, out, lse, handle = ctx.saved_tensors
    if not ctx.lse_read:  # only out_transform's calls read the LSE: no column to carry
        grad_lse = None
    dq, dk, dv = segment_attention_backward(
        grad_out, q, k, v, out, lse, handle, ctx.donated, grad_lse
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


segment_attention.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: Hashable,
    scale: float | None,
    window: int | None,
    sinks: int,
    documents: bool | None,
    return_lse: bool = False,
) -> Any:
    """The traced form of chunk_aware_attention: one custom-op call, nothing guarded
    (``(out, lse)`` with ``return_lse``)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    flag = -1 if documents is None else int(documents)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = layer_key_of(layer)
    donated = rt.donated_buffers_enabled()
    out, lse, _ = segment_attention(
        q, k, v, key, scale, window, sinks, flag, grad, donated, return_lse
    )
    return (out, lse) if return_lse else out


@torch.library.custom_op("seq1f1b::segment_positions", mutates_args=())
def _segment_positions(x: torch.Tensor, dim: int) -> torch.Tensor:
    from .kv import current_segment

    length = x.shape[dim]
    info = current_segment()
    if info is None:
        return torch.arange(length, device=x.device)
    if info.local_length != length:
        raise RuntimeError(
            f"seq1f1b.segment_positions: the input has {length} positions on dim {dim} but the "
            f"running segment has {info.local_length} on this rank: pass the sequence dim"
        )
    return info.positions(x.device)


@_segment_positions.register_fake
def _(x, dim):
    return torch.empty(x.shape[dim], dtype=torch.int64, device=x.device)


def segment_positions(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Absolute positions (int64) of the tokens of ``x`` along its sequence dim ``dim``: the
    running segment's (this rank's shard of it under context parallelism), else ``0..S-1``.

    The RoPE / learned-position input that works eager and compiled alike: it is read when the
    op runs, so a compiled block is not specialised to one segment's start."""
    return _segment_positions(x, dim % x.dim())


def checkpoint_save_ops() -> set[Any]:
    """Op overloads whose outputs an op-level selective activation checkpointing policy
    should save, as torchtitan's saves torch's flash attention: the compiled chunk-aware
    attention (``seq1f1b::segment_attention``, one opaque op that a policy otherwise
    recomputes, a whole attention forward again in every backward) and flash-attn's forward
    where the eager path runs it. Add them to a policy's save list (torchtitan 0.3:
    ``SelectiveAC.get_save_ops``; the integration does)."""
    return {torch.ops.seq1f1b.segment_attention.default, *library_kernel_ops()}
