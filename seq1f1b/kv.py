"""Per-stage, per-sample K/V state for sequence segments, and the unit context.

While ``ScheduleSeq1F1B`` runs a unit (sample ``m``, segment ``k``) on a stage, it activates a
:class:`UnitContext`; chunk-aware attention layers read it to find the K/V of the earlier
segments of the same sample. The cached K/V are detached leaves that share storage with the
owning segment's K/V (no copy): the backward of later segments accumulates dL/dK, dL/dV into
their ``.grad`` and the owning segment's backward injects those grads into its own graph.

The active context is a module-level slot rather than a thread-local on purpose: autograd runs
backward (and checkpoint recomputation) on its own worker threads for CUDA tensors, and those
must see the unit that is being differentiated. It is only set inside ``step()``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .masks import RowGroups, document_runs

__all__ = [
    "SegmentInfo",
    "SegmentKV",
    "StageKVState",
    "UnitContext",
    "current_documents",
    "current_segment",
    "current_unit",
    "packed_documents",
]


@dataclass(frozen=True)
class SegmentInfo:
    """Where the running unit sits in its sample: what RoPE and attention need to know."""

    microbatch: int
    segment: int
    num_segments: int
    start: int  # absolute position of the segment's first token
    length: int
    seq_len: int  # full sequence length of the sample
    bounds: tuple[int, ...] = ()  # every segment's start, then seq_len
    documents: RowGroups | None = None  # the sample's document runs (packed documents)

    @property
    def end(self) -> int:
        return self.start + self.length

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Absolute positions ``start .. start + length - 1`` (for RoPE)."""
        return torch.arange(self.start, self.start + self.length, device=device)


@dataclass
class SegmentKV:
    """The part of one segment's K and V that later segments see, as grad-accumulating
    leaves; ``start`` is the absolute position of its first key."""

    k: torch.Tensor
    v: torch.Tensor
    start: int = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class StageKVState:
    """K/V caches of one pipeline stage, keyed by sample then by attention layer.

    Also enforces the segment order that makes the cached gradients correct: forwards of a
    sample 0..K-1, backwards K-1..0. A violation raises instead of producing wrong gradients.
    """

    stage_index: int
    num_segments: int
    skip_invisible: bool = True  # see ScheduleSeq1F1B(skip_invisible=...)
    peak_bytes: int = 0  # most K/V bytes cached at once since clear(reset_peak=True)
    _cache: dict[int, dict[Hashable, list[SegmentKV | None]]] = field(default_factory=dict)
    _next_fwd: dict[int, int] = field(default_factory=dict)
    _next_bwd: dict[int, int] = field(default_factory=dict)
    _weights_done: dict[int, set[int]] = field(default_factory=dict)

    def layer_entries(self, microbatch: int, layer: Hashable) -> list[SegmentKV | None]:
        return self._cache.setdefault(microbatch, {}).setdefault(layer, [])

    def begin_forward(self, microbatch: int, segment: int) -> None:
        expected = self._next_fwd.get(microbatch, 0)
        if segment != expected:
            raise RuntimeError(
                f"Seq1F1B order violation on stage {self.stage_index}: forward of sample "
                f"{microbatch} segment {segment}, but segment {expected} is next. Segments of a "
                "sample must run forward in order 0..K-1 (they read earlier segments' K/V)."
            )

    def end_forward(self, microbatch: int, segment: int, keep: bool) -> None:
        """Record the forward; without a backward to come, drop the sample after its last one."""
        self._next_fwd[microbatch] = segment + 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        if not keep and segment == self.num_segments - 1:
            self._cache.pop(microbatch, None)

    def begin_backward(self, microbatch: int, segment: int) -> None:
        expected = self._next_bwd.get(microbatch, self.num_segments - 1)
        if segment != expected or self._next_fwd.get(microbatch, 0) <= segment:
            raise RuntimeError(
                f"Seq1F1B order violation on stage {self.stage_index}: backward of sample "
                f"{microbatch} segment {segment}, but segment {expected} must run first. "
                "Backwards must go K-1..0 within a sample: running an earlier segment first "
                "would drop the K/V gradients of the later segments (silently wrong grads). "
                "Use ScheduleSeq1F1B's own order; GPipe-style ascending backward is not valid."
            )

    def end_backward(self, microbatch: int, segment: int, free: bool = True) -> None:
        """Free the segment's K/V (no later use) and the whole sample after segment 0.

        ``free=False`` (the input half of a split backward): keep them, since checkpointing
        may recompute the segment's attention again in its BACKWARD_WEIGHT; the sample is
        dropped once every segment's weight half ran (:meth:`end_weight`).
        """
        self._next_bwd[microbatch] = segment - 1
        if not free:
            return
        layers = self._cache.get(microbatch)
        if layers is None:
            return
        if segment == 0:
            del self._cache[microbatch]
            return
        for entries in layers.values():
            if segment < len(entries):
                entries[segment] = None

    def end_weight(self, microbatch: int, segment: int) -> None:
        """The weight half of a split backward ran; after the sample's last, drop its K/V."""
        done = self._weights_done.setdefault(microbatch, set())
        done.add(segment)
        if len(done) == self.num_segments:
            self._cache.pop(microbatch, None)
            del self._weights_done[microbatch]

    def clear(self, reset_peak: bool = False) -> None:
        self._weights_done.clear()
        if reset_peak:
            self.peak_bytes = 0
        self._cache.clear()
        self._next_fwd.clear()
        self._next_bwd.clear()

    def nbytes(self) -> int:
        """Bytes held by cached K/V (shared with activations autograd keeps anyway)."""
        return sum(
            e.nbytes()
            for layers in self._cache.values()
            for entries in layers.values()
            for e in entries
            if e is not None
        )

    def is_empty(self) -> bool:
        return not self._cache


