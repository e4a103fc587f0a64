"""Chunk-aware attention: segment-by-segment forward/backward equals full causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

from seq1f1b import SegmentInfo, add_layer_key, chunk_aware_attention, current_segment
from seq1f1b.attention import masks
from seq1f1b.attention.kernels import _cpu_bwd, _cpu_fwd
from seq1f1b.attention.kv import ContextParallel, StageKVState, UnitContext, activate
from seq1f1b.attention.tiles import math_backward as _math_bwd
from seq1f1b.attention.tiles import math_forward as _math_fwd
from seq1f1b.schedules.partition import segment_offsets

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds


def _qkv(dtype: torch.dtype, h: int = 4, hkv: int = 2, s: int = 20, seed: int = 0, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads, d=8: torch.randn(2, heads, s, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(h), mk(hkv), mk(hkv, dv)


def _segmented(q, k, v, lengths, checkpoint_like: bool = False):
    """Run the segments like the schedule does: forward 0..K-1, backward K-1..0."""
    state = StageKVState(0, len(lengths))
    starts = segment_offsets(lengths)
    outs = []
    for seg, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        info = SegmentInfo(0, seg, len(lengths), a, n, sum(lengths), (*starts, sum(lengths)))
        state.begin_forward(0, seg)
        with activate(UnitContext(state, info, "forward", True)):
            assert current_segment() == info
            outs.append(
                chunk_aware_attention(
                    q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], layer="attn"
                )
            )
        state.end_forward(0, seg, keep=True)
    return state, starts, outs


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("lengths", [[20], [10, 10], [9, 6, 5], [2, 3, 4, 5, 6]])
def test_segments_equal_full_attention(dtype, tol, lengths, dv: int = 8) -> None:
    q, k, v = _qkv(dtype, dv=dv)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    state, starts, outs = _segmented(q, k, v, lengths)
    out = torch.cat(outs, dim=2)
    assert ((out - ref).float().norm() / ref.float().norm()).item() <= tol
    for seg in reversed(range(len(lengths))):
        a, n = starts[seg], lengths[seg]
        state.begin_backward(0, seg)
        info = SegmentInfo(0, seg, len(lengths), a, n, sum(lengths), (*starts, sum(lengths)))
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(outs[seg], go[:, :, a : a + n])
        state.end_backward(0, seg)
    assert state.is_empty()
    for t, r in zip((q, k, v), ref_grads, strict=True):
        assert ((t.grad - r).float().norm() / r.float().norm()).item() <= tol


@pytest.mark.parametrize("dv", [5, 12])
@pytest.mark.parametrize("lengths", [[20], [9, 6, 5]])
def test_value_head_dim_may_differ(lengths, dv: int) -> None:
    """Values narrower (DeepSeek-V3's MLA: v 128 against q/k 192) or wider than the queries and
    keys: forward and every gradient equal full causal attention, segment by segment."""
    test_segments_equal_full_attention(torch.float32, 1e-5, lengths, dv)


def test_cpu_flash_block_kernels_match_math() -> None:
    q, k, v = (t.detach() for t in _qkv(torch.float64, h=2, hkv=2))
    for causal in (False, True):
        o1, l1 = _cpu_fwd(q, k, v, causal, 0.3)
        o2, l2 = _math_fwd(q, k, v, causal, 0.3)
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(l1, l2)
        g = torch.randn_like(o1)
        for a, b in zip(
            _cpu_bwd(g, q, k, v, o1, l1, causal, 0.3),
            _math_bwd(g, q, k, v, o1, l1, causal, 0.3),
            strict=True,
        ):
            torch.testing.assert_close(a, b)


def test_outside_a_step_it_is_plain_causal_sdpa() -> None:
    q, k, v = _qkv(torch.float32)
    assert current_segment() is None
    out = chunk_aware_attention(q, k, v, layer="x")
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )


def test_kv_heads_must_divide_q_heads() -> None:
    q, k, v = _qkv(torch.float32, h=4, hkv=3)
    with pytest.raises(ValueError, match="multiple of the number of K/V heads"):
        chunk_aware_attention(q, k, v, layer="x")


def test_layer_called_twice_in_one_unit_raises() -> None:
    q, k, v = _qkv(torch.float32)
    state = StageKVState(0, 2)
    info = SegmentInfo(0, 0, 2, 0, 20, 40, (0, 20, 40))
    with activate(UnitContext(state, info, "forward", True)):
        chunk_aware_attention(q, k, v, layer="x")
        with pytest.raises(RuntimeError, match="exactly once per unit forward"):
            chunk_aware_attention(q, k, v, layer="x")


def test_no_kv_copy_is_saved() -> None:
    """The cached K/V share storage with the owning segment's k/v: no prefix concatenation."""
    q, k, v = _qkv(torch.float32)
    state, _, _ = _segmented(q, k, v, [10, 10])
    entry = state.layer_entries(0, "attn")[0]
    assert entry.k.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert state.layer_entries(0, "attn")[1] is None  # the last segment is never read again


def _attend_shard(qkv, info: SegmentInfo) -> torch.Tensor:
    """This CP rank's shard of the segment ``info`` of full-sequence ``q, k, v``."""
    shard = [torch.cat([t[:, :, a:b] for a, b in info.local_runs], 2) for t in qkv]
    return chunk_aware_attention(*shard, layer="attn", window=5, sinks=2)


def _ring_case(rank: int, world: int, mode: str, calls: list[int]) -> None:
    """Two segments on a CP ring: a forward without a graph (as checkpointing does), then the
    backward with its recomputation, which must place no tile (``calls`` counts them)."""
    cp = ContextParallel(dist.group.WORLD, rank, world, mode)
    infos = [SegmentInfo(0, seg, 2, 8 * seg, 8, 16, (0, 8, 16), None, cp) for seg in (0, 1)]
    qkv = _qkv(torch.float64, s=16)
    state = StageKVState(0, 2)
    with torch.no_grad():
        for info in infos:
            state.begin_forward(0, info.segment)
            with activate(UnitContext(state, info, "forward", True)):
                _attend_shard(qkv, info)
            state.end_forward(0, info.segment, keep=True)
    built = calls[0]
    assert built > 0, "the counter sees no plan being built"
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            _attend_shard(qkv, info).sum().backward()  # recomputation: every hop again
        state.end_backward(0, info.segment)
    assert calls[0] == built, (mode, rank, built, calls[0])
    assert all(t.grad is not None for t in qkv)


def _ring_plans_are_built_once(rank: int, world: int) -> None:
    real, calls = masks.place_tiles, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    masks.place_tiles = counting
    try:
        for mode in ("pass_q", "pass_kv"):
            masks.plan_ring.cache_clear()
            calls[0] = 0
            _ring_case(rank, world, mode, calls)
    finally:
        masks.place_tiles = real


def test_ring_tile_plans_are_built_once_per_segment() -> None:
    """Context parallelism: a segment's tile plan (every hop of the ring) is built once; the
    backward's hops and the checkpoint recomputation reuse it instead of placing the tiles
    again per hop (they did: forward, backward and recomputation each rebuilt every hop's)."""
    run_ranks(_ring_plans_are_built_once, 2)


class _Counting:
    """Counts calls of a tiles helper (the single-tile fast path must skip them)."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _unit_fwd_bwd(q, k, v, go, lengths, seg_counts, monkeypatch):
    """Segments forward 0..K-1 and backward K-1..0 with merge / accumulator calls counted per
    segment: ``seg_counts[seg] = (merges, accumulators)``."""
    from seq1f1b.attention import tiles

    merge, acc = _Counting(tiles.merge_into), _Counting(tiles.new_accumulator)
    monkeypatch.setattr(tiles, "merge_into", merge)
    monkeypatch.setattr(tiles, "new_accumulator", acc)
    state = StageKVState(0, len(lengths))
    starts = segment_offsets(lengths)
    infos = [
        SegmentInfo(0, s, len(lengths), a, n, sum(lengths), (*starts, sum(lengths)))
        for s, (a, n) in enumerate(zip(starts, lengths, strict=True))
    ]
    outs = []
    for info in infos:
        a, n = info.start, info.length
        before = (merge.calls, acc.calls)
        state.begin_forward(0, info.segment)
        with activate(UnitContext(state, info, "forward", True)):
            outs.append(
                chunk_aware_attention(
                    q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], layer="attn"
                )
            )
        state.end_forward(0, info.segment, keep=True)
        seg_counts[info.segment] = (merge.calls - before[0], acc.calls - before[1])
    for info in reversed(infos):
        a, n = info.start, info.length
        before = (merge.calls, acc.calls)
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(outs[info.segment], go[:, :, a : a + n])
        state.end_backward(0, info.segment)
        f_merge, f_acc = seg_counts[info.segment]
        seg_counts[info.segment] = (
            f_merge + merge.calls - before[0],
            f_acc + acc.calls - before[1],
        )
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_tile_skips_merge_and_staging(dtype, monkeypatch) -> None:
    """A segment whose attention is one tile (the first segment here) runs the kernel alone:
    no LSE merge, no zero accumulator for the output, dQ, dK or dV. Later segments merge
    every tile after the first into the first one's result (so the counter is live) and
    still stage nothing, since every tile spans its whole key block."""
    q, k, v = _qkv(dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    counts: dict[int, tuple[int, int]] = {}
    out = _unit_fwd_bwd(q, k, v, go, [8, 7, 5], counts, monkeypatch)
    assert counts[0] == (0, 0)
    assert counts[1] == (1, 0) and counts[2] == (2, 0)  # one merge per tile after the first
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert ((out - ref).float().norm() / ref.float().norm()).item() <= tol
    for t, r in zip((q, k, v), ref_grads, strict=True):
        assert ((t.grad - r).float().norm() / r.float().norm()).item() <= tol


def test_single_tile_segment_is_the_kernel_output_bitwise() -> None:
    """The first segment's output and gradients are exactly the kernel's: what the fast path
    returns equals merging the tile into 0 / -inf accumulators and adding its gradients into
    zero buffers (the path it replaces), bit for bit."""
    from seq1f1b.attention import tiles

    q, k, v = (t.detach() for t in _qkv(torch.float32, s=12))
    plan = masks.plan_segment(0, 12, (), ((0, 2, ((0, 12),)),), masks.MaskSpec())
    assert len(plan) == 1 and tiles.covers_queries(plan[0], q)
    kernels = ("cpu_flash", _cpu_fwd, _cpu_bwd)
    blocks = tiles.kv_blocks(k, v, [])
    args = (plan, masks.MaskSpec(), 0.3, kernels)
    fast = tiles.run_tiles_forward(q, blocks, *args)
    zero, ninf = torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf"))
    slow = tiles.run_tiles_forward(q, blocks, *args, zero, ninf)
    assert slow[0] is zero  # the accumulators were given: merged into, in place
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    g = torch.randn(q.shape)
    dkv_fast: dict[int, list[torch.Tensor]] = {}
    dq_fast = tiles.run_tiles_backward(g, q, fast[0], fast[1], blocks, *args, None, dkv_fast)
    dkv_slow = {-1: [torch.zeros(k.shape), torch.zeros(v.shape)]}
    dq_slow = tiles.run_tiles_backward(
        g, q, fast[0], fast[1], blocks, *args, torch.zeros(q.shape), dkv_slow
    )
    assert torch.equal(dq_fast, dq_slow)
    for a, b in zip(dkv_fast[-1], dkv_slow[-1], strict=True):
        assert torch.equal(a, b)


def test_single_tile_equals_the_same_rows_as_several_tiles() -> None:
    """One tile over every row gives the result of the same queries planned as one tile per
    row group (which merges into accumulators)."""
    from seq1f1b.attention import tiles

    q, k, v = (t.detach() for t in _qkv(torch.float64, s=12))
    kernels = ("cpu_flash", _cpu_fwd, _cpu_bwd)
    blocks = tiles.kv_blocks(k, v, [])
    one = masks.plan_segment(0, 12, (), ((0, 2, ((0, 12),)),), masks.MaskSpec())
    two = masks.plan_segment(0, 12, (), ((0, 1, ((0, 12),)), (1, 2, ((0, 12),))), masks.MaskSpec())
    assert len(one) == 1 and len(two) == 2
    res = [
        tiles.run_tiles_forward(q, blocks, p, masks.MaskSpec(), 0.3, kernels) for p in (one, two)
    ]
    torch.testing.assert_close(res[0], res[1], rtol=0, atol=1e-13)
    g = torch.randn(q.shape, dtype=q.dtype)
    grads = []
    for p in (one, two):
        dkv: dict[int, list[torch.Tensor]] = {}
        dq = tiles.run_tiles_backward(
            g, q, *res[0], blocks, p, masks.MaskSpec(), 0.3, kernels, None, dkv
        )
        grads.append((dq, *dkv[-1]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def test_lone_tile_keeps_the_kernel_dtype_bitwise() -> None:
    """bf16: a lone tile's output and gradients stay bf16 (no fp32 round trip) and equal the
    accumulated path's, rounded back, bit for bit; a tile that is not alone is widened."""
    from seq1f1b.attention import tiles

    q, k, v = (t.detach() for t in _qkv(torch.bfloat16, s=12))
    spec = masks.MaskSpec()
    plan = masks.plan_segment(0, 12, (), ((0, 2, ((0, 12),)),), spec)
    kernels = ("cpu_flash", _cpu_fwd, _cpu_bwd)
    blocks = tiles.kv_blocks(k, v, [])
    lone = tiles.run_tiles_forward(q, blocks, plan, spec, 0.3, kernels, final=True)
    wide = tiles.run_tiles_forward(q, blocks, plan, spec, 0.3, kernels)
    assert lone[0].dtype == torch.bfloat16 and wide[0].dtype == torch.float32
    assert torch.equal(lone[0], wide[0].to(torch.bfloat16)) and torch.equal(lone[1], wide[1])
    g = torch.randn(q.shape).to(torch.bfloat16)
    got = []
    for final in (True, False):
        dkv: dict[int, list[torch.Tensor]] = {}
        dq = tiles.run_tiles_backward(
            g, q, lone[0], lone[1], blocks, plan, spec, 0.3, kernels, None, dkv, final=final
        )
        got.append((dq, *dkv[-1]))
    assert all(t.dtype == torch.bfloat16 for t in got[0])
    assert all(t.dtype == torch.float32 for t in got[1])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))


