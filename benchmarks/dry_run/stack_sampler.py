"""Where one thread's CPU time goes, by cause: a sampling profiler and the causes it sorts into.

:class:`StackSampler` reads the main thread's Python stack every half millisecond from a
second thread (``sys._current_frames``), a cost the sampled thread hardly pays (unlike
``cProfile``, which doubles the time of call-heavy Python such as a tile loop). Each sample
goes to the cause of the innermost frame that names one (:func:`cause_of`); frames of glue
code (context managers, pytree, torch's op and custom-op call paths) defer to their callers.

What a sample cannot tell: time in C++ is charged to the Python frame that called into it, so
a cause includes the torch ops it calls (their dispatch, and the kernel on real tensors); and
time in torch's C++ autograd engine between its Python callbacks is ``autograd engine``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping
from types import CodeType, TracebackType

__all__ = ["ARTEFACTS", "CAUSES", "ONCE", "StackSampler", "cause_of", "shares"]

#: causes a real GPU run pays on every unit, in print order
CAUSES = (
    "schedule",  # the pipelining runtime and ours: actions, sends/receives, unit bookkeeping
    "plans",  # tile plans and visibility (attention/masks.py)
    "kv cache",  # the K/V cache's bookkeeping around each attention call (attention/kv.py)
    "tiles",  # the attention's tile loop, its merges and kernels (attention/tiles.py, layer.py)
    "model",  # the model's modules and ops outside the attention (and the chunked loss)
    "autograd engine",  # torch's C++ backward between its Python callbacks
    "other",
)
#: causes of the measurement itself, which a real run does not pay
ARTEFACTS = ("fake dispatch", "memory tracker", "device estimate", "measurement")
#: causes paid once per step (pre-flight) or once per run (first-step check)
ONCE = ("pre-flight", "first-step check")

_SITE = "site-packages/"
#: (path fragment, cause) by frame file; the first fragment found in the path decides
_BY_FILE: tuple[tuple[str, str | None], ...] = (
    # glue: the caller decides
    ("/contextlib.py", None),
    ("/functools.py", None),
    ("torch/utils/_contextlib.py", None),
    ("torch/_compile.py", None),
    ("torch/_dynamo/", None),
    ("torch/utils/_pytree.py", None),
    ("torch/_ops.py", None),
    ("torch/_library/", None),
    ("torch/autograd/function.py", None),
    ("torch/utils/weak.py", None),
    ("torch/overrides.py", None),
    ("torch/_tensor.py", None),
    ("torch/utils/hooks.py", None),
    ("torch/utils/_stats.py", None),
    ("torch/_jit_internal.py", None),
    ("<string>", None),  # dataclass-made methods
    # the measurement's own
    ("torch/_subclasses/", "fake dispatch"),
    ("torch/_meta_registrations.py", "fake dispatch"),
    ("torch/_decomp/", "fake dispatch"),
    ("torch/_refs/", "fake dispatch"),
    ("torch/_prims", "fake dispatch"),
    ("torch/fx/", "fake dispatch"),
    ("torch/utils/_python_dispatch.py", "fake dispatch"),
    ("torch/_guards.py", "fake dispatch"),
    ("torch/_logging/", "fake dispatch"),
    ("torch/distributed/_tools/", "memory tracker"),
    ("seq1f1b/_runtime/fake.py", "memory tracker"),
    ("seq1f1b/planning/dryrun/", "device estimate"),
    ("torch/utils/flop_counter.py", "device estimate"),
    ("benchmarks/", "measurement"),
    # what a real run pays
    ("seq1f1b/attention/masks.py", "plans"),
    ("seq1f1b/attention/kv.py", "kv cache"),
    ("seq1f1b/attention/", "tiles"),
    ("seq1f1b/testing.py", "model"),
    ("seq1f1b/chunked_loss.py", "model"),
    ("torch/nn/", "model"),
    ("torch/functional.py", "model"),
    ("torch/utils/checkpoint.py", "model"),
    ("torch/autograd/", "autograd engine"),
    ("seq1f1b/", "schedule"),
    ("torch/distributed/", "schedule"),
    ("torch/testing/_internal/distributed/", "schedule"),  # the fake process group's ops
)
#: functions whose file's cause is not theirs
_BY_FUNCTION = {
    ("seq1f1b/_runtime/ir.py", "flash_cpu_forward"): "tiles",
    ("seq1f1b/_runtime/ir.py", "flash_cpu_backward"): "tiles",
    ("seq1f1b/attention/kv.py", "positions"): "model",  # RoPE's positions
    ("seq1f1b/attention/attention_op.py", "_segment_positions"): "model",
}
#: kv.py's per-stage state, driven by the schedule's unit actions (its methods, for Python
#: 3.10's code objects, which have no qualified name)
_KV_STATE = "StageKVState"
_KV_STATE_METHODS = {"begin_forward", "end_forward", "begin_backward", "end_backward",
                     "end_weight", "clear", "nbytes", "is_empty", "layer_entries",
                     "put_record", "get_record", "pop_record"}  # fmt: skip
#: a frame anywhere on the stack with one of these (file, function) makes the sample once-only
_ONCE_FRAMES = {
    ("seq1f1b/schedules/sequence_schedule.py", "_get_microbatch_inputs"): "pre-flight",
    ("seq1f1b/schedules/unit_actions.py", "compare_outputs"): "first-step check",
    ("seq1f1b/schedules/unit_actions.py", "raise_if_check_failed"): "first-step check",
    ("seq1f1b/schedules/unit_actions.py", "__torch_function__"): "first-step check",
    ("seq1f1b/attention/mixing_probe.py", "mixes_positions"): "first-step check",
}
_ONCE_FILES = ("seq1f1b/schedules/output_check.py",)


def _short(path: str) -> str:
    """A frame's file from the package root on (``torch/...``, ``seq1f1b/...``)."""
    if _SITE in path:
        return path.split(_SITE, 1)[1]
    for root in ("seq1f1b/", "benchmarks/"):
        if f"/{root}" in path:
            return root + path.split(f"/{root}", 1)[1]
    return path


