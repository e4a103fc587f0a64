"""Tile plans: which (query, key) rectangles of a segment's attention run, and with which kernel.

Why: packed documents, sliding windows and sink tokens make most of a long sequence's
(query, key) pairs invisible. Instead of one kernel call with a dense mask over every cached
block, a segment's attention is cut into rectangles that are each *fully visible*, *causal*
(bottom-right aligned square) or, for the few thin strips a window boundary crosses, *masked*.
Invisible rectangles produce no tile at all: no kernel call, no FLOPs, and a cached block that
no later segment has a tile on is never kept.

Visibility of key position ``l`` from query position ``i`` (absolute positions in the sample):
``l <= i``, same document, and ``i - l < window`` or ``l < sinks`` (when a window is set).
Documents are contiguous runs of equal ids (``document_runs``); packing produces exactly that.

This module is the bottom of the attention path: pure planning at absolute positions, no
tensors of the model. :func:`plan_tiles` cuts one (query block, key block) rectangle;
:func:`place_tiles` places those tiles in local tensors that hold runs of positions; a
segment's whole plan is :func:`plan_segment` (one device) or :func:`plan_ring` (every hop of
the context-parallel ring), each built once and reused by forward, backward and checkpoint
recomputation. :func:`visible_blocks` / :func:`first_seen` say which cached blocks a segment
reads and what of its own K/V later segments read (the K/V cache, :mod:`seq1f1b.attention.kv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from .._runtime import outside_fake_mode

__all__ = [
    "CHECKED_POSITIONS",
    "MASK_BLOCK",
    "MaskMod",
    "MaskSpec",
    "PlanEntry",
    "RingPlan",
    "Runs",
    "Tile",
    "check_causal",
    "document_runs",
    "first_seen",
    "place_tiles",
    "plan_ring",
    "plan_segment",
    "plan_tiles",
    "tile_mask",
    "visible_blocks",
]

Runs = tuple[tuple[int, int], ...]  # absolute (start, end) runs: a row's documents, a CP shard
RowGroups = tuple[tuple[int, int, Runs], ...]  # (first row, end row, runs) of equal rows


#: a ``mask_mod``'s planning granularity: blocks of this many queries x keys are classified
#: as hidden (no tile), fully visible or partly visible (a masked tile), as FlexAttention's
#: block masks are
MASK_BLOCK = 64

#: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, on absolute positions
MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MaskSpec:
    """A layer's mask beyond causal: sliding ``window`` (keys per query, itself included),
    ``sinks`` (the first positions, visible to every later query of their document) and a
    FlexAttention-style ``mask_mod`` (any causal pattern: BigBird's global, window and random
    blocks, a visible prefix), all ANDed with causal masking and the packed documents.

    A ``mask_mod`` is called with tensors of absolute query and key positions (batch and head
    arguments 0: it must not depend on them) and must never look forward: a key after its
    query is refused, naming the positions: over the first :data:`CHECKED_POSITIONS` of the
    first step's sequence (:func:`check_causal`), and within every segment as it is planned.
    It is planned in blocks of its ``block`` attribute's positions (default
    :data:`MASK_BLOCK`). It must be hashable and, for multi-process runs, picklable (a frozen
    dataclass, :mod:`seq1f1b.attention.mask_mods`)."""

    window: int | None = None
    sinks: int = 0
    mask_mod: MaskMod | None = None

    @property
    def plain(self) -> bool:
        """No mask beyond causal (and the documents)."""
        return self.window is None and self.mask_mod is None

    def __post_init__(self) -> None:
        if self.mask_mod is not None and not callable(self.mask_mod):
            raise ValueError(
                f"mask_mod={self.mask_mod!r}: give a function mask_mod(b, h, q_idx, kv_idx) "
                "returning a bool tensor (FlexAttention's convention), or None"
            )
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(
                f"window={self.window!r}: a sliding window must be a positive number of keys per "
                "query (the query itself included), or None for full causal attention"
            )
        if self.sinks < 0 or (self.sinks and self.window is None):
            raise ValueError(
                f"sinks={self.sinks!r} needs a window and must be >= 0: sink tokens are the "
                "positions a sliding window keeps visible; pass window= as well"
            )


@dataclass(frozen=True)
class Tile:
    """Queries ``[q0, q1)`` x keys ``[k0, k1)`` (absolute positions) of batch rows
    ``[r0, r1)``; ``kind`` is "full", "causal" (square, ``l <= i``) or "masked"."""

    r0: int
    r1: int
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str
    runs: Runs = ()  # documents to mask by (dense tiles only; empty: one document)


PlanEntry = tuple[int, Tile, int, int]  # (block, tile, q_shift, k_shift), see place_tiles


def document_runs(ids: torch.Tensor) -> RowGroups:
    """Group batch rows of ``ids`` (batch, seq) into runs of equal document ids.

    Raises ValueError if a row's ids are not contiguous runs (an id that reappears after
    another one): packing with EOS-delimited documents never produces that.
    """
    if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(
            f"document_ids must be an integer tensor of shape (batch, seq_len), got dtype "
            f"{ids.dtype} and shape {tuple(ids.shape)}"
        )
    groups: list[tuple[int, int, Runs]] = []
    for row in range(ids.shape[0]):
        values, counts = torch.unique_consecutive(ids[row].cpu(), return_counts=True)
        if values.numel() != torch.unique(values).numel():
            raise ValueError(
                f"document_ids row {row}: a document id reappears after another document; "
                "each document must be one contiguous run (number documents in order, e.g. "
                "the cumulative count of EOS tokens)"
            )
        ends = counts.cumsum(0).tolist()
        runs = tuple(zip([0, *ends[:-1]], ends, strict=True))
        if groups and groups[-1][2] == runs:
            groups[-1] = (groups[-1][0], row + 1, runs)
        else:
            groups.append((row, row + 1, runs))
    return tuple(groups)


def tile_mask(t: Tile, spec: MaskSpec, device: torch.device | None = None) -> torch.Tensor:
    """Boolean visibility of a "masked" tile, (q1-q0, k1-k0): causal, window / sinks, and the
    documents of ``t.runs`` (planned tiles lie in one document and carry none)."""
    i = torch.arange(t.q0, t.q1, device=device).unsqueeze(1)
    j = torch.arange(t.k0, t.k1, device=device).unsqueeze(0)
    visible = j <= i
    if t.runs:
        ends = torch.tensor([e for _, e in t.runs], device=device)
        doc_i = torch.bucketize(i, ends, right=True)
        doc_j = torch.bucketize(j, ends, right=True)
        visible &= doc_i == doc_j
    if spec.window is not None:
        visible &= (i - j < spec.window) | (j < spec.sinks)
    if spec.mask_mod is not None:
        visible &= _mask_mod(spec.mask_mod, i, j)
    return visible


def _mask_mod(mask_mod: MaskMod, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``mask_mod`` at query positions ``i`` x key positions ``j``, as a bool tensor of their
    broadcast shape (batch and head 0)."""
    out = torch.as_tensor(mask_mod(0, 0, i, j), device=i.device)
    return out.to(torch.bool).expand(torch.broadcast_shapes(i.shape, j.shape))