def _sink_reference(q, k, v, sink, window):
    """Dense attention with a learned per-head sink logit (a key of value 0 every query sees,
    GPT-OSS's): causal, within ``window`` keys when set."""
    n_rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None]
    vis = (j <= i) & ((i - j < window) if window is not None else True)
    s = s.masked_fill(~vis, float("-inf"))
    sinks = sink.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sinks], -1), -1)[..., :-1]
    return p @ vv


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("lengths", "dv"), [([20], 8), ([9, 6, 5], 8), ([9, 6, 5], 5)])
def test_sinks_on_the_lse_merged_over_segments(lengths, dv: int, window) -> None:
    """``return_lse=True`` gives the log-sum-exp over every key a query sees (all segments),
    with a gradient: GPT-OSS's sink rescale ``out * sigmoid(lse - sink)`` on it equals dense
    attention with the sink logit as an extra key, forward and every gradient (q, k, v and
    the sinks), segment by segment, sliding window or not, any value head dim."""
    q, k, v = _qkv(torch.float64, dv=dv)
    sink = torch.randn(q.shape[1], dtype=torch.float64, requires_grad=True)
    ref = _sink_reference(q, k, v, sink, window)
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sink), go)
    state = StageKVState(0, len(lengths))
    starts, total, outs = segment_offsets(lengths), sum(lengths), []
    infos = [SegmentInfo(0, j, len(lengths), a, n, total, (*starts, total))
             for j, (a, n) in enumerate(zip(starts, lengths, strict=True))]  # fmt: skip
    for j, info in enumerate(infos):
        a, n = info.start, info.length
        state.begin_forward(0, j)
        with activate(UnitContext(state, info, "forward", True)):
            out, lse = chunk_aware_attention(
                q[:, :, a : a + n], k[:, :, a : a + n], v[:, :, a : a + n], layer="attn",
                window=window, return_lse=True,
            )  # fmt: skip
        assert lse.shape == out.shape[:-1] and lse.dtype == torch.float64
        outs.append(out * torch.sigmoid(lse - sink.view(1, -1, 1)).unsqueeze(-1))
        state.end_forward(0, j, keep=True)
    torch.testing.assert_close(torch.cat(outs, 2), ref)
    for j in reversed(range(len(lengths))):
        a, n = infos[j].start, infos[j].length
        state.begin_backward(0, j)
        with activate(UnitContext(state, infos[j], "backward", True)):
            torch.autograd.backward(outs[j], go[:, :, a : a + n])
        state.end_backward(0, j)
    assert state.is_empty()
    for t, r in zip((q, k, v, sink), ref_grads, strict=True):
        torch.testing.assert_close(t.grad, r)


