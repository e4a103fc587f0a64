"""Carried state under context parallelism: a recurrent layer's state passed over the CP ranks
that hold a segment's shards, by a parallel scan.

Under CP a segment's positions are cut into runs held by different ranks (the head-tail layout:
rank ``r`` of ``c`` holds chunks ``r`` and ``2c-1-r``, so in sequence order the chunks visit
ranks ``0, 1, .., c-1, c-1, .., 0``; packed documents may balance them otherwise,
:func:`seq1f1b.attention.kv.document_cp_layout`). A state that is affine in its start over a
run, ``S_end = P S_start + B``, is passed along them as a scan, not rank by rank:

1. each rank computes its runs from an unknown start: the part that does not depend on it
   (``B``, the outputs ``o0``) and the part that does (``P``, and ``Q'`` with
   ``o = o0 + Q' S_start``). For the delta rule ``P`` is its ``dk x dk`` transition, one call
   with ``dk`` extra value columns started from the identity
   (:func:`seq1f1b.attention.gated_delta.gated_delta_rule_affine`); for the convolution tail
   a selection (:func:`seq1f1b.attention.causal_conv.tail_transition`);
2. :func:`affine_scan`: one all-gather of every run's ``(P, B)``; every rank folds them in
   sequence order from the segment's initial state (the carried one), so it knows the state at
   the start of each of its runs and the segment's final state, which it keeps for the next
   segment (every CP rank holds its own copy; the copies' gradients are summed below);
3. the layer corrects its outputs by the start states.

The backward is the reverse scan: one all-reduce of the gradient of every run's start state and
of every rank's final-state copy, then each rank folds the adjoints from the segment's end (the
transitions transposed). No rank waits for another's compute: passing the state rank to rank
would serialise ``2c-1`` run computations per layer, forward and backward; the scan costs the
transition's extra columns instead (``benchmarks/cp/recurrent_state.py`` measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .carried import Piece, document_pieces
from .kv import ContextParallel, SegmentInfo
from .masks import RowGroups

__all__ = ["CPRun", "ScanLayout", "affine_scan", "scan_layout"]


@dataclass(frozen=True)
class CPRun:
    """Positions ``[a, b)`` of a segment, held by CP rank ``owner``; ``lo`` is where they
    start in the owner's local tensor (its runs concatenated in sequence order)."""

    a: int
    b: int
    owner: int
    lo: int

    @property
    def length(self) -> int:
        return self.b - self.a


@dataclass(frozen=True)
class ScanLayout:
    """A segment's runs over the CP group, in sequence order (adjacent runs of one rank
    merged), and where this rank stands."""

    runs: tuple[CPRun, ...]
    cp: ContextParallel

    @property
    def mine(self) -> tuple[int, ...]:
        """Indices (into :attr:`runs`) of this rank's runs, in sequence order."""
        return tuple(j for j, r in enumerate(self.runs) if r.owner == self.cp.rank)

    @property
    def slots(self) -> int:
        """The most runs any rank holds: the gather's slots per rank."""
        return max(sum(r.owner == o for r in self.runs) for o in range(self.cp.size))

    def slot(self, j: int) -> int:
        """Run ``j``'s index among its owner's runs."""
        owner = self.runs[j].owner
        return sum(r.owner == owner for r in self.runs[:j])

    def pieces(self, j: int, batch: int, documents: RowGroups | None) -> tuple[Piece, ...]:
        """Run ``j`` cut where documents start (relative to the run's first position); a
        piece continues when its document began before the run (an earlier run, or an
        earlier segment): it starts from the scanned state."""
        run = self.runs[j]
        if documents is None:
            return (Piece(0, batch, 0, run.length, run.a > 0),)
        return document_pieces(documents, run.a, run.b)


@lru_cache(maxsize=1024)
def _runs(
    start: int, end: int, size: int, rank_runs: tuple[tuple[tuple[int, int], ...], ...]
) -> tuple[CPRun, ...]:
    del start, end, size  # (part of the key only)
    owned = sorted((a, b, r) for r, runs in enumerate(rank_runs) for a, b in runs)
    merged: list[list[int]] = []
    for a, b, r in owned:
        if merged and merged[-1][2] == r and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b, r])
    offsets = [0] * len(rank_runs)
    out = []
    for a, b, r in merged:
        out.append(CPRun(a, b, r, offsets[r]))
        offsets[r] += b - a
    return tuple(out)


def scan_layout(info: SegmentInfo) -> ScanLayout:
    """The running segment's runs over its CP group (the same on every CP rank)."""
    cp = info.cp
    assert cp is not None
    rank_runs = tuple(cp.runs(info.start, info.end, r, info.documents) for r in range(cp.size))
    return ScanLayout(_runs(info.start, info.end, cp.size, rank_runs), cp)


def _gather(flat: torch.Tensor, cp: ContextParallel) -> list[torch.Tensor]:
    out = [torch.empty_like(flat) for _ in range(cp.size)]
    dist.all_gather(out, flat.contiguous(), group=cp.group)
    return out