#: the first step checks a ``mask_mod`` over this many positions of the sequence (every
#: segment is also checked within itself as it is planned): the check evaluates every pair
CHECKED_POSITIONS = 8192


@lru_cache(maxsize=64)
def check_causal(mask_mod: MaskMod, seq_len: int) -> None:
    """Raise ValueError, naming the first pair, if ``mask_mod`` lets a query see a later key
    within the first ``seq_len`` positions: a segment cannot attend to keys not computed yet,
    so such a mask (a bidirectional prefix, Linformer's projection over the whole sequence)
    cannot be chunked. Evaluated once per mask and length."""
    _refuse_ahead(mask_mod, 0, seq_len, seq_len)


def _refuse_ahead(mask_mod: MaskMod, q0: int, q1: int, k_end: int) -> None:
    """The check of :func:`check_causal` for queries ``[q0, q1)`` against the later keys
    before ``k_end``, in bands of 1024 queries (real tensors: a dry run reads them too)."""
    with outside_fake_mode():
        for r0 in range(q0, q1, 1024):
            r1 = min(q1, r0 + 1024)
            i = torch.arange(r0, r1).unsqueeze(1)
            j = torch.arange(r0 + 1, k_end).unsqueeze(0)
            if j.numel() == 0:
                continue
            ahead = _mask_mod(mask_mod, i, j) & (j > i)
            if ahead.any():
                q, k = (int(x) for x in ahead.nonzero()[0])
                raise ValueError(
                    f"mask_mod lets query {r0 + q} see key {r0 + 1 + k}, a later position: a "
                    "Seq1F1B segment cannot attend to keys that later segments compute. Use a "
                    "mask that never looks forward (key <= query); a bidirectional prefix or a "
                    "projection over the whole sequence (Linformer) cannot be cut into segments"
                )


