"""The unit context belongs to the step that set it, not to the process, and backwards see it:
on the thread that calls ``backward()`` directly, on autograd's worker threads (CUDA) through
the snapshot the engine carries (``AutogradContextVar``)."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from seq1f1b._runtime import AutogradContextVar, as_backward_worker, backward_launch_context
from seq1f1b.attention import kv

pytestmark = pytest.mark.fast


def _unit(stage_index: int) -> kv.UnitContext:
    state = kv.StageKVState(stage_index, 1)
    info = kv.SegmentInfo(0, 0, 1, 0, 4, 4, (0, 4))
    return kv.UnitContext(state, info, "forward", keep_kv=False)


def _in_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_fresh_thread_sees_nothing_and_a_backward_launchers_snapshot_is_seen() -> None:
    var: AutogradContextVar[str] = AutogradContextVar("probe", "default")
    with var.bound("unit"):
        assert var.get() == "unit"
        snapshot = contextvars.copy_context()
        assert _in_thread(var.get) == "default"  # a plain thread: not this step's

        def as_engine_worker() -> str:
            # what the engine does on a device worker thread: the launcher's snapshot is in
            # the thread-local state torch's backward launcher stashed and the task restored
            with as_backward_worker(snapshot):
                return var.get()

        assert _in_thread(as_engine_worker) == "unit"
    assert var.get() == "default"


def test_torchs_backward_launcher_carries_the_callers_context() -> None:
    """The snapshot AutogradContextVar reads on worker threads: if a torch release stops
    stashing it, this fails (and recomputation on CUDA would lose the unit)."""
    var: AutogradContextVar[str] = AutogradContextVar("probe", "default")
    seen: list[Any] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            launched = backward_launch_context()
            assert launched is not None  # inside a backward: the launcher's snapshot
            seen.append(launched.get(var._var, None))
            return g * 2

    x = torch.ones(3, requires_grad=True)
    with var.bound("unit"):
        Probe.apply(x).sum().backward()
    assert seen == ["unit"]


def test_two_steps_in_two_threads_each_see_their_own_unit() -> None:
    barrier = threading.Barrier(2)
    seen: dict[int, int | None] = {}

    def step(stage_index: int) -> None:
        with kv.activate(_unit(stage_index)):
            barrier.wait()  # both units active at once
            unit = kv.current_unit()
            seen[stage_index] = None if unit is None else unit.state.stage_index
            barrier.wait()

    threads = [threading.Thread(target=step, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: 0, 1: 1}
    assert kv.current_unit() is None


def test_nested_units_and_documents_unwind() -> None:
    outer, inner = _unit(0), _unit(1)
    with kv.activate(outer):
        with kv.activate(inner):
            assert kv.current_unit() is inner
        assert kv.current_unit() is outer
    assert kv.current_unit() is None
    ids = torch.tensor([[0, 0, 1, 1]])
    with kv.packed_documents(ids):
        assert kv.current_documents() is not None
        with kv.metadata_inference():
            assert kv.inferring_metadata()
        assert not kv.inferring_metadata()
    assert kv.current_documents() is None
