"""Carried state: tensors a layer hands from segment k to segment k+1 of the same sample.

A recurrent layer (Gated DeltaNet's delta-rule state and the last inputs of its causal
convolution, a Mamba scan, an RNN) depends on earlier positions through a state, not through
keys and values. Under a Seq1F1B schedule segment k of a sample must start from the state
segment k-1 ended with, and in the backward (segments K-1..0) the state's gradient must go
from segment k back into segment k-1: the ordering of the K/V cache, with a state instead of a
prefix. A layer declares it in two calls inside its forward::

    carry = carried_state(layer)          # where the running unit stands, for this layer
    init = carry.initial(anchor)          # segment k-1's final state (None: the sample's start)
    out, final = my_scan(x, init)
    out = carry.keep(out, *final)         # what segment k+1 starts from

The kept tensors are detached leaves in the stage's per-sample cache (beside the K/V entries,
freed with them); the next segment's backward accumulates the state's gradient into their
``.grad`` (in the input half of a split backward: ``anchor``, a tensor of the layer that leads
to the stage inputs, puts the read on that path) and the owning segment's backward adds it to
its final state's gradient. Checkpoint recomputation reads the same entry and keeps nothing.
Outside a unit (an unpipelined run, a whole-sequence check) ``initial`` is None and ``keep``
returns ``out``. Documents: the layer resets its state where a document starts
(:meth:`CarriedState.pieces`); a segment whose first position opens a document does not read
the carried state of that row. Under context parallelism the segment's positions are spread
over the CP ranks: the state passes from rank to rank within the segment by a scan
(:mod:`seq1f1b.attention.carried_cp`, :meth:`CarriedState.context_parallel`), and every CP
rank keeps its own copy of the segment's final state here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .kv import ContextParallel, UnitContext, current_documents, current_unit
from .masks import RowGroups

__all__ = ["CarriedEntry", "CarriedState", "Piece", "carried_state"]


@dataclass
class CarriedEntry:
    """One segment's final state for one layer, as grad-accumulating leaves."""

    tensors: tuple[torch.Tensor, ...]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True)
class Piece:
    """Rows ``[r0, r1)`` and positions ``[a, b)`` of the running segment (relative to its first
    position) that belong to one document; ``continues``: the document began in an earlier
    segment, so the piece starts from the carried state (else from zeros)."""

    r0: int
    r1: int
    a: int
    b: int
    continues: bool


class _ReadCarried(torch.autograd.Function):
    """The carried leaves as the running segment's initial state; the backward accumulates
    their gradient into the leaves' ``.grad`` (it does not return it: a split backward asks
    autograd for the stage inputs' gradients only, and would skip a leaf)."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *leaves: torch.Tensor):  # type: ignore[override]
        ctx.leaves = leaves
        return tuple(t.detach().clone() for t in leaves)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        unit = current_unit()
        if unit is not None and unit.phase == "backward_weight":
            # a compiled block's backward runs in both halves of a split backward (its op
            # recomputes and differentiates the layer each time): the input half left it
            return (None, *(None for _ in grads))
        for leaf, grad in zip(ctx.leaves, grads, strict=True):
            if grad is not None and leaf.requires_grad:
                grad = grad.to(leaf.dtype)
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        return (None, *(None for _ in grads))


class _KeepCarried(torch.autograd.Function):
    """Identity on the layer's output whose backward gives the final state the gradient the
    next segment left on its cache entry."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, entry: CarriedEntry, *final: torch.Tensor):  # type: ignore[override]
        ctx.entry = entry
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        return (grad_out, None, *(leaf.grad for leaf in ctx.entry.tensors))


