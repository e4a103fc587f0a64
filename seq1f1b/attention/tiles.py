"""Running a tile plan on local tensors: forward (merge by log-sum-exp) and exact backward.

Why a module of its own: the same tile loop serves a segment's attention on one device
(:mod:`seq1f1b.attention.layer`) and every hop of the context-parallel ring
(:mod:`seq1f1b.attention.context_parallel`), where a tensor holds several runs of absolute positions
(a load-balanced shard). The plans come ready-made from :mod:`seq1f1b.attention.masks`: a planned
call is ``(block, tile, q_shift, k_shift)`` (:func:`seq1f1b.attention.masks.place_tiles`), the
tile's absolute query range ``[q0, q1)`` at local indices ``[q0 + q_shift, q1 + q_shift)`` of the
query tensor, its keys likewise in block ``block`` of the key/value blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _runtime as rt
from .head_dims import one_head_dim_backward, one_head_dim_forward
from .masks import MaskSpec, PlanEntry, tile_mask

__all__ = ["kv_blocks", "merge", "merge_into", "run_tiles_backward", "run_tiles_forward"]

KV = tuple[torch.Tensor, torch.Tensor]


def kv_blocks(k: torch.Tensor, v: torch.Tensor, prefix: Sequence[torch.Tensor]) -> dict[int, KV]:
    """Blocks by plan index: -1 the segment's own K/V, j the j-th (k, v) pair of ``prefix``."""
    blocks: dict[int, KV] = {j: (prefix[2 * j], prefix[2 * j + 1]) for j in range(len(prefix) // 2)}
    blocks[-1] = (k, v)
    return blocks


def _with_lse_grad(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    blocks: Mapping[int, KV],
    grad_lse: torch.Tensor,
    used: set[int],
) -> tuple[torch.Tensor, torch.Tensor, dict[int, KV]]:
    """The backward's inputs when the log-sum-exp has a gradient too (an ``out_transform``
    such as learned sinks reads it): ``(grad_out', out', blocks')`` that a plain tile backward
    turns into the exact gradients.

    ``d lse_i / d s_ij = p_ij``, so a score's gradient becomes ``p_ij (dp_ij - delta_i +
    grad_lse_i)``. Each value block gains a column of ones and the output's gradient the
    column ``grad_lse`` (so ``dp_ij`` gains ``grad_lse_i``), while the output gains a zero
    column (so ``delta_i = rowsum(grad_out * out)`` stays): every kernel, flash or math,
    computes that as it is. The columns are padded to a multiple of 8 (flash kernels' head
    dims); the values' gradients carry them until :func:`_drop_lse_columns`. Only the blocks
    in ``used`` (those the plan touches) are widened: a ring hop holds every cached block."""
    extra = -(-(out.shape[-1] + 1) // 8) * 8 - out.shape[-1]

    def widen(t: torch.Tensor, first: torch.Tensor | float) -> torch.Tensor:
        col = t.new_zeros((*t.shape[:-1], extra))
        col[..., 0] = first
        return torch.cat([t, col], dim=-1)

    wide = {b: (k, widen(v, 1.0)) for b, (k, v) in blocks.items() if b in used}
    return widen(grad_out, grad_lse.to(grad_out.dtype)), widen(out, 0.0), wide


def _drop_lse_columns(dkv: dict[int, list[torch.Tensor]], width: int) -> None:
    """Cut the values' gradients back to the model's value head dim ``width`` (in place)."""
    for grads in dkv.values():
        grads[1] = grads[1][..., :width]


def _add_grads(dkv: dict[int, list[torch.Tensor]], more: dict[int, list[torch.Tensor]]) -> None:
    """``dkv[block] += more[block]`` for every block (taken as they are where ``dkv`` has
    none): the accumulators in ``dkv`` are the wide ones the tile loop made."""
    for block, grads in more.items():
        if block not in dkv:
            dkv[block] = grads
            continue
        dkv[block][0] += grads[0]
        dkv[block][1] += grads[1]


def expand_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def reduce_kv(g: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return g
    b, h, s, d = g.shape
    return g.view(b, h // n_rep, n_rep, s, d).sum(2)


def accumulator_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _merge_weight(
    lse_acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged LSE, weight of the new part): the accumulated part weighs ``1 - weight``, and
    rows with -inf on both sides get weight 0 (they stay 0). ``out``: where the merged LSE
    goes (``lse_acc`` itself for an in-place merge).

    The weight is ``exp(lse - new)`` where ``new`` is finite, else 0: ``logaddexp`` never
    rounds below its larger input, so ``lse - new <= 0`` wherever ``new`` is finite, and
    where it is not the difference is NaN (both -inf, an inf or NaN LSE) or -inf, which
    ``nan_to_num`` and ``exp`` make 0. That is ``where(isfinite(new), exp(lse - new), 0)``
    bit for bit, in three ops where it takes eight (``isfinite`` alone is four): the merge
    runs once per tile after a segment's first, so its ops are a host cost per tile."""
    new = torch.logaddexp(lse_acc, lse, out=out)
    weight = torch.exp(lse - new).nan_to_num_(0.0)
    return new, weight.unsqueeze(-1)


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor):
    """Combine two partial softmax results by log-sum-exp (rows with -inf on both stay 0):
    ``out_acc + w (o - out_acc)``, one pass over the outputs (``torch.lerp``)."""
    new, weight = _merge_weight(lse_acc, lse)
    return torch.lerp(out_acc, o.to(out_acc.dtype), weight), new


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor, lse: torch.Tensor):
    """:func:`merge` written into ``out_acc`` / ``lse_acc`` (views of the accumulators): no
    output-sized temporary, no copy back (the merged LSE is written over ``lse_acc`` as it is
    computed: each element reads only its own)."""
    _, weight = _merge_weight(lse_acc, lse, out=lse_acc)
    out_acc.lerp_(o.to(out_acc.dtype), weight)


# ----------------------------------------------------------------------------- math kernels
def _math_scores(q, k, causal: bool, scale: float, visible: torch.Tensor | None, acc):
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def math_forward(q, k, v, causal: bool, scale: float, visible: torch.Tensor | None = None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = _math_scores(q, k, causal, scale, visible, acc)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc))
    return out.nan_to_num(0.0).to(q.dtype), lse


def math_backward(g, q, k, v, out, lse, causal: bool, scale: float, visible=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_, k_, v_, g_ = q.to(acc), k.to(acc), v.to(acc), g.to(acc)
    s = _math_scores(q, k, causal, scale, visible, acc)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), g_)
    dp = torch.matmul(g_, v_.transpose(-1, -2))
    delta = (g_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return ds.matmul(k_).to(q.dtype), ds.transpose(-1, -2).matmul(q_).to(k.dtype), dv.to(v.dtype)


def _cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


#: the CPU flash kernels of masked tiles, for any value head dim
_masked_cpu_forward = one_head_dim_forward(rt.flash_cpu_forward)
_masked_cpu_backward = one_head_dim_backward(rt.flash_cpu_backward)


def _host_mask(t: Any, spec: MaskSpec, device: torch.device) -> torch.Tensor:
    """A masked tile's visibility, made from the plan (host data: a real tensor in a dry run
    too, where the tile's emptiness is read)."""
    with rt.outside_fake_mode():
        return tile_mask(t, spec, device)


def masked_forward(q, k, v, visible: torch.Tensor, scale: float):
    """One masked tile: (out, lse) with out 0 and lse -inf on rows that see no key."""
    if _cpu_flash(q):
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        out, lse = _masked_cpu_forward(q, k, v, False, scale, bias)
    else:  # GPU masked tiles: plain torch (the fast GPU paths are whole-tile kernels)
        out, lse = math_forward(q, k, v, False, scale, visible)
    with rt.outside_fake_mode():  # the mask is planned on the host: real in a dry run too
        empty = ~visible.any(-1)
        any_empty = bool(empty.any())
    if any_empty:
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def masked_backward(g, q, k, v, out, lse, visible: torch.Tensor, scale: float):
    if _cpu_flash(q):
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
        return _masked_cpu_backward(g, q, k, v, out, lse, False, scale, bias)
    return math_backward(g, q, k, v, out, lse, False, scale, visible)


def _slices(entry: PlanEntry) -> tuple[slice, slice, slice]:
    _, t, qsh, ksh = entry
    return slice(t.r0, t.r1), slice(t.q0 + qsh, t.q1 + qsh), slice(t.k0 + ksh, t.k1 + ksh)


def covers_queries(entry: PlanEntry, q: torch.Tensor) -> bool:
    """Whether the tile spans every row and query position of ``q`` (its result is then the
    whole accumulator, not a part to merge into one)."""
    _, t, qsh, _ = entry
    return t.r0 == 0 and t.r1 == q.shape[0] and t.q0 + qsh == 0 and t.q1 + qsh == q.shape[-2]


def covers_keys(entry: PlanEntry, kb: torch.Tensor) -> bool:
    """Whether the tile spans every row and key position of its block ``kb``."""
    _, t, _, ksh = entry
    return t.r0 == 0 and t.r1 == kb.shape[0] and t.k0 + ksh == 0 and t.k1 + ksh == kb.shape[-2]


def new_accumulator(like: torch.Tensor, shape: Any, fill: float, dtype: torch.dtype):
    """A filled accumulator (output 0, LSE -inf, gradient 0): one place that allocates them,
    so the tests can count the ones the single-tile fast path avoids."""
    return torch.full(shape, fill, dtype=dtype, device=like.device)


def output_shape(q: torch.Tensor, blocks: Mapping[int, KV]) -> tuple[int, ...]:
    """The attention output's shape: the queries' with the values' head dim (which may differ
    from the queries': DeepSeek-V3's MLA)."""
    dv = next(iter(blocks.values()))[1].shape[-1] if blocks else q.shape[-1]
    return (*q.shape[:-1], dv)


def run_tiles_forward(
    q: torch.Tensor,
    blocks: Mapping[int, KV],
    plan: Sequence[PlanEntry],
    spec: MaskSpec,
    scale: float,
    kernels: tuple[str, Any, Any],
    out_acc: torch.Tensor | None = None,
    lse_acc: torch.Tensor | None = None,
    *,
    final: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The planned tiles' softmax results merged into ``out_acc`` / ``lse_acc`` (in place when
    given) and returned.

    Without accumulators, a first tile that spans all of ``q`` *is* the result (merging it
    into 0 / -inf is the identity, bit for bit): no zero buffer, no merge. A segment with a
    single tile (the first segment, K = 1) thus costs exactly one kernel call. ``final``: the
    caller merges nothing more into the result, so a lone tile's output also keeps the
    kernel's dtype (no round trip through the fp32 accumulator for bf16)."""
    fwd = kernels[1]
    acc = accumulator_dtype(q)
    lone = final and len(plan) == 1
    for entry in plan:
        kb, vb = blocks[entry[0]]
        t = entry[1]
        rows, qs, ks = _slices(entry)
        n_rep = q.shape[1] // kb.shape[1]
        qt = q[rows, :, qs]
        kt, vt = expand_kv(kb[rows, :, ks], n_rep), expand_kv(vb[rows, :, ks], n_rep)
        if t.kind == "masked":
            o, lse = masked_forward(qt, kt, vt, _host_mask(t, spec, q.device), scale)
        else:
            o, lse = fwd(qt, kt, vt, t.kind == "causal", scale)
        if out_acc is None and covers_queries(entry, q):
            out_acc, lse_acc = (o if lone else o.to(acc)), lse.to(acc)
            continue
        if out_acc is None or lse_acc is None:
            out_acc = new_accumulator(q, output_shape(q, blocks), 0.0, acc)
            lse_acc = new_accumulator(q, q.shape[:-1], float("-inf"), acc)
        merge_into(out_acc[rows, :, qs], lse_acc[rows, :, qs], o, lse.to(lse_acc.dtype))
    if out_acc is None or lse_acc is None:  # nothing planned: no query sees a key
        out_acc = new_accumulator(q, output_shape(q, blocks), 0.0, acc)
        lse_acc = new_accumulator(q, q.shape[:-1], float("-inf"), acc)
    return out_acc, lse_acc


def run_tiles_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: Mapping[int, KV],
    plan: Sequence[PlanEntry],
    spec: MaskSpec,
    scale: float,
    kernels: tuple[str, Any, Any],
    dq: torch.Tensor | None,
    dkv: dict[int, list[torch.Tensor]],
    *,
    final: bool = False,
    grad_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact gradients of the planned tiles, given the merged ``out`` / ``lse``: added into
    ``dq`` (returned; created when None) and ``dkv[block] = [dk, dv]`` (wide accumulators).
    ``grad_lse``: the LSE's gradient too, when an ``out_transform`` read it
    (:func:`_with_lse_grad`; the tiles then run into a dict of their own, added into ``dkv``).

    A tile's gradient that spans the whole of ``q`` (or of its key block) and lands first is
    taken as the accumulator itself instead of being added into a zero one. ``final``: nothing
    is added to these gradients after this call, so a gradient made by one tile alone keeps
    the kernel's dtype."""
    if grad_lse is not None and plan:
        used = {entry[0] for entry in plan}
        width = blocks[next(iter(used))][1].shape[-1]
        grad_out, out, wide_blocks = _with_lse_grad(grad_out, out, blocks, grad_lse, used)
        own: dict[int, list[torch.Tensor]] = {}
        dq = run_tiles_backward(grad_out, q, out, lse, wide_blocks, plan, spec, scale, kernels,
                                dq, own, final=final and not dkv)  # fmt: skip
        _drop_lse_columns(own, width)
        _add_grads(dkv, own)
        return dq
    bwd = kernels[2]
    grad_out = grad_out.contiguous()  # once: the flash kernels want it so, tile by tile
    wide = accumulator_dtype(q)
    lone_q = final and len(plan) == 1
    per_block = Counter(entry[0] for entry in plan) if final else Counter()
    for entry in plan:
        block, t = entry[0], entry[1]
        kb, vb = blocks[block]
        rows, qs, ks = _slices(entry)
        n_rep = q.shape[1] // kb.shape[1]
        kt, vt = expand_kv(kb[rows, :, ks], n_rep), expand_kv(vb[rows, :, ks], n_rep)
        args = (grad_out[rows, :, qs], q[rows, :, qs], kt, vt, out[rows, :, qs])
        if t.kind == "masked":
            visible = _host_mask(t, spec, q.device)
            dqt, dkt, dvt = masked_backward(*args, lse[rows, :, qs], visible, scale)
        else:
            dqt, dkt, dvt = bwd(*args, lse[rows, :, qs], t.kind == "causal", scale)
        if dq is None and covers_queries(entry, q):
            dq = dqt if lone_q else dqt.to(wide)
        else:
            if dq is None:
                dq = new_accumulator(q, q.shape, 0.0, wide)
            dq[rows, :, qs] += dqt
        dkt, dvt = reduce_kv(dkt, n_rep), reduce_kv(dvt, n_rep)
        if block not in dkv and covers_keys(entry, kb):
            lone = per_block[block] == 1
            dkv[block] = [dkt if lone else dkt.to(wide), dvt if lone else dvt.to(wide)]
            continue
        if block not in dkv:
            dkv[block] = [
                new_accumulator(kb, kb.shape, 0.0, wide),
                new_accumulator(vb, vb.shape, 0.0, wide),
            ]
        dkv[block][0][rows, :, ks] += dkt
        dkv[block][1][rows, :, ks] += dvt
    if dq is None:
        dq = new_accumulator(q, q.shape, 0.0, wide)
    return dq
