"""Packed documents, sliding windows and sinks: segment-by-segment attention equals a dense-mask
math reference, invisible blocks are neither computed nor cached, and bad masks fail early."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch

from seq1f1b import SegmentInfo, chunk_aware_attention, packed_documents
from seq1f1b.attention import masks
from seq1f1b.attention.kv import (
    StageKVState,
    UnitContext,
    activate,
    attention_work,
    document_cp_layout,
    zigzag_runs,
)
from seq1f1b.attention.mask_mods import CausalBigBird, VisiblePrefix
from seq1f1b.attention.masks import (
    MaskSpec,
    document_runs,
    first_seen,
    plan_tiles,
    tile_mask,
    visible_blocks,
)
from seq1f1b.attention.tiles import math_forward as _math_fwd
from seq1f1b.schedules.partition import segment_offsets

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

S = 24
DOCS = torch.tensor(
    [
        [0] * 3 + [1] * 18 + [2] * 3,  # document 1 spans three segments of 8
        [0] * 24,  # no boundary at all
        [0] * 8 + [1] * 16,  # boundary exactly at a segment boundary
        [0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6, 6, 6, 7, 7, 8, 9],  # short docs
    ]
)


def visible(docs: torch.Tensor | None, spec: MaskSpec, b: int = 4) -> torch.Tensor:
    """Dense (batch, S, S) visibility: causal, same document, window / sinks."""
    i = torch.arange(S).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    vis = (j <= i).expand(b, S, S).clone()
    if docs is not None:
        vis &= docs[:, :, None] == docs[:, None, :]
    if spec.window is not None:
        vis &= (i - j < spec.window) | (j < spec.sinks)
    if spec.mask_mod is not None:  # FlexAttention's convention, on the dense grid
        vis &= spec.mask_mod(0, 0, i, j)
    return vis


def _qkv(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(4, heads, S, 8, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(4), mk(2), mk(2)


def reference(q, k, v, vis):
    out, _ = _math_fwd(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), False, 8**-0.5, vis[:, None]
    )
    return out


def segmented(q, k, v, lengths, docs, spec, skip: bool = True, backend: str = "tiles"):
    """Forward 0..K-1 then backward K-1..0 like the schedule; returns output and the state."""
    state = StageKVState(0, len(lengths), skip_invisible=skip)
    starts = segment_offsets(lengths)
    bounds = (*starts, S)
    groups = None if docs is None else document_runs(docs)
    infos = [
        SegmentInfo(0, s, len(lengths), a, n, S, bounds, groups)
        for s, (a, n) in enumerate(zip(starts, lengths, strict=True))
    ]
    kw = {"window": spec.window, "sinks": spec.sinks, "mask_backend": backend,
          "mask_mod": spec.mask_mod}  # fmt: skip

    def attend(info: SegmentInfo) -> torch.Tensor:
        a, e = info.start, info.end
        return chunk_aware_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], layer="l", **kw)

    outs = []
    for info in infos:
        state.begin_forward(0, info.segment)
        with activate(UnitContext(state, info, "forward", True)):
            outs.append(attend(info))
        state.end_forward(0, info.segment, keep=True)
    return torch.cat(outs, dim=2), outs, infos, state, attend


BIGBIRD = CausalBigBird(global_tokens=2, window=5, density=0.3, seed=1, block=4)
SPECS = [
    MaskSpec(),
    MaskSpec(window=3),  # smaller than a segment of 8
    MaskSpec(window=8),  # equal to it
    MaskSpec(window=13),  # larger
    MaskSpec(window=5, sinks=2),
    MaskSpec(window=9, sinks=4),
    # FlexAttention-style mask_mods, planned in blocks of 4: BigBird made causal (2 global
    # tokens, a window of 5, random earlier blocks), a shared prefix, and one beside a window
    MaskSpec(mask_mod=BIGBIRD),
    MaskSpec(mask_mod=VisiblePrefix(prefix=3, window=4, block=4)),
    MaskSpec(window=9, sinks=2, mask_mod=BIGBIRD),
]


def _id(spec: MaskSpec) -> str:
    mod = "" if spec.mask_mod is None else type(spec.mask_mod).__name__
    return f"w{spec.window}s{spec.sinks}{mod}"


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("docs", [None, DOCS], ids=["nodocs", "docs"])
@pytest.mark.parametrize("lengths", [[24], [8, 8, 8], [11, 7, 6], [3, 5, 4, 12]])
@pytest.mark.parametrize(
    ("dtype", "tol", "skip"),
    [(torch.float64, 1e-12, True), (torch.float32, 1e-5, True), (torch.float64, 1e-12, False)],
    ids=["f64", "f32", "f64-noskip"],
)
def test_segments_equal_dense_mask_reference(spec, docs, lengths, dtype, tol, skip) -> None:
    if docs is None and spec.plain:
        pytest.skip("plain causal: tests/test_attention.py")
    q, k, v = _qkv(dtype)
    vis = visible(docs, spec)
    ref = reference(q, k, v, vis)
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    out, outs, infos, state, _ = segmented(q, k, v, lengths, docs, spec, skip)
    assert ((out - ref).norm() / ref.norm()).item() <= tol
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            a, e = info.start, info.end
            torch.autograd.backward(outs[info.segment], go[:, :, a:e])
        state.end_backward(0, info.segment)
    assert state.is_empty()
    for t, r in zip((q, k, v), ref_grads, strict=True):
        assert ((t.grad - r).norm() / r.norm()).item() <= tol


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("lengths", [[24], [11, 7, 6]])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_flex_forward_backend_equals_reference(spec, lengths, dtype, tol) -> None:
    """FlexAttention per visible block (the GPU forward; eager and unfused on CPU) merged by
    LSE, backward through the tiles: the same outputs and gradients."""
    q, k, v = _qkv(dtype)
    ref = reference(q, k, v, visible(DOCS, spec))
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    out, outs, infos, state, _ = segmented(q, k, v, lengths, DOCS, spec, backend="flex")
    assert ((out - ref).norm() / ref.norm()).item() <= tol
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(outs[info.segment], go[:, :, info.start : info.end])
        state.end_backward(0, info.segment)
    for t, r in zip((q, k, v), ref_grads, strict=True):
        assert ((t.grad - r).norm() / r.norm()).item() <= tol


@pytest.mark.parametrize("spec", [MaskSpec(window=5, sinks=2), MaskSpec()], ids=str)
def test_checkpoint_recomputation_reads_the_same_cache(spec) -> None:
    """Backward recomputes each segment (as activation checkpointing does) from the cache."""
    q, k, v = _qkv(torch.float64)
    ref = reference(q, k, v, visible(DOCS, spec))
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    lengths = [8, 8, 8]
    with torch.no_grad():  # forward without a graph, as checkpointing does
        _, _, infos, state, attend = segmented(q, k, v, lengths, DOCS, spec)
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            out = attend(info)
            torch.autograd.backward(out, go[:, :, info.start : info.end])
        state.end_backward(0, info.segment)
    for t, r in zip((q, k, v), ref_grads, strict=True):
        assert ((t.grad - r).norm() / r.norm()).item() <= 1e-12


def test_tiles_cover_exactly_the_visible_pairs() -> None:
    """Every visible (query, key) pair in exactly one tile, no invisible pair in a whole tile."""
    groups = document_runs(DOCS)
    bounds = [0, 5, 13, 17, 24]
    for spec in SPECS:
        vis = visible(DOCS, spec)
        cover = torch.zeros(4, S, S, dtype=torch.int64)
        for qi in range(4):
            for kj in range(qi + 1):
                q0, q1, k0, k1 = bounds[qi], bounds[qi + 1], bounds[kj], bounds[kj + 1]
                for t in plan_tiles(q0, q1, k0, k1, groups, spec):
                    assert q0 <= t.q0 < t.q1 <= q1 and k0 <= t.k0 < t.k1 <= k1
                    tile = torch.ones(t.q1 - t.q0, t.k1 - t.k0, dtype=torch.bool)
                    if t.kind == "causal":
                        tile = tile.tril()
                    elif t.kind == "masked":
                        tile = tile_mask(t, spec)
                    cover[t.r0 : t.r1, t.q0 : t.q1, t.k0 : t.k1] += tile.long()
                    whole = vis[t.r0 : t.r1, t.q0 : t.q1, t.k0 : t.k1]
                    assert bool((whole | ~tile).all()), (spec, t)  # nothing invisible computed
        assert torch.equal(cover, vis.long()), spec


def test_visible_blocks_and_first_seen_key_match_the_dense_mask() -> None:
    """The blocks a segment reads are those with a visible pair, and what a segment keeps for
    the later ones starts at the first key any of their queries sees."""
    groups = document_runs(DOCS)
    bounds = [0, 5, 13, 17, 24]
    blocks = list(pairwise(bounds))
    for spec in SPECS:
        vis = visible(DOCS, spec)
        for i, (q0, q1) in enumerate(blocks):
            seen = [j for j, (k0, k1) in enumerate(blocks[:i]) if vis[:, q0:q1, k0:k1].any()]
            assert visible_blocks(q0, q1, blocks[:i], groups, spec) == tuple(seen), (spec, i)
            later = blocks[i + 1 :]
            cols = [vis[:, a:b, q0:q1].any(0).any(0) for a, b in later]
            hits = torch.stack(cols).any(0).nonzero() if cols else torch.zeros(0, 1)
            first = q0 + int(hits[0, 0]) if hits.numel() else None
            assert first_seen(q0, q1, later, groups, spec) == first, (spec, i)
            assert first_seen(q0, q1, later, groups, spec, skip=False) == (q0 if later else None)


def test_backward_and_recomputation_reuse_the_segment_plans(monkeypatch) -> None:
    """A segment's tile plan is built in its forward; the backward and a checkpoint
    recomputation of the segment run the same plan instead of placing the tiles again."""
    calls = [0]
    real = masks.place_tiles

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(masks, "place_tiles", counting)
    masks.plan_segment.cache_clear()
    spec = MaskSpec(window=5, sinks=2)
    q, k, v = _qkv(torch.float64)
    go = torch.randn_like(q)
    with torch.no_grad():  # forward without a graph, as checkpointing does
        _, _, infos, state, attend = segmented(q, k, v, [8, 8, 8], DOCS, spec)
    built = calls[0]
    assert built > 0
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(attend(info), go[:, :, info.start : info.end])
        state.end_backward(0, info.segment)
    assert calls[0] == built
    assert q.grad is not None


def test_invisible_blocks_are_skipped_and_not_cached() -> None:
    """Documents that end at a segment boundary: the later segment neither computes against
    the earlier block nor keeps it; a window keeps only the tail later segments can see."""
    q, k, v = _qkv(torch.float32)
    docs = torch.tensor([[0] * 8 + [1] * 16] * 4)
    *_, state, _ = segmented(q, k, v, [8, 8, 8], docs, MaskSpec())
    entries = state.layer_entries(0, "l")
    assert entries[0] is None  # nothing after position 8 shares document 0
    assert entries[1] is not None and entries[1].start == 8 and entries[1].k.shape[-2] == 8
    *_, state, _ = segmented(q, k, v, [8, 8, 8], None, MaskSpec(window=3))
    entries = state.layer_entries(0, "l")
    # the next segment's first query (position 8) sees back to 6: two cached positions
    assert [e.start for e in entries[:2]] == [6, 14]
    assert [e.k.shape[-2] for e in entries[:2]] == [2, 2]
    full = segmented(q, k, v, [8, 8, 8], None, MaskSpec(window=3), skip=False)[3]
    assert state.peak_bytes * 4 == full.peak_bytes  # 2 of 8 positions per block


def test_packed_documents_outside_a_step() -> None:
    q, k, v = _qkv(torch.float64)
    ref = reference(q, k, v, visible(DOCS, MaskSpec()))
    with packed_documents(DOCS):
        out = chunk_aware_attention(q, k, v, layer="x")
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-12


def test_bad_masks_fail_with_the_fix() -> None:
    with pytest.raises(ValueError, match="one contiguous run"):
        document_runs(torch.tensor([[0, 0, 1, 1, 0]]))
    with pytest.raises(ValueError, match="integer tensor of shape"):
        document_runs(torch.zeros(5))
    with pytest.raises(ValueError, match="positive number of keys"):
        MaskSpec(window=0)
    with pytest.raises(ValueError, match="needs a window"):
        MaskSpec(sinks=2)
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match="needs packed-document ids"):
        chunk_aware_attention(q, k, v, layer="x", documents=True)
    with pytest.raises(ValueError, match="give a function mask_mod"):
        MaskSpec(mask_mod=3)


@dataclass(frozen=True)
class _Bidirectional:
    """A prefix LM's mask: the first ``prefix`` positions see each other both ways."""

    prefix: int

    def __call__(self, b, h, q, k):
        return (k <= q) | ((q < self.prefix) & (k < self.prefix))


