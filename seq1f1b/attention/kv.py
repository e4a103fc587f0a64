"""Per-stage, per-sample K/V state for sequence segments, and the unit context.

While ``ScheduleSeq1F1B`` runs a unit (sample ``m``, segment ``k``) on a stage, it activates a
:class:`UnitContext`; chunk-aware attention layers read it to find the K/V of the earlier
segments of the same sample. The cached K/V are detached leaves that share storage with the
owning segment's K/V (no copy): the backward of later segments accumulates dL/dK, dL/dV into
their ``.grad`` and the owning segment's backward injects those grads into its own graph.

The active context lives in a context variable that backwards see (:class:`AutogradContextVar`):
it belongs to the step that set it, not to the process, and autograd's CUDA worker threads,
which run checkpoint recomputation, see the unit being differentiated. It is only set inside
``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import torch
from torch.distributed import all_reduce
from torch.distributed.tensor import DTensor

from .._runtime import AutogradContextVar, outside_fake_mode
from .masks import MaskSpec, RowGroups, Runs, document_runs, first_seen, visible_blocks

__all__ = [
    "AttentionCall",
    "CachedPrefix",
    "ContextParallel",
    "ExpandedKV",
    "SegmentInfo",
    "SegmentKV",
    "StageKVState",
    "UnitContext",
    "attend_cache",
    "attention_call",
    "cache_entry",
    "current_documents",
    "current_segment",
    "current_unit",
    "packed_documents",
    "reexpanded_prefix",
    "saved_prefix",
    "send_through_expansions",
]


def zigzag_runs(start: int, end: int, rank: int, size: int) -> Runs:
    """The load-balanced context-parallel shard of positions ``[start, end)`` on CP rank
    ``rank`` of ``size``: chunks ``rank`` and ``2*size-1-rank`` of ``2*size`` equal chunks, so
    every rank gets the same causal work (Megatron CP's and torch's head-tail layout).
    ``end - start`` must be a multiple of ``2*size``."""
    if size == 1:
        return ((start, end),)
    chunk, rem = divmod(end - start, 2 * size)
    if rem or chunk == 0:
        raise ValueError(
            f"a segment of {end - start} tokens cannot be split over {size} context-parallel "
            f"ranks: each segment must be a positive multiple of 2*cp = {2 * size} tokens (use "
            "SequenceSplit(multiple_of=...), or a sequence length divisible by seq_chunks * 2 * cp)"
        )
    a, b = start + rank * chunk, end - (rank + 1) * chunk
    return ((a, a + chunk), (b, b + chunk))


CP_CHUNKS_PER_RANK = (2, 4, 8, 16, 32, 64)  # the finer document-balanced layouts tried
CP_LAYOUT_TOLERANCE = 1.02  # the coarsest layout within 2% of the best max work is taken


def attention_work(documents: RowGroups, start: int, end: int) -> torch.Tensor:
    """Keys each position of ``[start, end)`` attends to, summed over the sample's rows
    (int64; causal within its document, earlier segments' keys included)."""
    pos = torch.arange(start, end, dtype=torch.int64)
    work = torch.zeros(end - start, dtype=torch.int64)
    for r0, r1, runs in documents:
        doc_starts = torch.tensor([a for a, _ in runs], dtype=torch.int64)
        first = doc_starts[torch.searchsorted(doc_starts, pos, right=True) - 1]
        work += (r1 - r0) * (pos - first + 1)
    return work


def _assign(work: list[int], size: int, per_rank: int) -> tuple[list[int], list[list[int]]]:
    """Chunks to ranks, ``per_rank`` each, costliest first onto the least-loaded rank with
    room (ties: the lower index): every rank's load and its chunks."""
    loads, owned = [0] * size, [[] for _ in range(size)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min((r for r in range(size) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        loads[r] += work[i]
        owned[r].append(i)
    return loads, owned


def _merged(chunks: list[int], start: int, chunk: int) -> Runs:
    """Sorted chunk indices as absolute runs, adjacent chunks merged."""
    runs: list[tuple[int, int]] = []
    for i in sorted(chunks):
        a = start + i * chunk
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], a + chunk)
        else:
            runs.append((a, a + chunk))
    return tuple(runs)


@lru_cache(maxsize=1024)
def document_cp_layout(start: int, end: int, size: int, documents: RowGroups) -> tuple[Runs, ...]:
    """Every CP rank's shard of ``[start, end)`` balanced for the sample's documents.

    Under a document mask a position's attention work is its offset in its document, not its
    offset in the sequence, so the head-tail layout (:func:`zigzag_runs`) no longer gives the
    ranks equal work. The segment is cut into ``size * n`` equal chunks (``n`` in
    :data:`CP_CHUNKS_PER_RANK`, as the length allows) and each rank takes ``n`` of them,
    costliest first onto the least-loaded rank: every rank holds as many tokens as with the
    head-tail layout (the ring's blocks keep one shape). The head-tail layout is kept unless a
    finer one lowers the largest rank's work; the coarsest layout within
    :data:`CP_LAYOUT_TOLERANCE` of the best is taken (fewer, larger tiles). Integer work and
    fixed tie rules: every rank computes the same layout from the documents alone."""
    zigzag = tuple(zigzag_runs(start, end, r, size) for r in range(size))
    with outside_fake_mode():  # host data, read as such (real in a dry run too)
        work = attention_work(documents, start, end)
        prefix = torch.cat([work.new_zeros(1), work.cumsum(0)]).tolist()

    def load(runs: Runs) -> int:
        return sum(prefix[b - start] - prefix[a - start] for a, b in runs)

    candidates = [(max(load(runs) for runs in zigzag), zigzag)]
    length = end - start
    for per_rank in CP_CHUNKS_PER_RANK:
        n = size * per_rank
        if length % n:
            break
        chunk = length // n
        chunk_work = [prefix[(i + 1) * chunk] - prefix[i * chunk] for i in range(n)]
        loads, owned = _assign(chunk_work, size, per_rank)
        candidates.append((max(loads), tuple(_merged(c, start, chunk) for c in owned)))
    best = min(worst for worst, _ in candidates)
    for worst, layout in candidates:  # coarsest first
        if worst * 100 <= best * round(CP_LAYOUT_TOLERANCE * 100):
            return layout
    raise AssertionError("unreachable: the best candidate is within tolerance of itself")


@dataclass(frozen=True)
class ContextParallel:
    """The context-parallel group a stage's sequence is sharded over (see
    :mod:`seq1f1b.attention.context_parallel`); ``prefix`` is how cached segments are reached."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int
    prefix: str = "auto"  # "pass_q", "pass_kv" or "auto" (fewer bytes, per segment)

    def runs(
        self, start: int, end: int, rank: int | None = None, documents: RowGroups | None = None
    ) -> Runs:
        """Rank ``rank``'s (default: this rank's) shard of ``[start, end)``: head-tail, or
        balanced for the sample's ``documents`` (:func:`document_cp_layout`)."""
        rank = self.rank if rank is None else rank
        if documents is None or self.size == 1:
            return zigzag_runs(start, end, rank, self.size)
        return document_cp_layout(start, end, self.size, documents)[rank]

    def average_grads(self, params: Iterator[torch.nn.Parameter]) -> None:
        """Each CP rank holds the gradient of its shard's loss share: average them in place,
        one asynchronous all-reduce per gradient (no flat copy of all gradients)."""
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
            if p.grad is not None
        ]
        works = [all_reduce(g, group=self.group, async_op=True) for g in grads]
        for g, work in zip(grads, works, strict=True):
            work.wait()
            g.div_(self.size)


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
    cp: ContextParallel | None = None  # context parallelism: this rank holds a shard

    @property
    def end(self) -> int:
        return self.start + self.length

    @cached_property
    def local_runs(self) -> Runs:
        """The absolute position runs this rank holds of the segment (all of it without CP);
        computed once per unit (a document layout is looked up by the whole document tuple)."""
        if self.cp is None:
            return ((self.start, self.end),)
        return self.cp.runs(self.start, self.end, documents=self.documents)

    @property
    def local_length(self) -> int:
        """Positions of the segment on this rank: the input's sequence length."""
        return sum(b - a for a, b in self.local_runs)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Absolute positions of this rank's tokens of the segment, in order (for RoPE):
        ``start .. start + length - 1``, or the two chunks of a context-parallel shard."""
        if self.cp is None:
            return torch.arange(self.start, self.start + self.length, device=device)
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.local_runs])


@dataclass
class SegmentKV:
    """The part of one segment's K and V that later segments see, as grad-accumulating
    leaves; ``start`` is the absolute position of its first key."""

    k: torch.Tensor
    v: torch.Tensor
    start: int = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(frozen=True)
class ExpandedKV:
    """An earlier segment's K and V as a later segment reads them, re-expanded from the
    segment's cached latent (``latent``: the cache entry, its two tensors as grad-accumulating
    leaves) by ``expand`` (the layer's own up-projection). Nothing expanded is kept: the
    forward expands without a graph, the backward again with one, and sends the K/V gradients
    through it into the latent's ``.grad`` and the up-projection's weights."""

    latent: SegmentKV
    expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    @property
    def start(self) -> int:
        return self.latent.start

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, no graph (the forward's tiles)."""
        with torch.no_grad():
            return self.expand(self.latent.k, self.latent.v)

    def with_graph(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V with the graph back to the latent and the weights (the backward's)."""
        with torch.enable_grad():
            return self.expand(self.latent.k, self.latent.v)


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
    #: chunk-aware calls: attention, and carried-state reads (counted in guarded steps)
    attention_calls: int = 0
    _cache: dict[int, dict[Hashable, list[SegmentKV | None]]] = field(default_factory=dict)
    _next_fwd: dict[int, int] = field(default_factory=dict)
    _next_bwd: dict[int, int] = field(default_factory=dict)
    _weights_done: dict[int, set[int]] = field(default_factory=dict)
    # compiled attention's per-call records (seq1f1b.attention.attention_op), by unit then call id
    _records: dict[tuple[int, int], dict[int, Any]] = field(default_factory=dict)

    def put_record(self, microbatch: int, segment: int, rid: int, record: Any) -> None:
        self._records.setdefault((microbatch, segment), {})[rid] = record

    def get_record(self, microbatch: int, segment: int, rid: int) -> Any:
        return self._records.get((microbatch, segment), {}).get(rid)

    def pop_record(self, microbatch: int, segment: int, rid: int) -> Any:
        return self._records.get((microbatch, segment), {}).pop(rid, None)

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
        self._records.pop((microbatch, segment), None)  # a recomputed call's leftovers
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
        self._records.pop((microbatch, segment), None)
        done = self._weights_done.setdefault(microbatch, set())
        done.add(segment)
        if len(done) == self.num_segments:
            self._cache.pop(microbatch, None)
            del self._weights_done[microbatch]

    def clear(self, reset_peak: bool = False) -> None:
        self._weights_done.clear()
        self._records.clear()
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


def saved_prefix(entries: Sequence[Any], prefix: Sequence[torch.Tensor]) -> list[Any]:
    """The prefix tensors an attention's forward saves: an :class:`ExpandedKV` entry's K and V
    are not kept (None; :func:`reexpanded_prefix` makes them again in the backward)."""
    return [None if isinstance(entries[i // 2], ExpandedKV) else t for i, t in enumerate(prefix)]


def reexpanded_prefix(
    entries: Sequence[Any], prefix: Sequence[Any]
) -> tuple[list[torch.Tensor], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """An attention backward's prefix tensors: what :func:`saved_prefix` kept, and each
    expanded entry's K and V expanded again (detached), with the graphs of those expansions
    by block (for :func:`send_through_expansions`)."""
    prefix = list(prefix)
    graphs = {j: e.with_graph() for j, e in enumerate(entries) if isinstance(e, ExpandedKV)}
    for j, (k, v) in graphs.items():
        prefix[2 * j], prefix[2 * j + 1] = k.detach(), v.detach()
    return prefix, graphs


def send_through_expansions(
    graphs: dict[int, tuple[torch.Tensor, torch.Tensor]], dkv: dict[int, list[torch.Tensor]]
) -> None:
    """The K/V gradients of expanded entries back through their expansion: into the
    latent's ``.grad`` and the up-projection's weights."""
    for j, (k, v) in graphs.items():
        if j in dkv:
            torch.autograd.backward((k, v), (dkv[j][0].to(k.dtype), dkv[j][1].to(v.dtype)))


def accumulate_cache_grads(entries: Sequence[SegmentKV], dkv: dict[int, list[torch.Tensor]]):
    """Add cached K/V gradients (``dkv[j]`` for ``entries[j]``) into the entries' ``.grad``.

    The cached K/V are leaves: their gradients are accumulated here, not returned, so that a
    split backward (autograd.grad over the stage inputs only, which would skip these leaves)
    leaves them for the owning segment exactly as a full backward does. They go into the cache
    entries' own tensors: under checkpointing the saved copies are detached aliases, whose
    ``.grad`` nobody reads."""
    for block, entry in enumerate(entries):
        g = dkv.get(block)
        if g is None or isinstance(entry, ExpandedKV):  # those go back through their graph
            continue
        for leaf, grad in ((entry.k, g[0]), (entry.v, g[1])):
            if leaf.requires_grad:
                grad = grad.to(leaf.dtype)
                # in place: the entry's .grad is this function's own sum (no one else holds it)
                leaf.grad = grad if leaf.grad is None else leaf.grad.add_(grad)


class InjectKVGrad(torch.autograd.Function):
    """Identity on (k, v) whose backward adds the grads later segments left on the cache
    (the cache may hold only the segment's last positions: ``offset`` is where they start)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, entry: SegmentKV, offset: int):
        ctx.entry, ctx.offset = entry, offset
        ctx.shapes = (k.shape, v.shape)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        entry: SegmentKV = ctx.entry
        gk = _add_rows(gk, entry.k.grad, ctx.offset, ctx.shapes[0])
        gv = _add_rows(gv, entry.v.grad, ctx.offset, ctx.shapes[1])
        return gk, gv, None, None


def _add_rows(g, extra, offset: int, shape: torch.Size):
    """``g`` plus ``extra`` added at positions ``offset..`` of the sequence dim (-2)."""
    if extra is None:
        return g
    if offset == 0 and extra.shape == shape:
        return extra if g is None else g + extra
    out = torch.zeros(shape, dtype=extra.dtype, device=extra.device) if g is None else g.clone()
    out[..., offset : offset + extra.shape[-2], :] += extra
    return out


@dataclass(frozen=True)
class UnitContext:
    """The unit a stage is running, with the state its attention layers use."""

    state: StageKVState
    info: SegmentInfo
    # "forward"; "backward" (a full one), "backward_input" / "backward_weight" (the halves of
    # a split one); checkpoint recomputation runs in any backward phase
    phase: str
    keep_kv: bool  # a backward will follow: cache K/V as grad-accumulating leaves


def cache_entry(
    k: torch.Tensor,
    v: torch.Tensor,
    info: SegmentInfo,
    groups: RowGroups,
    spec: MaskSpec,
    keep: bool,
    skip: bool = True,
    copy: bool = False,
) -> SegmentKV | None:
    """What later segments will read of the running segment's K/V: nothing (no later segment
    has a tile on it), or its positions from the first one any later segment sees. A short
    tail is copied so the rest of the segment's K/V can be freed when nothing else holds it
    (checkpointing). A context-parallel shard (two runs of positions) is kept whole; the
    decision is per segment, so it is the same on every CP rank. ``skip=False`` (the mask-alone
    baseline) keeps every segment but the last whole. ``copy=True`` always copies: the
    compiled path's inputs are buffers the compiler may reuse once the attention returns."""
    bounds, seg = info.bounds, info.segment
    later = tuple((bounds[j], bounds[j + 1]) for j in range(seg + 1, info.num_segments))
    first = first_seen(info.start, info.end, later, groups, spec, skip)
    if first is None:
        return None
    offset = 0 if info.cp is not None else first - info.start
    kd, vd = k.detach()[..., offset:, :], v.detach()[..., offset:, :]
    if copy or 2 * (info.length - offset) <= info.length:
        kd, vd = kd.clone(), vd.clone()
    return SegmentKV(kd.requires_grad_(keep), vd.requires_grad_(keep), info.start + offset)


@dataclass(frozen=True)
class CachedPrefix:
    """The earlier segments a running segment reads: segment ``used[i]``, which ends at
    position ``ends[i]``, has the cache entry ``entries[i]``, plan block ``i`` (the other
    segments are invisible to it)."""

    used: tuple[int, ...] = ()
    entries: tuple[SegmentKV, ...] = ()
    ends: tuple[int, ...] = ()

    def key_runs(self) -> tuple[tuple[int, int], ...]:
        """The positions ``(start, end)`` each entry holds (on one device; a context-parallel
        entry holds this rank's shard of them)."""
        return tuple((e.start, end) for e, end in zip(self.entries, self.ends, strict=True))

    def tensors(self) -> list[torch.Tensor]:
        """``k, v`` of every entry, in order (the attention's prefix inputs; an
        :class:`ExpandedKV` entry's expanded without a graph)."""
        return [
            t
            for e in self.entries
            for t in (e.tensors() if isinstance(e, ExpandedKV) else (e.k, e.v))
        ]


def attend_cache(
    ctx: UnitContext,
    layer: Hashable,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: RowGroups,
    spec: MaskSpec,
    skip: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, CachedPrefix]:
    """The cache side of one attention layer in the running unit.

    In a forward, cache what later segments see of ``k``, ``v`` (:func:`cache_entry`); in a
    recomputation (checkpointing), find that entry again. Returns the ``k``, ``v`` to attend
    with (wired so that the gradients later segments leave on the cache flow into them) and
    the cache entries of the earlier segments the running one has tiles on. ``compiled``
    (the custom op's path, :mod:`seq1f1b.attention.attention_op`): the cached copy is private and
    ``k``, ``v`` come back unwired; the op's backward adds the cache's gradients itself."""
    info, state = ctx.info, ctx.state
    seg = info.segment
    entries = state.layer_entries(info.microbatch, layer)
    if ctx.phase == "forward":
        if len(entries) != seg:
            raise RuntimeError(
                f"Seq1F1B: attention layer {layer!r} of stage {state.stage_index} has cached "
                f"{len(entries)} segments of sample {info.microbatch} but runs segment {seg}; "
                "each attention layer must run exactly once per unit forward. The usual "
                "cause: one attention module (or one layer id) shared by several layers; give "
                "every layer its own ChunkAwareAttention instance (or its own layer id), e.g. "
                "build it inside each block's __init__, not once outside the loop"
            )
        entries.append(cache_entry(k, v, info, groups, spec, ctx.keep_kv, skip, compiled))
    elif len(entries) <= seg:  # recomputation inside a backward (checkpointing)
        raise RuntimeError(
            f"Seq1F1B: recomputing segment {seg} of sample {info.microbatch} on stage "
            f"{state.stage_index} but its K/V cache is gone"
        )
    earlier = tuple((info.bounds[j], info.bounds[j + 1]) for j in range(seg))
    used = visible_blocks(info.start, info.end, earlier, groups, spec, skip)
    prefix = CachedPrefix(
        used,
        tuple(_cached_entry(ctx, entries, j) for j in used),
        tuple(earlier[j][1] for j in used),
    )
    own = entries[seg]
    if own is not None and ctx.keep_kv and not compiled:
        k, v = InjectKVGrad.apply(k, v, own, own.start - info.start)
    return k, v, prefix


@dataclass(frozen=True)
class AttentionCall:
    """Where one attention call sits: the unit whose K/V cache it uses (None: a segment
    alone, nothing to cache), its masks and its absolute query positions ``[start, end)``."""

    unit: UnitContext | None
    plain: bool  # causal only: no documents, no window
    groups: RowGroups  # the documents (the whole sequence as one when there are none)
    start: int
    end: int
    seq_len: int


def attention_call(
    ctx: UnitContext | None,
    documents: bool | None,
    spec: MaskSpec,
    batch: int,
    length: int,
    layer: Hashable,
) -> AttentionCall:
    """The part of an attention call that depends on the running unit (eager and compiled
    paths alike); ``documents``: True requires the batch's, False ignores them."""
    if ctx is not None:
        ctx.state.attention_calls += 1
    groups = None if documents is False else current_documents()
    if documents and groups is None:
        raise ValueError(
            f"attention layer {layer!r} needs packed-document ids (documents=True) but the batch "
            "has none: pass step(..., document_ids=ids), or wrap the call in "
            "seq1f1b.packed_documents(ids) outside a pipeline step"
        )
    plain = groups is None and spec.plain
    alone = ctx is None or (ctx.info.cp is None and ctx.info.num_segments == 1)
    unit = None if alone else ctx
    if unit is None:
        start = 0 if ctx is None else ctx.info.start
        end = seq_len = start + length
    else:
        start, end, seq_len = unit.info.start, unit.info.end, unit.info.seq_len
    groups = groups or ((0, batch, ((0, seq_len),)),)
    return AttentionCall(unit, plain, groups, start, end, seq_len)


def _cached_entry(ctx: UnitContext, entries: list[SegmentKV | None], j: int) -> SegmentKV:
    """Segment ``j``'s cache entry, which the running segment reads."""
    e = entries[j]
    if e is None:
        raise RuntimeError(
            f"Seq1F1B: K/V of segment {j} (sample {ctx.info.microbatch}, stage "
            f"{ctx.state.stage_index}) was freed before segment {ctx.info.segment} used it"
        )
    return e


# The unit context, the packed documents and the shape-inference flag are stacks in context
# variables, not module state: two schedules stepping in two threads (or asyncio tasks) each see
# their own. Plain ContextVars would not do: checkpoint recomputation runs on the autograd
# engine's device worker threads (CUDA), which do not run in the caller's context;
# AutogradContextVar also reads the snapshot the engine carries from the thread that called
# backward(), so recomputation sees the unit it recomputes.
_ACTIVE: AutogradContextVar[tuple[UnitContext, ...]] = AutogradContextVar("seq1f1b_unit", ())
_DOCUMENTS: AutogradContextVar[tuple[RowGroups, ...]] = AutogradContextVar("seq1f1b_docs", ())
_INFERRING: AutogradContextVar[bool] = AutogradContextVar("seq1f1b_inferring", False)


def current_unit() -> UnitContext | None:
    """The active unit context, or None outside a Seq1F1B unit."""
    active = _ACTIVE.get()
    return active[-1] if active else None


def current_segment() -> SegmentInfo | None:
    """Segment of the unit being run (None outside ``ScheduleSeq1F1B.step``).

    Models use it for RoPE at absolute positions: ``info.positions(device)``.
    """
    ctx = current_unit()
    return ctx.info if ctx is not None else None


@contextmanager
def activate(ctx: UnitContext) -> Iterator[UnitContext]:
    """Make ``ctx`` the active unit for the duration of one forward or backward."""
    with _ACTIVE.bound((*_ACTIVE.get(), ctx)):
        yield ctx


def current_documents() -> RowGroups | None:
    """Document runs of the running unit's sample, else of an enclosing ``packed_documents``."""
    ctx = current_unit()
    if ctx is not None:
        return ctx.info.documents
    documents = _DOCUMENTS.get()
    return documents[-1] if documents else None


@contextmanager
def packed_documents(document_ids: torch.Tensor) -> Iterator[None]:
    """Mask attention at document boundaries outside a Seq1F1B step (unpipelined runs).

    ``document_ids`` is (batch, seq_len), one contiguous run of equal ids per document; inside
    ``ScheduleSeq1F1B.step`` pass it as ``step(..., document_ids=...)`` instead. With
    activation checkpointing, keep the block around ``backward()`` too: recomputation attends
    again.
    """
    with outside_fake_mode():  # host data, read as such (real ids in a dry run too)
        runs = document_runs(document_ids)
    with _DOCUMENTS.bound((*_DOCUMENTS.get(), runs)):
        yield


@contextmanager
def metadata_inference() -> Iterator[None]:
    """The pipeline stage runs its model once for output shapes only (no unit, no masks)."""
    with _INFERRING.bound(True):
        yield


def inferring_metadata() -> bool:
    return _INFERRING.get()