@dataclass(frozen=True)
class CarriedState:
    """Where the running unit stands for one layer's carried state (see the module)."""

    layer: Hashable
    unit: UnitContext | None

    def _entries(self) -> list[CarriedEntry | None]:
        assert self.unit is not None
        info = self.unit.info
        return self.unit.state.layer_entries(info.microbatch, ("carried", self.layer))

    def initial(self, anchor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The state the previous segment of the running sample ended with (None: there is
        none, the layer starts from zeros). ``anchor``: a tensor of this layer's forward that
        depends on the stage inputs (its input), so that a split backward's input half
        carries the state's gradient."""
        ctx = self.unit
        if ctx is None or ctx.info.segment == 0:
            return None
        ctx.state.attention_calls += 1  # a declared sequence dependency (the mixing probe)
        entries, seg = self._entries(), ctx.info.segment
        entry = entries[seg - 1] if len(entries) >= seg else None
        if entry is None:
            raise RuntimeError(
                f"Seq1F1B: layer {self.layer!r} of stage {ctx.state.stage_index} reads the "
                f"carried state of segment {seg - 1} (sample {ctx.info.microbatch}) but that "
                "segment kept none: call carry.keep(...) in every segment's forward"
            )
        if not any(t.requires_grad for t in entry.tensors) or not torch.is_grad_enabled():
            return entry.tensors
        return _ReadCarried.apply(anchor, *entry.tensors)

    def keep(self, out: torch.Tensor, *final: torch.Tensor) -> torch.Tensor:
        """Keep ``final`` (the state after the segment's last position) for the next segment;
        returns ``out`` wired so that the state's gradient reaches ``final`` in the backward."""
        ctx = self.unit
        if ctx is None:
            return out
        info = ctx.info
        entries, seg = self._entries(), info.segment
        last = seg == info.num_segments - 1
        if ctx.phase == "forward":
            if len(entries) != seg:
                raise RuntimeError(
                    f"Seq1F1B: layer {self.layer!r} of stage {ctx.state.stage_index} has kept "
                    f"the state of {len(entries)} segments of sample {info.microbatch} but "
                    f"runs segment {seg}: each layer keeps its state once per unit forward"
                )
            # copies: a compiled graph may reuse the buffer a view (a convolution tail) is of
            entries.append(
                None if last else CarriedEntry(
                    tuple(t.detach().clone().requires_grad_(ctx.keep_kv) for t in final)
                )
            )  # fmt: skip
        elif len(entries) <= seg:
            raise RuntimeError(
                f"Seq1F1B: recomputing segment {seg} of sample {info.microbatch} on stage "
                f"{ctx.state.stage_index} but its carried state is gone"
            )
        entry = entries[seg]
        if entry is None or not ctx.keep_kv or not torch.is_grad_enabled():
            return out
        return _KeepCarried.apply(out, entry, *final)

    def context_parallel(self) -> ContextParallel | None:
        """The CP group the running segment is sharded over (None: the segment is whole on
        this rank). A layer given one passes its state over the CP ranks by a scan
        (:mod:`seq1f1b.attention.carried_cp`): a declared sequence dependency, from the
        sample's first segment on."""
        ctx = self.unit
        if ctx is None or ctx.info.cp is None or ctx.info.cp.size == 1:
            return None
        ctx.state.attention_calls += 1
        return ctx.info.cp

    def pieces(self, batch: int, length: int) -> tuple[Piece, ...]:
        """The running segment cut where documents start (one piece per row group and
        document run; without documents one piece, which continues from segment 1 on)."""
        ctx = self.unit
        start = 0 if ctx is None else ctx.info.start
        continues = ctx is not None and ctx.info.segment > 0
        groups = current_documents()
        if groups is None:
            return (Piece(0, batch, 0, length, continues),)
        return document_pieces(groups, start, start + length)


def document_pieces(groups: RowGroups, start: int, end: int) -> tuple[Piece, ...]:
    """Each row group's document runs within ``[start, end)``, relative to ``start``; a run
    that began before ``start`` continues the carried state."""
    out = []
    for r0, r1, runs in groups:
        for a, b in runs:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append(Piece(r0, r1, lo - start, hi - start, a < start))
    return tuple(out)


def carried_state(layer: Hashable) -> CarriedState:
    """The carried state of ``layer`` (any hashable key unique on its stage, such as the
    module) in the running unit; outside a Seq1F1B unit a no-op (see the module)."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "Seq1F1B: carried_state() reads the running unit, which a traced graph must not "
            "see: under torch.compile call it inside a custom op, as "
            "seq1f1b.attention.gated_deltanet.gated_deltanet_core does (seq1f1b::gated_deltanet)"
        )
    return CarriedState(layer, current_unit())