@dataclass(frozen=True)
class _Linformer:
    """Linformer's keys are projections over the whole sequence: every query reads every
    position, so as a mask it is all-visible."""

    def __call__(self, b, h, q, k):
        return torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool)


@pytest.mark.parametrize(
    ("mod", "pair"), [(_Bidirectional(prefix=6), "query 0 see key 1"),
                      (_Linformer(), "query 0 see key 1")], ids=["prefix-lm", "linformer"]
)  # fmt: skip
def test_a_mask_that_looks_forward_is_refused_naming_the_positions(mod, pair) -> None:
    """A mask under which a query sees a later key cannot be cut into segments (the key is
    computed by a later segment): refused at the first attention call, whole sequence or
    segment, naming the first such pair; the causal form of the same mask runs."""
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match=pair):
        chunk_aware_attention(q, k, v, layer="x", mask_mod=mod)
    state = StageKVState(0, 3)  # a unit's first segment of three: checked for the sample
    info = SegmentInfo(0, 0, 3, 0, 8, S, (0, 8, 16, 24), None)
    state.begin_forward(0, 0)
    with activate(UnitContext(state, info, "forward", True)), pytest.raises(ValueError, match=pair):
        chunk_aware_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], layer="y", mask_mod=mod)


def test_blocks_a_mask_mod_hides_get_no_tile() -> None:
    """A mask_mod's hidden blocks are never computed: BigBird at 512 positions in blocks of 32
    (window 32, 2 global tokens, 10% random blocks) plans tiles over a fraction of the causal
    triangle's pairs, and each tile holds a visible pair."""
    mod = CausalBigBird(global_tokens=2, window=32, density=0.1, seed=3, block=32)
    spec, n = MaskSpec(mask_mod=mod), 512
    tiles = plan_tiles(0, n, 0, n, ((0, 1, ((0, n),)),), spec)
    area = sum((t.q1 - t.q0) * (t.k1 - t.k0) for t in tiles)
    assert area < 0.35 * n * (n + 1) / 2, area
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    vis = mod(0, 0, i, j)
    for t in tiles:
        assert vis[t.q0 : t.q1, t.k0 : t.k1].any(), t


