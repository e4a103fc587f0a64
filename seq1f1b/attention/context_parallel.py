"""Context parallelism (ring attention) composed with Seq1F1B's sequence segments.

Each segment of a sample is sharded over the CP group in the load-balanced head-tail layout
(:func:`seq1f1b.attention.kv.zigzag_runs`): rank ``r`` of ``c`` holds chunks ``r`` and ``2c-1-r``,
so the causal work of the segment's own block is equal on every rank. With packed documents the
shards are balanced for the documents instead (:func:`seq1f1b.attention.kv.document_cp_layout`). A
query needs

* the segment's own keys, spread over the CP ranks: their K/V blocks go around the ring
  ("pass-KV", ``c-1`` hops), as in ring self-attention;
* the keys of earlier segments, cached where they were computed (each rank keeps its shard):
  either the *queries* go around the ring and their partial outputs come back ("pass-Q",
  communication proportional to the new segment, as in context-parallel inference over a
  K/V cache), or the cached K/V shards go around ("pass-KV", proportional to the prefix).
  ``"auto"`` picks, per segment, the one that moves fewer bytes.

Partial results are merged by log-sum-exp, as on one device, so the backward is exact: it
sends the same blocks around the ring again together with their gradient accumulators, which
return to their owner after the last hop. All tiles are planned at absolute positions, so
packed documents, sliding windows and sinks work unchanged (only the tiles with a visible pair
run; the communication is not skipped).

The log-sum-exp a query ends with is merged over every key it sees (the ring's and the cached
segments'), so an ``out_transform`` of it (GPT-OSS's learned sinks, ``out * sigmoid(lse -
sink)``) applies once, to the whole softmax, as on one device. Its gradient enters every tile's
backward as on one device (:func:`seq1f1b.attention.tiles.run_tiles_backward`'s ``grad_lse``);
under pass-Q it travels with the queries' ``dO``.

Communication is point-to-point on the CP group (``batch_isend_irecv``: send to the next rank,
receive from the previous one), which gloo runs on CPU; torch's own ``context_parallel`` has
no CPU flash-attention strategy (see REFERENCE.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .kv import (
    CachedPrefix,
    ContextParallel,
    SegmentInfo,
    accumulate_cache_grads,
    reexpanded_prefix,
    saved_prefix,
    send_through_expansions,
)
from .masks import MaskSpec, RingPlan, RowGroups, plan_ring
from .tiles import accumulator_dtype, kv_blocks, merge, run_tiles_backward, run_tiles_forward

__all__ = [
    "CP_PREFIX_MODES",
    "CommStats",
    "RingLayout",
    "comm_stats",
    "cp_attention",
    "ring_backward",
    "ring_forward",
    "ring_layout",
]

CP_PREFIX_MODES = ("auto", "pass_q", "pass_kv")


class CommStats:
    """Bytes this process sent over CP groups, by what moved (for benchmarks and tests)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)

    def add(self, label: str, tensors: Sequence[torch.Tensor]) -> None:
        self.sent[label] += sum(t.numel() * t.element_size() for t in tensors)

    def total(self) -> int:
        return sum(self.sent.values())

    def reset(self) -> None:
        self.sent.clear()


_STATS = CommStats()


def comm_stats() -> CommStats:
    return _STATS


class _Shift:
    """One ring hop in flight: ``tensors`` to the next CP rank, the previous rank's into
    buffers of the same shapes. Started at construction, so compute can run before
    :meth:`wait` (every rank posts its hops in the same order, which is what pairs them)."""

    def __init__(self, tensors: list[torch.Tensor], cp: ContextParallel) -> None:
        nxt = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        prv = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
        self.send = [t.contiguous() for t in tensors]
        self.recv = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in self.send]
        ops = [dist.P2POp(dist.isend, t, nxt, cp.group) for t in self.send]
        ops += [dist.P2POp(dist.irecv, r, prv, cp.group) for r in self.recv]
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.recv


def _ring_shift(tensors: list[torch.Tensor], cp: ContextParallel) -> list[torch.Tensor]:
    """Send ``tensors`` to the next CP rank, receive the previous rank's (same shapes)."""
    return _Shift(tensors, cp).wait()


def _start(moving: list[torch.Tensor], cp: ContextParallel) -> _Shift:
    """Start the next hop of the blocks that travel unchanged (counted as sent)."""
    _STATS.add("own_kv", moving[:2])
    _STATS.add("prefix", moving[2:])
    return _Shift(moving, cp)