def plan_tiles(
    q0: int, q1: int, k0: int, k1: int, groups: RowGroups, spec: MaskSpec, skip: bool = True
) -> list[Tile]:
    """Tiles of queries ``[q0, q1)`` against keys ``[k0, k1)`` (the own block when equal).

    ``skip=False`` is the mask-alone baseline: one masked tile per group of rows over the
    whole rectangle, whatever it contains."""
    if not skip:
        return [Tile(r0, r1, q0, q1, k0, k1, "masked", runs) for r0, r1, runs in groups]
    return list(_plan(q0, q1, k0, k1, groups, spec.window, spec.sinks, spec.mask_mod))


@lru_cache(maxsize=4096)
def _plan(
    q0: int, q1: int, k0: int, k1: int, groups: RowGroups, window: int | None, sinks: int,
    mask_mod: MaskMod | None = None,
) -> tuple[Tile, ...]:  # fmt: skip
    own = (q0, q1) == (k0, k1)
    out: list[Tile] = []
    for r0, r1, runs in groups:
        for s, e in runs:
            qa, qb, ka, kb = max(s, q0), min(e, q1), max(s, k0), min(e, k1)
            if qa >= qb or ka >= kb:
                continue
            if own:
                ka, kb = qa, qb  # a document's keys in its own segment: a causal square
                if mask_mod is not None:  # a segment never sees its own later keys
                    _refuse_ahead(mask_mod, qa, qb, qb)
            for piece in _window_split(qa, qb, ka, kb, own, window, sinks):
                pieces = [piece] if mask_mod is None else _mask_split(
                    *piece, mask_mod, window, sinks)  # fmt: skip
                out += [Tile(r0, r1, a, b, c, d, kind) for a, b, c, d, kind in pieces]
    return tuple(out)