def test_lse_outside_a_step_is_the_full_softmax_normaliser() -> None:
    q, k, v = _qkv(torch.float64)
    out, lse = chunk_aware_attention(q, k, v, layer="x", return_lse=True)
    kk = k.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2) / 8**0.5).masked_fill(
        torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf")
    )
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                   enable_gqa=True))  # fmt: skip


#: (dtype, how cached segments are reached, window) of the ring's sink cases ("auto" picks
#: pass-Q for the second segment and pass-KV for the third: 4 query heads, 2 K/V heads)
_RING_SINK_CASES = [(torch.float64, "pass_q", 7), (torch.float64, "pass_kv", 7),
                    (torch.float64, "pass_q", None), (torch.float32, "auto", 7)]  # fmt: skip


def _sinks_on_the_ring(rank: int, world: int, compiled: bool = False) -> None:
    """Each case: a sample in uneven segments of 4, 2 and 6 times 2 * cp tokens, GQA, learned
    sinks on the LSE of this rank's shard, against the dense reference. ``compiled``: the
    attention under ``torch.compile(fullgraph=True)`` (its custom ops run the ring)."""
    lengths = [4 * world, 2 * world, 6 * world]
    starts, total = segment_offsets(lengths), sum(lengths)
    layer = add_layer_key(torch.nn.Module()) if compiled else "attn"

    def eager(q, k, v, window):
        return chunk_aware_attention(q, k, v, layer=layer, window=window, return_lse=True)

    for dtype, mode, window in _RING_SINK_CASES:
        attend = eager
        if compiled:  # graphs of their own per case (its window is a constant of the graph)
            torch.compiler.reset()
            attend = torch.compile(eager, fullgraph=True, backend="aot_eager")
        q, k, v = _qkv(dtype, s=total, dv=6)
        sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(1),
                           dtype=dtype).requires_grad_()  # fmt: skip
        ref = _sink_reference(q, k, v, sink, window)
        go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
        ref_grads = torch.autograd.grad(ref, (q, k, v, sink), go)
        cp = ContextParallel(dist.group.WORLD, rank, world, mode)
        infos = [SegmentInfo(0, j, 3, a, n, total, (*starts, total), None, cp)
                 for j, (a, n) in enumerate(zip(starts, lengths, strict=True))]  # fmt: skip
        state, outs = StageKVState(0, 3), []
        for info in infos:
            state.begin_forward(0, info.segment)
            with activate(UnitContext(state, info, "forward", True)):
                shard = [torch.cat([t[:, :, a:b] for a, b in info.local_runs], 2)
                         for t in (q, k, v)]  # fmt: skip
                out, lse = attend(*shard, window)
            assert lse.shape == out.shape[:-1]
            outs.append(out * torch.sigmoid(lse - sink.view(1, -1, 1)).unsqueeze(-1))
            want = torch.cat([ref[:, :, a:b] for a, b in info.local_runs], 2)
            torch.testing.assert_close(outs[-1], want.detach(), msg=f"{mode} {window} {dtype}")
            state.end_forward(0, info.segment, keep=True)
        for info in reversed(infos):
            state.begin_backward(0, info.segment)
            with activate(UnitContext(state, info, "backward", True)):
                g = torch.cat([go[:, :, a:b] for a, b in info.local_runs], 2)
                torch.autograd.backward(outs[info.segment], g)
            state.end_backward(0, info.segment)
        assert state.is_empty()
        for name, t, r in zip("qkvs", (q, k, v, sink), ref_grads, strict=True):
            grad = t.grad.clone()  # this rank's queries' part: summed over the ring
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, r, msg=f"d{name}: {mode} {window} {dtype}")