@dataclass(frozen=True)
class RingLayout:
    """Everything static about one segment's CP attention on this rank, its tile plan for
    every hop included (planned once: forward, backward and recomputation reuse it)."""

    cp: ContextParallel
    plan: RingPlan
    spec: MaskSpec
    pass_q: bool  # prefix by moving queries (else its K/V blocks move)
    scale: float
    kernels: tuple[str, Any, Any]
    return_lse: bool = False  # the caller reads the LSE: its gradient joins the backward


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: Sequence[torch.Tensor],
    layout: RingLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment's attention on one CP rank, autograd-free: local tiles, then ``c-1`` ring
    hops. Returns the output (``q``'s dtype) and the LSE merged over every key. Shared by the
    eager autograd function and the compiled custom op (which runs it opaque to the compiler,
    so a compiled block has no graph break per hop)."""
    cp = layout.cp
    local = kv_blocks(k, v, prefix)
    args = (layout.spec, layout.scale, layout.kernels)
    # the blocks that travel unchanged go on to the next rank while this one computes
    moving = [k, v] + ([] if layout.pass_q else list(prefix))
    if layout.pass_q:
        moving.append(q)
    pending = _start(moving, cp) if cp.size > 1 else None
    out, lse = run_tiles_forward(q, local, layout.plan.local, *args)
    travel: list[torch.Tensor] = []  # partial (out, lse) of the visiting queries
    for hop in range(1, cp.size):
        assert pending is not None
        moving, src = pending.wait(), (cp.rank - hop) % cp.size
        pending = _start(moving, cp) if hop < cp.size - 1 else None
        if travel:  # the visiting queries' partial results so far (computed last hop)
            _STATS.add("prefix", travel)
            travel = _ring_shift(travel, cp)
        kv = kv_blocks(moving[0], moving[1], [] if layout.pass_q else moving[2:])
        out, lse = run_tiles_forward(q, kv, layout.plan.kv[src], *args, out, lse)
        if layout.pass_q:
            q_src = moving[-1]
            o_t, l_t = travel or (None, None)
            prefix_blocks = {j: b for j, b in local.items() if j >= 0}
            travel = list(
                run_tiles_forward(q_src, prefix_blocks, layout.plan.q[src], *args, o_t, l_t)
            )
    if travel:  # the partial results of the previous rank's queries go home
        _STATS.add("prefix", travel)
        o_t, l_t = _ring_shift(travel, cp)
        out, lse = merge(out, lse, o_t, l_t)
    return out.to(q.dtype), lse


def ring_backward(
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    prefix: Sequence[torch.Tensor],
    layout: RingLayout,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[int, list[torch.Tensor]]]:
    """The backward of :func:`ring_forward`, autograd-free: the same blocks go around the ring
    again with their gradient accumulators, which return to their owner after the last hop.
    Returns ``dq`` and the own block's ``dk``, ``dv`` (None where no tile touched it), and the
    cached prefix blocks' gradients by block (for :func:`accumulate_cache_grads`)."""
    cp, wide = layout.cp, accumulator_dtype(q)
    # what travels must have one shape on every rank: zeros where nothing came back
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    if not layout.return_lse:
        grad_lse = None
    elif grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    else:
        grad_lse = grad_lse.contiguous()
    dkv: dict[int, list[torch.Tensor]] = {}
    local = kv_blocks(k, v, prefix)
    args = (layout.spec, layout.scale, layout.kernels)
    n_kv = 2 + (0 if layout.pass_q else len(prefix))
    moving = [k, v] + ([] if layout.pass_q else list(prefix))
    if layout.pass_q:
        moving += [q, grad_out, out, lse] + ([] if grad_lse is None else [grad_lse])
    pending = _start(moving, cp) if cp.size > 1 else None
    dq = run_tiles_backward(grad_out, q, out, lse, local, layout.plan.local, *args, None, dkv,
                            grad_lse=grad_lse)  # fmt: skip
    kv_ids = [-1, *range((n_kv - 2) // 2)]
    accs: list[torch.Tensor] = []  # gradient accumulators of the visiting blocks / queries
    for hop in range(1, cp.size):
        assert pending is not None
        moving, src = pending.wait(), (cp.rank - hop) % cp.size
        pending = _start(moving, cp) if hop < cp.size - 1 else None
        held: list[torch.Tensor] = []
        if accs:  # accumulated so far for these blocks / queries (computed last hop)
            _STATS.add("own_kv", accs[:2])
            _STATS.add("prefix", accs[2:])
            held = _ring_shift(accs, cp)
        kv = kv_blocks(moving[0], moving[1], moving[2:n_kv])
        got: dict[int, list[torch.Tensor]] = {}
        dq = run_tiles_backward(grad_out, q, out, lse, kv, layout.plan.kv[src], *args, dq,
                                got, grad_lse=grad_lse)  # fmt: skip
        accs = []
        for i, block in enumerate(kv_ids):
            for which in (0, 1):
                g = (
                    got[block][which]
                    if block in got
                    else torch.zeros_like(kv[block][which], dtype=wide)
                )
                accs.append(g + held[2 * i + which] if held else g)
        if layout.pass_q:
            q_src, do_src, o_src, lse_src, *glse_src = moving[n_kv:]
            dq_src = held[-1] if held else None
            prefix_blocks = {j: b for j, b in local.items() if j >= 0}
            dq_src = run_tiles_backward(
                do_src, q_src, o_src, lse_src, prefix_blocks, layout.plan.q[src], *args,
                dq_src, dkv, grad_lse=glse_src[0] if glse_src else None,
            )  # fmt: skip
            accs.append(dq_src)
    if accs:  # every accumulator returns to its owner
        _STATS.add("own_kv", accs[:2])
        _STATS.add("prefix", accs[2:])
        home = _ring_shift(accs, cp)
        for i, block in enumerate(kv_ids):
            pair = dkv.setdefault(
                block, [torch.zeros_like(home[2 * i]), torch.zeros_like(home[2 * i + 1])]
            )
            pair[0] += home[2 * i]
            pair[1] += home[2 * i + 1]
        if layout.pass_q:
            dq += home[-1]
    own = dkv.pop(-1, None)
    dk = None if own is None else own[0].to(k.dtype)
    dv = None if own is None else own[1].to(v.dtype)
    return dq.to(q.dtype), dk, dv, dkv


class _CPAttention(torch.autograd.Function):
    """The eager form of :func:`ring_forward` / :func:`ring_backward`: returns the output and
    the merged LSE (the LSE's gradient is used when ``layout.return_lse``); the cached
    prefix's gradients go onto its cache entries (a latent cache's through its re-expansion,
    as in the unsharded attention)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, entries, *prefix):
        result, lse = ring_forward(q, k, v, prefix, layout)
        ctx.layout, ctx.entries = layout, entries
        ctx.save_for_backward(q, k, v, result, lse, *saved_prefix(entries, prefix))
        ctx.set_materialize_grads(False)  # an LSE nobody reads has no gradient: None
        return result, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        prefix, graphs = reexpanded_prefix(ctx.entries, saved)
        dq, dk, dv, dkv = ring_backward(grad_out, grad_lse, q, k, v, out, lse, prefix, ctx.layout)
        accumulate_cache_grads(ctx.entries, dkv)
        send_through_expansions(graphs, dkv)
        return (dq, dk, dv, None, None, *((None,) * len(prefix)))


def _prefix_by_queries(mode: str, info: SegmentInfo, used: Sequence[int], q, k) -> bool:
    """pass-Q or pass-KV for the cached prefix: by the bytes each would move per hop
    (forward + backward: Q, O and Q, dO, O, dQ for pass-Q; K, V and K, V, dK, dV of every cached
    block for pass-KV, i.e. ``6 L H d`` against ``6 P H_kv d`` for a segment of ``L`` tokens
    and a visible prefix of ``P``), the same decision on every CP rank."""
    if not used:
        return False  # nothing cached to reach: no prefix traffic at all
    if mode != "auto":
        return mode == "pass_q"
    bounds = info.bounds
    prefix_len = sum(bounds[j + 1] - bounds[j] for j in used)
    return info.length * q.shape[1] <= prefix_len * k.shape[1]


def ring_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    info: SegmentInfo,
    prefix: CachedPrefix,
    groups: RowGroups,
    spec: MaskSpec,
    scale: float,
    kernels: tuple[str, Any, Any],
    skip: bool,
    return_lse: bool = False,
) -> RingLayout:
    """The ring plan of one segment on this CP rank: pass-Q or pass-KV for the cached
    ``prefix``, and the tiles of every hop (the same decisions on every CP rank)."""
    cp = info.cp
    assert cp is not None
    bounds, used = info.bounds, prefix.used
    pass_q = _prefix_by_queries(cp.prefix, info, used, q, k)
    docs = info.documents
    q_runs = tuple(cp.runs(info.start, info.end, r, docs) for r in range(cp.size))
    prefix_runs = tuple(
        tuple(cp.runs(bounds[j], bounds[j + 1], r, docs) for j in used) for r in range(cp.size)
    )
    return RingLayout(
        cp=cp,
        plan=plan_ring(q_runs, prefix_runs, cp.rank, groups, spec, skip, pass_q),
        spec=spec,
        pass_q=pass_q,
        scale=scale,
        kernels=kernels,
        return_lse=return_lse,
    )


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    info: SegmentInfo,
    prefix: CachedPrefix,
    groups: RowGroups,
    spec: MaskSpec,
    scale: float,
    kernels: tuple[str, Any, Any],
    skip: bool,
    return_lse: bool = False,
) -> Any:
    """:func:`seq1f1b.chunk_aware_attention` inside a unit whose sequence is CP-sharded: this
    rank's shard of the segment's ``q``, ``k``, ``v`` against the whole segment and the cached
    ``prefix`` blocks it reads (``skip``: plan only the tiles with a visible pair; False is the
    mask-alone baseline). ``return_lse``: ``(out, lse)``, the LSE of this rank's queries over
    every key they see (ring and cached segments), with a gradient."""
    layout = ring_layout(q, k, info, prefix, groups, spec, scale, kernels, skip, return_lse)
    out, lse = _CPAttention.apply(q, k, v, layout, prefix.entries, *prefix.tensors())
    return (out, lse) if return_lse else out