@dataclass(frozen=True)
class UnitContext:
    """The unit a stage is running, with the state its attention layers use."""

    state: StageKVState
    info: SegmentInfo
    phase: str  # "forward" or "backward" (checkpoint recomputation, also in a weight half)
    keep_kv: bool  # a backward will follow: cache K/V as grad-accumulating leaves


_ACTIVE: list[UnitContext] = []
_DOCUMENTS: list[RowGroups] = []
_INFERRING: list[bool] = []


def current_unit() -> UnitContext | None:
    """The active unit context, or None outside a Seq1F1B unit."""
    return _ACTIVE[-1] if _ACTIVE else None


def current_segment() -> SegmentInfo | None:
    """Segment of the unit being run (None outside ``ScheduleSeq1F1B.step``).

    Models use it for RoPE at absolute positions: ``info.positions(device)``.
    """
    ctx = current_unit()
    return ctx.info if ctx is not None else None


@contextmanager
def activate(ctx: UnitContext) -> Iterator[UnitContext]:
    """Make ``ctx`` the active unit for the duration of one forward or backward."""
    _ACTIVE.append(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.pop()


def current_documents() -> RowGroups | None:
    """Document runs of the running unit's sample, else of an enclosing ``packed_documents``."""
    ctx = current_unit()
    if ctx is not None:
        return ctx.info.documents
    return _DOCUMENTS[-1] if _DOCUMENTS else None


@contextmanager
def packed_documents(document_ids: torch.Tensor) -> Iterator[None]:
    """Mask attention at document boundaries outside a Seq1F1B step (unpipelined runs).

    ``document_ids`` is (batch, seq_len), one contiguous run of equal ids per document; inside
    ``ScheduleSeq1F1B.step`` pass it as ``step(..., document_ids=...)`` instead. With
    activation checkpointing, keep the block around ``backward()`` too: recomputation attends
    again.
    """
    _DOCUMENTS.append(document_runs(document_ids))
    try:
        yield
    finally:
        _DOCUMENTS.pop()


@contextmanager
def metadata_inference() -> Iterator[None]:
    """The pipeline stage runs its model once for output shapes only (no unit, no masks)."""
    _INFERRING.append(True)
    try:
        yield
    finally:
        _INFERRING.pop()


def inferring_metadata() -> bool:
    return bool(_INFERRING)
