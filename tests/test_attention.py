"""Chunk-aware attention: segment-by-segment forward/backward equals full causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

from seq1f1b import SegmentInfo, chunk_aware_attention, current_segment, masks
from seq1f1b.attention import _cpu_bwd, _cpu_fwd
from seq1f1b.kv import ContextParallel, StageKVState, UnitContext, activate
from seq1f1b.partition import segment_offsets
from seq1f1b.tiles import math_backward as _math_bwd
from seq1f1b.tiles import math_forward as _math_fwd


def _qkv(dtype: torch.dtype, h: int = 4, hkv: int = 2, s: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(2, heads, s, 8, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(h), mk(hkv), mk(hkv)


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
def test_segments_equal_full_attention(dtype, tol, lengths) -> None:
    q, k, v = _qkv(dtype)
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