def _mask_split(
    qa: int, qb: int, ka: int, kb: int, kind: str, mask_mod: MaskMod, window: int | None,
    sinks: int,
) -> list[tuple[int, int, int, int, str]]:  # fmt: skip
    """One piece of a same-document rectangle cut by a ``mask_mod`` into blocks of its
    ``block`` (:data:`MASK_BLOCK`) queries x keys: a block it hides gets no tile, a fully
    visible one is "full" (or "causal" on the diagonal), the rest "masked"; neighbouring
    blocks of a row band with the same kind are one tile, a masked one trimmed to its visible
    rows and keys (what the K/V cache keeps then starts at a key some query sees). Each row
    band is classified in a few tensor reductions, not one per block; on real tensors (a dry
    run plans from values too)."""
    with outside_fake_mode():
        out: list[tuple[int, int, int, int, str]] = []
        step = getattr(mask_mod, "block", MASK_BLOCK)
        width = kb - ka
        nb = -(-width // step)
        j = torch.arange(ka, ka + nb * step).unsqueeze(0)
        valid = (j < kb).view(1, nb, step)
        for r0 in range(qa, qb, step):
            r1 = min(qb, r0 + step)
            i = torch.arange(r0, r1).unsqueeze(1)
            base = (j <= i) & (j < kb)
            if window is not None:
                base &= (i - j < window) | (j < sinks)
            visible = _mask_mod(mask_mod, i, j) & base
            vis3, base3 = visible.view(-1, nb, step), base.view(-1, nb, step)
            seen = vis3.any(2).any(0).tolist()
            same = ((vis3 == base3) | ~valid).all(2).all(0).tolist()
            whole = (base3 | ~valid).all(2).all(0).tolist()
            band: list[tuple[int, int, str]] = []
            for b in range(nb):
                if not seen[b]:
                    continue
                c0, c1 = ka + b * step, min(kb, ka + (b + 1) * step)
                if same[b] and whole[b]:
                    piece = "full"
                elif kind == "causal" and (r0, r1) == (c0, c1) and same[b]:
                    piece = "causal" if window is None or r1 - 1 - c0 < window else "masked"
                else:
                    piece = "masked"
                if band and band[-1][2] == piece != "causal" and band[-1][1] == c0:
                    band[-1] = (band[-1][0], c1, piece)
                else:
                    band.append((c0, c1, piece))
            for c0, c1, piece in band:
                if piece == "masked":
                    block = visible[:, c0 - ka : c1 - ka]
                    cols, rows = block.any(0).nonzero(), block.any(1).nonzero()
                    out.append((r0 + int(rows[0]), r0 + int(rows[-1]) + 1,
                                c0 + int(cols[0]), c0 + int(cols[-1]) + 1, piece))  # fmt: skip
                else:
                    out.append((r0, r1, c0, c1, piece))
        return out


def _window_split(
    qa: int, qb: int, ka: int, kb: int, causal: bool, window: int | None, sinks: int
) -> Sequence[tuple[int, int, int, int, str]]:
    """One same-document rectangle cut along the window: full / causal / masked pieces."""
    base = "causal" if causal else "full"
    if window is None or (qb - 1) - ka < window:
        return [(qa, qb, ka, kb, base)]
    pieces: list[tuple[int, int, int, int, str]] = []
    if ka < sinks:  # sink columns: visible to every later query, window or not
        sink_end = min(kb, sinks)
        kind = "full" if sink_end - 1 <= qa else "masked"
        pieces.append((qa, qb, ka, sink_end, kind))
        ka = sink_end
    step = max(1, window // 2)
    for r0 in range(qa, qb, step):
        r1 = min(qb, r0 + step)
        lo, hi = max(ka, r0 - window + 1), min(kb, r1)
        if lo >= hi:
            continue
        # columns [lo, r1 - window] fail the window for some rows: a thin masked strip
        full_from = max(lo, r1 - window)
        if full_from > lo:
            pieces.append((r0, r1, lo, min(full_from, hi), "masked"))
        full_to = min(hi, r0) if causal else hi
        if full_to > full_from:
            pieces.append((r0, r1, full_from, full_to, "full"))
        if causal and hi > r0:  # the diagonal square of these rows
            pieces.append(
                (r0, r1, max(r0, full_from), hi, "causal" if full_from <= r0 else "masked")
            )
    return pieces


# ------------------------------------------------------------------- plans of whole segments
def place_tiles(
    q_runs: Runs,
    k_runs: Runs,
    groups: RowGroups,
    spec: MaskSpec,
    block: int,
    skip: bool = True,
) -> list[PlanEntry]:
    """Tiles of the queries held as ``q_runs`` against the keys held as ``k_runs`` (key/value
    block ``block``), placed in local tensors that hold those runs back to back: the tile's
    queries ``[q0, q1)`` sit at local indices ``[q0 + q_shift, q1 + q_shift)``, its keys
    likewise.

    Runs are whole chunks of the sequence: a key run is the query run itself (a causal
    square), lies wholly before it, or wholly after it (invisible under causal masking)."""
    out: list[PlanEntry] = []
    q_off = 0
    for qa, qb in q_runs:
        k_off = 0
        for ka, kb in k_runs:
            if ka < qb and (kb <= qa or (ka, kb) == (qa, qb)):
                for t in plan_tiles(qa, qb, ka, kb, groups, spec, skip):
                    out.append((block, t, q_off - qa, k_off - ka))
            elif ka < qb:
                raise ValueError(f"key run {(ka, kb)} straddles query run {(qa, qb)}")
            k_off += kb - ka
        q_off += qb - qa
    return out


def visible_blocks(
    q0: int,
    q1: int,
    key_blocks: Sequence[tuple[int, int]],
    groups: RowGroups,
    spec: MaskSpec,
    skip: bool = True,
) -> tuple[int, ...]:
    """Indices of the key blocks ``(start, end)`` that queries ``[q0, q1)`` have a tile on:
    the earlier segments a segment reads (the others need no kernel call and no K/V)."""
    return tuple(
        j for j, (k0, k1) in enumerate(key_blocks) if plan_tiles(q0, q1, k0, k1, groups, spec, skip)
    )


def first_seen(
    k0: int,
    k1: int,
    query_blocks: Sequence[tuple[int, int]],
    groups: RowGroups,
    spec: MaskSpec,
    skip: bool = True,
) -> int | None:
    """The first key of ``[k0, k1)`` that any of the query blocks ``(start, end)`` has a tile
    on (``k0`` itself without ``skip``: its tiles are whole rectangles); None when none has:
    what a segment's cache must keep for the later segments."""
    first = None
    for q0, q1 in query_blocks:
        for t in plan_tiles(q0, q1, k0, k1, groups, spec, skip):
            first = t.k0 if first is None else min(first, t.k0)
    return first


@lru_cache(maxsize=1024)
def plan_segment(
    q0: int,
    q1: int,
    cached: tuple[tuple[int, int], ...],
    groups: RowGroups,
    spec: MaskSpec,
    skip: bool = True,
) -> tuple[PlanEntry, ...]:
    """A segment's plan on one device: queries ``[q0, q1)`` against the cached key blocks
    ``cached[j] = (start, end)`` (plan block ``j``), then against its own keys (block -1)."""
    own = ((q0, q1),)
    plan: list[PlanEntry] = []
    for j, run in enumerate(cached):
        plan += place_tiles(own, (run,), groups, spec, j, skip)
    plan += place_tiles(own, own, groups, spec, -1, skip)
    return tuple(plan)


@dataclass(frozen=True)
class RingPlan:
    """One context-parallel rank's tiles of a segment, for every hop of the ring. Blocks: -1 a
    rank's shard of the segment's own K/V, ``j`` its shard of the ``j``-th prefix block read."""

    local: tuple[PlanEntry, ...]  # local queries on the local blocks (before any hop)
    kv: tuple[tuple[PlanEntry, ...], ...]  # by source rank: local queries on its visiting blocks
    q: tuple[tuple[PlanEntry, ...], ...]  # by source rank: its visiting queries (pass-Q) on the
    # local prefix blocks (empty without pass-Q)


@lru_cache(maxsize=256)
def plan_ring(
    q_runs: tuple[Runs, ...],
    prefix_runs: tuple[tuple[Runs, ...], ...],
    rank: int,
    groups: RowGroups,
    spec: MaskSpec,
    skip: bool,
    pass_q: bool,
) -> RingPlan:
    """The plan of :class:`RingPlan` for CP rank ``rank``: ``q_runs[r]`` is rank ``r``'s shard
    of the segment (its queries and own keys), ``prefix_runs[r][j]`` its shard of prefix block
    ``j``. With ``pass_q`` the queries visit the prefix blocks, else the prefix blocks travel
    with the segment's own K/V."""
    q = q_runs[rank]
    kv: list[tuple[PlanEntry, ...]] = []
    q_side: list[tuple[PlanEntry, ...]] = []
    for src in range(len(q_runs)):
        plan = place_tiles(q, q_runs[src], groups, spec, -1, skip)
        if not pass_q:
            for j, runs in enumerate(prefix_runs[src]):
                plan += place_tiles(q, runs, groups, spec, j, skip)
        kv.append(tuple(plan))
        visiting: list[PlanEntry] = []
        if pass_q:
            for j, runs in enumerate(prefix_runs[rank]):
                visiting += place_tiles(q_runs[src], runs, groups, spec, j, skip)
        q_side.append(tuple(visiting))
    return RingPlan(local=kv[rank] + q_side[rank], kv=tuple(kv), q=tuple(q_side))
