"""``python -m benchmarks.dry_run.host_overhead [--quick]``: the host time per unit of the
Seq1F1B family at a real size, against the estimated device time per unit.

The dry run (:mod:`seq1f1b.planning.dryrun`) prints a host time per unit, but that is this CPU
running fake kernels under torch's MemTracker: each op pays the fake-tensor dispatch (about
0.1-0.2 ms) and the tracker's bookkeeping, which a GPU run does not. For each schedule, K and
pipeline rank this benchmark runs the same step three ways:

1. **real size, fake tensors** (Llama 3 8B at 64k by default, the dry run's model and
   schedule): the estimated device time (the dry run's roofline, :class:`DeviceTime`), the
   aten ops a GPU run would launch (kernels, views, attention tiles) and the step's CPU time,
   split by cause with a sampling profiler (:mod:`.stack_sampler`); and, unless
   ``--no-memory-tracker``, the dry run itself, whose host time it prints;
2. **the same structure at a tiny width, real tensors** (:func:`miniature_config`: every
   layer, segment, tile and loss chunk as at real size, widths of a few values): what the host
   pays per unit when each op costs its real dispatch and a tiny CPU kernel, the nearest a
   machine without a GPU comes to a GPU run's host side, split by the same causes;
3. the same miniature's **first step** (the first-step check runs: the SDPA guard, the
   whole-sequence comparison) against a first step with the check marked done: the check's
   once-per-run cost.

What the numbers bound: the fake run's host time is an upper bound of a GPU run's (fake
dispatch costs more than a launch); the miniature is an estimate, a GPU run pays a kernel
launch (a few microseconds) where the miniature pays a tiny CPU kernel, so ``+ launches`` adds
:data:`LAUNCH_S` per kernel on top: an upper estimate. Both leave out communication and what
compiled blocks save (fewer kernels: a compiled run launches fewer).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from seq1f1b import _runtime as rt
from seq1f1b.planning.dryrun import DeviceTime, RankStep, dry_run_rank, gpu_spec
from seq1f1b.planning.dryrun.step import steady_state
from seq1f1b.registry import REGISTRY, lookup
from seq1f1b.testing import TinyConfig

from .model_ranks import SHAPES, build_rank
from .stack_sampler import ARTEFACTS, CAUSES, StackSampler, shares

__all__ = ["SCHEDULES", "Case", "Setting", "main", "measure", "miniature_config"]

#: the Seq1F1B family: every sequence-chunked schedule, split backwards included
SCHEDULES = tuple(e.name for e in REGISTRY if e.seq_chunked)
#: what a GPU run pays per launched kernel beyond the miniature's tiny CPU kernel (cudaLaunch)
LAUNCH_S = 5e-6


@dataclass(frozen=True)
class Setting:
    """The model and step every case runs (the dry run's ``python -m benchmarks.dry_run``)."""

    shape: str | TinyConfig = "llama3-8b"  # a name of SHAPES, or a config
    seq_len: int = 65536
    pp: int = 4
    microbatches: int = 4
    loss_chunks: int = 16
    gpu: str = "h100-80gb"
    memory_tracker: bool = True  # also run the dry run itself (slow: its MemTracker)
    steps: int = 5  # timed steady steps of the miniature (the median is kept)
    pairs: int = 3  # first steps with and without the first-step check, each

    @property
    def cfg(self) -> TinyConfig:
        return SHAPES[self.shape] if isinstance(self.shape, str) else self.shape


@dataclass(frozen=True)
class Case:
    """One schedule at one K on one pipeline rank."""

    schedule: str
    k: int
    rank: int

    @property
    def v(self) -> int:
        return lookup(self.schedule).stages_per_rank

    def build(self, cfg: TinyConfig, setting: Setting, seq_len: int) -> Any:
        return build_rank(cfg, self.schedule, setting.pp, self.v, setting.microbatches, self.k,
                          seq_len, setting.microbatches, setting.loss_chunks)  # fmt: skip


@dataclass
class Result:
    """One case's numbers, per unit (one stage's forward and backward of one segment)."""

    case: Case
    units: int
    device_s: float  # estimated device time of the step (optimizer aside)
    fake: dict[str, float]  # the real-size fake run's CPU seconds by cause
    kernels: float  # aten ops a GPU run launches (views aside)
    views: float
    tiles: float  # attention tiles (block kernel calls of the forwards)
    mini: dict[str, float]  # the miniature's CPU seconds by cause (median step)
    first_check_s: float  # the first-step check, once per run (this step's, per unit)
    dry_run_s: float | None  # the dry run's own host time (MemTracker on; wall)

    @staticmethod
    def host(causes: dict[str, float], kept: Sequence[str] = ()) -> float:
        """Seconds of ``causes`` a GPU run pays, and of the artefacts those ``kept``."""
        return sum(v for c, v in causes.items() if c not in ARTEFACTS or c in kept)

    @property
    def fake_s(self) -> float:
        """The fake run's host time with its fake dispatch (its counting and estimate aside)."""
        return self.host(self.fake, kept=("fake dispatch",))

    @property
    def estimate_s(self) -> float:
        """The miniature plus a launch per kernel: the upper estimate of a GPU run's host."""
        return self.host(self.mini) + LAUNCH_S * self.kernels


class _Ops(rt.TorchDispatchMode):
    """Counts the aten ops a GPU run would launch: kernels, views, and attention block kernels
    (forwards: one per tile); a dispatch mode's own ``prim.device`` queries aside."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.views = self.tiles = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if rt.is_subclass_dispatch(types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten":
            name = func.name()
            if func.is_view:
                self.views += 1
            else:
                self.kernels += 1
                self.tiles += "flash_attention" in name and "backward" not in name
        return out


@contextlib.contextmanager
def _prepared(build: Any, rank: int, world: int, fake: bool, checked: bool) -> Iterator[RankStep]:
    """The rank's step built in the fake world (under fake tensors if ``fake``), steady."""
    mode = rt.FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with rt.fake_world(rank, world), mode:
        step = build(rank)
        steady_state(step, checked)
        yield step


def _timed_step(step: RankStep, extra: Sequence[Any] = ()) -> tuple[float, StackSampler]:
    """One schedule step (no optimizer), its thread CPU seconds and its samples."""
    sampler = StackSampler()
    with contextlib.ExitStack() as stack:
        for ctx in extra:
            stack.enter_context(ctx)
        t0 = time.thread_time()
        with sampler:
            step.schedule.step(*step.args, target=step.target, **step.kwargs)
        spent = time.thread_time() - t0
    if step.optimizer is not None:
        step.optimizer.zero_grad(set_to_none=True)
    return spent, sampler


def _units(step: RankStep) -> int:
    return step.schedule.n_units * len(step.stages)


def real_size(case: Case, setting: Setting) -> tuple[int, float, dict[str, float], _Ops]:
    """The real-size step under fake tensors: (units, device s/unit, CPU s/unit by cause,
    op counts of the step)."""
    build = case.build(setting.cfg, setting, setting.seq_len)
    with _prepared(build, case.rank, setting.pp, fake=True, checked=True) as step:
        clock, ops = DeviceTime(gpu_spec(setting.gpu)), _Ops()
        spent, sampler = _timed_step(step, (clock, ops))
        units = _units(step)
    causes = shares(sampler.by_cause(), spent / units)
    return units, clock.seconds / units, causes, ops


def miniature_config(cfg: TinyConfig) -> TinyConfig:
    """``cfg``'s structure at a tiny width: its layers and its query heads per K/V head (so
    the same ops run), a head dim of 4 and a vocabulary of 64."""
    rep = cfg.n_heads // cfg.n_kv_heads
    return TinyConfig(vocab=64, dim=4 * rep, n_heads=rep, n_kv_heads=1, n_layers=cfg.n_layers,
                      ffn=8 * rep, rope_theta=cfg.rope_theta)  # fmt: skip


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads down to one meanwhile: a second thread's spinning and its
    waits on a shared CPU would land in the measured thread's CPU time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _ZeroReceives:
    """An action context that zeroes what each action received (the fake process group fills
    nothing: the miniature's received tensors would hold whatever memory held, NaN or
    denormals, which the first-step check compares and which slow the CPU's floats)."""

    def __call__(self, stage: Any, action: Any) -> contextlib.AbstractContextManager[None]:
        unit = action.microbatch_index
        with torch.no_grad():
            if action.computation_type == rt.FORWARD:
                for _, _, buf in rt.received_tensors(stage, unit):
                    buf.zero_()
            else:
                for info in rt.recv_infos(stage, True).get(unit, ()):
                    buf = getattr(info, "buffer", None)
                    if isinstance(buf, torch.Tensor):
                        buf.zero_()
        return contextlib.nullcontext()


def miniature(case: Case, setting: Setting) -> tuple[dict[str, float], float]:
    """The miniature's steady step (CPU s/unit by cause, the median of ``setting.steps``) and
    its first-step check (s/unit of that step): the median first step with the checks less
    the median one with them marked done, ``setting.pairs`` of each, alternated, each on a
    fresh schedule (a first step also initialises the stages)."""
    cfg = miniature_config(setting.cfg)
    build = case.build(cfg, setting, case.k * setting.loss_chunks)
    fill = _ZeroReceives()
    firsts: dict[bool, list[float]] = {True: [], False: []}
    runs: list[tuple[float, StackSampler]] = []
    units = 1
    with _one_thread():
        for pair in range(setting.pairs):
            for checked in (True, False):
                with _prepared(build, case.rank, setting.pp, fake=False, checked=checked) as step:
                    installed = rt.action_contexts_installed(step.stages, [fill])
                    firsts[checked].append(_timed_step(step, (installed,))[0])
                    units = _units(step)
                    for _ in range(setting.steps if pair == 0 and not checked else 0):
                        installed = rt.action_contexts_installed(step.stages, [fill])
                        runs.append(_timed_step(step, (installed,)))
    spent, sampler = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    check = statistics.median(firsts[False]) - statistics.median(firsts[True])
    return shares(sampler.by_cause(), spent / units), check / units


def measure(case: Case, setting: Setting) -> Result:
    """Every number of one case (see the module docstring)."""
    units, device_s, fake, ops = real_size(case, setting)
    mini, check = miniature(case, setting)
    dry = None
    if setting.memory_tracker:
        build = case.build(setting.cfg, setting, setting.seq_len)
        report = dry_run_rank(build, case.rank, setting.pp, setting.gpu)
        dry = sum(a.host_s for a in report.actions) / max(report.n_units, 1)
    return Result(case, units, device_s, fake, ops.kernels / units, ops.views / units,
                  ops.tiles / units, mini, check, dry)  # fmt: skip


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def report(results: Sequence[Result], setting: Setting) -> str:
    """The three tables: host against device, the estimate by cause, the fake run's parts."""
    key = [(r.case.schedule, r.case.k, r.case.rank) for r in results]
    head = ["schedule", "K", "rank", "units", "device ms/unit", "dry run host ms/unit",
            "fake host ms/unit", "miniature ms/unit", "+ launches ms/unit",
            "host / device"]  # fmt: skip
    rows = [[*k, r.units, _ms(r.device_s), _ms(r.dry_run_s), _ms(r.fake_s),
             _ms(r.host(r.mini)), _ms(r.estimate_s), f"{r.estimate_s / r.device_s:.1%}"]
            for k, r in zip(key, results, strict=True)]  # fmt: skip
    causes = [*CAUSES, "pre-flight"]
    split = [[*k, *(_ms(r.mini.get(c, 0.0), 2) for c in causes), _ms(LAUNCH_S * r.kernels, 2),
              _ms(r.first_check_s, 2)] for k, r in zip(key, results, strict=True)]  # fmt: skip
    fake_rows = [[*k, _ms(r.fake.get("fake dispatch", 0.0)),
                  _ms(r.fake.get("device estimate", 0.0) + r.fake.get("measurement", 0.0)),
                  _ms(r.host(r.fake)), f"{r.kernels:.0f}", f"{r.views:.0f}", f"{r.tiles:.1f}"]
                 for k, r in zip(key, results, strict=True)]  # fmt: skip
    fake_head = ["schedule", "K", "rank", "fake dispatch ms", "estimate + counting ms",
                 "rest ms", "kernels", "views", "tiles"]  # fmt: skip
    cfg = setting.cfg
    out = [
        f"{setting.shape if isinstance(setting.shape, str) else cfg}, {setting.seq_len} tokens, "
        f"pp {setting.pp}, M {setting.microbatches}, "
        f"device {setting.gpu} (estimated); host: this CPU, CPU time of the step's thread",
        "",
        _table(head, rows),
        "",
        "host / device: (miniature + a launch per kernel) over the estimated device time. dry "
        "run: the dry run's own number (fake tensors, MemTracker, wall time); fake: the same "
        "step without MemTracker, the op counting and estimate excluded (an upper bound: fake "
        "dispatch costs more than a launch); miniature: the same step on real tensors at a "
        f"tiny width ({miniature_config(cfg).dim} wide, {setting.loss_chunks} tokens a "
        "segment), every op's real dispatch and its CPU kernel at that width (most cost no more "
        "than a launch; a bf16 matmul or a flash tile costs more); + launches: "
        f"{LAUNCH_S * 1e6:g} us per kernel more (an upper estimate).",
        "",
        "The miniature's host time per unit by cause (ms; a cause includes the torch ops it "
        "calls), the launches added, and the first-step check (once per run, per unit of its "
        "step):",
        "",
        _table(["schedule", "K", "rank", *causes, "launches", "first-step check"], split),
        "",
        "The real-size fake run per unit: what the measurement adds, the rest, and the ops "
        "a GPU run launches:",
        "",
        _table(fake_head, fake_rows),
    ]
    return "\n".join(out)


def cases(schedules: Sequence[str], ks: Sequence[int], ranks: Sequence[int]) -> list[Case]:
    return [Case(s, k, r) for s in schedules for k in ks for r in ranks]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dry_run.host_overhead",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="Seq1F1B at K = 8 on rank 0 only, without the dry run itself")  # fmt: skip
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--seq-chunks", default="4,8,16", help="K values, comma-separated")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--ranks", default=None, help="pipeline ranks (default: first and last)")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--no-memory-tracker", action="store_true",
                    help="skip the dry run itself (its MemTracker: the slow part)")  # fmt: skip
    args = ap.parse_args(argv)
    setting = Setting(args.shape, args.seq_len, args.pp, args.microbatches, gpu=args.gpu,
                      memory_tracker=not args.no_memory_tracker)  # fmt: skip
    ranks = [0, args.pp - 1] if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    todo = cases(args.schedules.split(","), [int(k) for k in args.seq_chunks.split(",")], ranks)
    if args.quick:
        setting = replace(setting, memory_tracker=False)
        todo = [Case(SCHEDULES[0], 8, 0)]
    results = []
    for case in todo:
        start = time.perf_counter()
        r = measure(case, setting)
        results.append(r)
        print(f"{case.schedule} K={case.k} rank {case.rank} ({time.perf_counter() - start:.0f} "
              f"s): device {_ms(r.device_s)} ms/unit, host {_ms(r.estimate_s)} "
              f"({r.estimate_s / r.device_s:.1%})", flush=True)  # fmt: skip
    print()
    print(report(results, setting))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