# ---------------------------------------------------------- CP shards balanced for documents
def _loads(layout, groups, start, end) -> list[int]:
    work = attention_work(groups, start, end).tolist()
    return [sum(sum(work[a - start : b - start]) for a, b in runs) for runs in layout]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_document_cp_layout_is_a_partition_with_equal_tokens(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    for trial in range(20):
        length = 2 * size * 16
        start = 2 * size * int(torch.randint(0, 8, (1,), generator=g))
        cuts = torch.randint(0, 2, (2, start + length), generator=g).cumsum(-1)
        groups = document_runs(cuts)
        layout = document_cp_layout(start, start + length, size, groups)
        covered = sorted(p for runs in layout for a, b in runs for p in range(a, b))
        assert covered == list(range(start, start + length)), trial
        assert len({sum(b - a for a, b in runs) for runs in layout}) == 1  # one ring shape
        zigzag = [zigzag_runs(start, start + length, r, size) for r in range(size)]
        assert max(_loads(layout, groups, start, start + length)) <= max(
            _loads(zigzag, groups, start, start + length)
        )


def test_document_cp_layout_balances_packed_documents() -> None:
    """Documents of 64..320 tokens in a 4096-token segment: the head-tail layout's work is
    uneven over 2 CP ranks, the document layout's within 5% of the mean; one document (a
    causal row) keeps the head-tail layout itself."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 320, (64,), generator=g)
    ids = torch.repeat_interleave(torch.arange(64), lengths)[:4096].reshape(1, -1)
    groups = document_runs(ids)
    layout = document_cp_layout(0, 4096, 2, groups)
    loads = _loads(layout, groups, 0, 4096)
    assert max(loads) / (sum(loads) / 2) <= 1.05
    head_tail = _loads([zigzag_runs(0, 4096, r, 2) for r in range(2)], groups, 0, 4096)
    assert max(loads) < max(head_tail)
    one = document_runs(torch.zeros(1, 4096, dtype=torch.int64))
    assert document_cp_layout(0, 4096, 2, one) == tuple(zigzag_runs(0, 4096, r, 2) for r in (0, 1))