def test_learned_sinks_on_the_ring_equal_full_attention() -> None:
    """Context parallelism (cp = 2) with ``return_lse=True``: each rank's LSE is merged over
    the ring and every cached segment, so GPT-OSS's sink rescale on it equals dense attention
    with the sink logit as an extra key over the whole sequence: outputs, and the gradients of
    q, k, v and the sinks summed over the CP ranks, pass-Q (the queries' ``grad_lse`` travels
    with their ``dO``) and pass-KV for the cached segments, with a sliding window of 7 (it
    cuts the segment boundaries) and without, fp64 and fp32."""
    run_ranks(_sinks_on_the_ring, 2)


def _window_cache_peak(seq_len: int, k: int, window: int | None) -> int:
    """Peak K/V cache bytes of one attention layer over a sample cut into ``k`` equal
    segments (forwards 0..K-1 then backwards, as the schedule runs them)."""
    q, kk, v = _qkv(torch.float32, s=seq_len)
    lengths = [seq_len // k] * k
    state, starts = StageKVState(0, k), segment_offsets(lengths)
    outs = []
    for seg, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        info = SegmentInfo(0, seg, k, a, n, seq_len, (*starts, seq_len))
        state.begin_forward(0, seg)
        with activate(UnitContext(state, info, "forward", True)):
            sl = slice(a, a + n)
            outs.append(chunk_aware_attention(q[:, :, sl], kk[:, :, sl], v[:, :, sl],
                                              layer="attn", window=window))  # fmt: skip
        state.end_forward(0, seg, keep=True)
    return state.peak_bytes


def test_windowed_layers_cache_one_window_per_earlier_segment() -> None:
    """A sliding-window layer caches, of each earlier segment, only the ``window - 1`` keys a
    later query can see: its cache does not grow with the sequence beyond the window (a full
    causal layer's grows with it), and each earlier segment holds one window's bytes (its
    backward needs them until the next segment's backward has run)."""
    window, k = 16, 4
    per_position = 2 * 2 * 2 * 8 * 4  # k and v, batch 2, 2 K/V heads, head dim 8, fp32
    peaks = {s: _window_cache_peak(s, k, window) for s in (64, 128, 256)}
    assert set(peaks.values()) == {(k - 1) * (window - 1) * per_position}, peaks
    full = {s: _window_cache_peak(s, k, None) for s in (64, 128)}
    assert full[128] == 2 * full[64] == 2 * (k - 1) * (64 // k) * per_position