def _frame_cause(code: CodeType) -> str | None:
    path = _short(code.co_filename)
    named = _BY_FUNCTION.get((path, code.co_name))
    if named is not None:
        return named
    if path == "seq1f1b/attention/kv.py":
        qualname = getattr(code, "co_qualname", "")
        if qualname.startswith(_KV_STATE) or (not qualname and code.co_name in _KV_STATE_METHODS):
            return "schedule"
    for fragment, cause in _BY_FILE:
        if fragment in path:
            return cause
    return "other"


def cause_of(stack: tuple[CodeType, ...]) -> str:
    """The cause of one sample, ``stack`` innermost first (see the module docstring)."""
    for code in stack:
        path = _short(code.co_filename)
        once = _ONCE_FRAMES.get((path, code.co_name))
        if once is None and path in _ONCE_FILES:
            once = "first-step check"
        if once is not None:
            return once
    for code in stack:
        cause = _frame_cause(code)
        if cause is not None:
            return cause
    return "other"


class StackSampler:
    """Samples the entering thread's stack until exit (``counts``: stack -> samples).

    The interpreter's switch interval is lowered meanwhile, so that the sampled thread hands
    the GIL over within 0.1 ms of each request; it is put back on exit."""

    def __init__(self, interval_s: float = 5e-4) -> None:
        self.interval_s = interval_s
        self.counts: Counter[tuple[CodeType, ...]] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._target = 0
        self._switch = 0.0

    def __enter__(self) -> StackSampler:
        self._target = threading.get_ident()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._switch)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.interval_s)
            frame = sys._current_frames().get(self._target)
            stack = []
            while frame is not None:
                stack.append(frame.f_code)
                frame = frame.f_back
            if stack:
                self.counts[tuple(stack)] += 1

    def by_cause(self) -> Counter[str]:
        """Samples per cause (:func:`cause_of`)."""
        out: Counter[str] = Counter()
        for stack, n in self.counts.items():
            out[cause_of(stack)] += n
        return out

    def innermost(self, cause: str, top: int = 10) -> list[tuple[str, int]]:
        """The ``top`` innermost functions of ``cause``'s samples (to look into a cause)."""
        out: Counter[str] = Counter()
        for stack, n in self.counts.items():
            if cause_of(stack) == cause:
                out[f"{_short(stack[0].co_filename)}:{stack[0].co_name}"] += n
        return out.most_common(top)


def shares(samples: Mapping[str, int], seconds: float) -> dict[str, float]:
    """Seconds per cause: ``seconds`` (the thread's CPU time) split as the samples are."""
    total = sum(samples.values())
    return {cause: seconds * n / total for cause, n in samples.items()} if total else {}
