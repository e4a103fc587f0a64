"""Per-action timing and saved-activation accounting inside a real pipeline step.

Why: a fair memory comparison needs the same definition for every schedule. We count the bytes
of tensors *saved for backward* that are alive at any moment of the step, per stage:

* a ``saved_tensors_hooks`` pack hook wraps each saved tensor in a small holder object; the
  autograd graph keeps the holder exactly as long as it keeps the saved tensor, and the holder's
  ``__del__`` marks the release (so the count follows the graph, not other references to the
  same tensor, e.g. torch's reused receive buffers);
* storages are de-duplicated by ``untyped_storage().data_ptr()`` and counted once (Seq1F1B's
  cached K/V share storage with the saved k/v, so they are not double counted);
* parameters are excluded (they are saved by every linear layer but are not activations);
* the running total is updated on every pack and release, so the peak is exact, not sampled.

Timing: :class:`ProbedStage` subclasses ``PipelineStage`` and brackets ``forward_one_chunk`` /
``backward_one_chunk`` / ``backward_weight_one_chunk`` with ``time.perf_counter()`` (the Linux
monotonic clock, comparable across processes) and ``time.thread_time()`` (CPU time of the
computing thread: with one intra-op thread, the action's own compute, whatever else runs on
the core). A subclass rather than instance attributes,
because ``ScheduleSeq1F1B`` wraps those methods per step and calls the class's versions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from seq1f1b.bitpipe import BitPipeStage

__all__ = ["ActionRecord", "ProbedBitPipeStage", "ProbedStage", "RankProbe", "SavedTensorMeter"]


@dataclass(frozen=True)
class ActionRecord:
    """One compute action as it ran: stage, kind (F/B/I/W), microbatch, wall start/end and
    the CPU time its thread spent (s)."""

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float
    cpu: float


class _Held:
    """What the autograd graph stores instead of a saved tensor; its death is the release."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of saved-for-backward storages, per stage, on one rank."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        # Stage the next saved tensors belong to: set when a forward starts and kept for the
        # loss computed right after it; -1 (not counted) until the step's first forward, which
        # skips torch's one-time stage initialisation.
        self.stage = -1
        self._refs: dict[int, int] = {}
        self._owner: dict[int, tuple[int, int]] = {}  # ptr -> (stage, nbytes)
        self.live: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.live_total = 0
        self.peak_total = 0

    def reset_peaks(self) -> None:
        self.peak = dict(self.live)
        self.peak_total = self.live_total

    def _pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._exclude or self.stage < 0:
            return t
        n = self._refs.get(ptr, 0)
        if n == 0:
            size = storage.nbytes()
            self._owner[ptr] = (self.stage, size)
            self.live[self.stage] = self.live.get(self.stage, 0) + size
            self.peak[self.stage] = max(self.peak.get(self.stage, 0), self.live[self.stage])
            self.live_total += size
            self.peak_total = max(self.peak_total, self.live_total)
        self._refs[ptr] = n + 1
        # detached: a saved *output* held as itself would close a cycle through C++ (tensor ->
        # grad_fn -> saved variable -> holder -> tensor) that outlives a graph retained by a
        # split backward's input half, so the meter would count it until the step's end
        return _Held(self, ptr, t.detach())

    @staticmethod
    def _unpack(h: Any) -> Any:
        return h.tensor if isinstance(h, _Held) else h

    def _release(self, ptr: int) -> None:
        n = self._refs.get(ptr, 0) - 1
        if n > 0:
            self._refs[ptr] = n
            return
        self._refs.pop(ptr, None)
        stage, size = self._owner.pop(ptr, (-1, 0))
        self.live[stage] = self.live.get(stage, 0) - size
        self.live_total -= size

    @contextmanager
    def active(self) -> Iterator[SavedTensorMeter]:
        """Count everything autograd saves inside this block (on this thread)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class RankProbe:
    """Shared by a rank's stages: the action log of the current step, and the meter."""

    def __init__(self) -> None:
        self.records: list[ActionRecord] = []
        self.meter: SavedTensorMeter | None = None
        # bytes each forward left saved on its stage (its loss included: counted up to the
        # rank's next action), i.e. one unit's activations: peak / this = units in flight
        self.unit_bytes: dict[int, list[int]] = {}
        self._open: tuple[int, int] | None = None  # (stage, live bytes) at a forward's start

    def clear(self) -> None:
        self.records = []

    def close_forward(self) -> None:
        """Book the bytes the last forward (and its loss) left saved on its stage."""
        if self._open is not None and self.meter is not None:
            stage, before = self._open
            self.unit_bytes.setdefault(stage, []).append(self.meter.live.get(stage, 0) - before)
        self._open = None

    @contextmanager
    def span(self, stage: int, kind: str, microbatch: int) -> Iterator[None]:
        self.close_forward()
        if self.meter is not None and kind == "F":
            self.meter.stage = stage
            self._open = (stage, self.meter.live.get(stage, 0))
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            self.records.append(ActionRecord(stage, kind, microbatch, t0, t1, c1 - c0))


class _Probed:
    """Mixin for a stage class: report each compute action to ``self.probe``."""

    stage_index: int

    def __init__(self, *args: Any, probe: RankProbe, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.probe = probe

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        with self.probe.span(self.stage_index, "F", fwd_chunk_id):
            return super().forward_one_chunk(  # type: ignore[misc]
                fwd_chunk_id, args, kwargs, save_forward_output
            )

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        kind = "B" if full_backward else "I"
        with self.probe.span(self.stage_index, kind, bwd_chunk_id):
            return super().backward_one_chunk(  # type: ignore[misc]
                bwd_chunk_id, loss, full_backward, last_backward
            )

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self.probe.span(self.stage_index, "W", bwd_chunk_id):
            return super().backward_weight_one_chunk(  # type: ignore[misc]
                bwd_chunk_id, last_backward
            )


class ProbedStage(_Probed, PipelineStage):
    """``PipelineStage`` that reports each compute action to a :class:`RankProbe`."""


class ProbedBitPipeStage(_Probed, BitPipeStage):
    """``BitPipeStage`` (per-replica ends, V placement) that reports to a :class:`RankProbe`."""