class _AffineScan(torch.autograd.Function):
    """The scan of the module (step 2): identity on ``through`` (a tensor of the layer's
    forward that the output depends on: its backward, and so the collective in it, runs on
    every rank whenever the layer's does); returns the start state of each of this rank's
    runs and the segment's final state."""

    @staticmethod
    def forward(ctx, layout: ScanLayout, through, s_in, *pairs):  # type: ignore[override]
        cp, mine, slots = layout.cp, layout.mine, layout.slots
        p_shape, b_shape = pairs[0].shape, pairs[1].shape
        # fp32 at least: the sums of the backward, and gloo, want no bf16
        dtype = torch.promote_types(pairs[1].dtype, torch.float32)
        flat = [t.to(dtype).reshape(-1) for t in pairs]
        pad = (slots - len(mine)) * (pairs[0].numel() + pairs[1].numel())
        gathered = _gather(torch.cat([*flat, flat[0].new_zeros(pad)]), cp)
        n_p, n_b = pairs[0].numel(), pairs[1].numel()
        trans, adds = [], []
        for j in range(len(layout.runs)):
            base = layout.slot(j) * (n_p + n_b)
            row = gathered[layout.runs[j].owner]
            trans.append(row[base : base + n_p].view(p_shape))
            adds.append(row[base + n_p : base + n_p + n_b].view(b_shape))
        device = through.device
        state = torch.zeros(b_shape, dtype=dtype, device=device) if s_in is None else s_in.to(dtype)
        starts = []
        for p, b in zip(trans, adds, strict=True):
            starts.append(state)
            state = torch.matmul(p, state) + b
        ctx.layout, ctx.b_shape, ctx.has_init = layout, b_shape, s_in is not None
        ctx.dtypes = [t.dtype for t in pairs]
        ctx.init_dtype = None if s_in is None else s_in.dtype
        ctx.save_for_backward(*trans, *(starts[j] for j in mine))
        ctx.set_materialize_grads(False)
        return (through.view_as(through), *(starts[j].clone() for j in mine), state)

    @staticmethod
    def backward(ctx, grad_through, *grads):  # type: ignore[override]
        layout: ScanLayout = ctx.layout
        mine, n = layout.mine, len(layout.runs)
        saved = ctx.saved_tensors
        trans, starts = saved[:n], dict(zip(mine, saved[n:], strict=True))
        local, grad_out = grads[: len(mine)], grads[-1]
        dtype = trans[0].dtype
        device = trans[0].device
        # every run's start-state gradient (from its owner) and the final state's, summed
        # over the ranks' copies: the adjoints of the scan
        total = torch.zeros((n + 1, *ctx.b_shape), dtype=dtype, device=device)
        for j, g in zip(mine, local, strict=True):
            if g is not None:
                total[j] = g
        if grad_out is not None:
            total[n] = grad_out
        dist.all_reduce(total, group=layout.cp.group)
        pair_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        adj = total[n]
        for j in range(n - 1, -1, -1):  # adj: the gradient of the state after run j
            if j in starts:
                pair_grads[j] = (adj @ starts[j].transpose(-1, -2), adj)
            adj = total[j] + trans[j].transpose(-1, -2) @ adj
        grad_init = None
        if ctx.has_init and ctx.needs_input_grad[2]:
            # this rank's copy of the initial state feeds only its own scan: its gradient is
            # from this rank's outputs alone
            own = dict(zip(mine, local, strict=True))
            adj = grad_out if grad_out is not None else torch.zeros_like(total[n])
            for j in range(n - 1, -1, -1):
                adj = trans[j].transpose(-1, -2) @ adj
                if own.get(j) is not None:
                    adj = adj + own[j]
            grad_init = adj.to(ctx.init_dtype)
        flat: list[torch.Tensor | None] = []
        for i, j in enumerate(mine):
            dp, db = pair_grads[j]
            want_p, want_b = ctx.needs_input_grad[3 + 2 * i], ctx.needs_input_grad[4 + 2 * i]
            flat += [dp.to(ctx.dtypes[2 * i]) if want_p else None]
            flat += [db.to(ctx.dtypes[2 * i + 1]) if want_b else None]
        return (None, grad_through, grad_init, *flat)


def affine_scan(
    layout: ScanLayout,
    through: torch.Tensor,
    initial: torch.Tensor | None,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The scan of the module: ``pairs`` is ``(P, B)`` of each of this rank's runs in sequence
    order (``P`` (..., d, d), ``B`` (..., d, e); every rank's of one shape), ``initial`` the
    segment's start state (None: zeros). Returns ``through`` (wired so that the backward's
    collective runs on every rank), the start state of each of this rank's runs, and the
    segment's final state (this rank's copy)."""
    if len(pairs) != len(layout.mine):
        raise ValueError(f"affine_scan: {len(pairs)} pairs for {len(layout.mine)} runs")
    flat = [t for pair in pairs for t in pair]
    out = _AffineScan.apply(layout, through, initial, *flat)
    return out[0], list(out[1:-1]), out[-1]
