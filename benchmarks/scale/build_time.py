"""Schedule build time at scale: ScheduleSeq1F1B vs torch's own lowering of the same order.

Why: every rank builds its schedule at start-up, and torch's lowering (every rank lowers every
rank's order, superlinearly) takes minutes at pp=64. ScheduleSeq1F1B lowers only its own rank,
in time linear in the number of actions (:mod:`seq1f1b._runtime.lowering`), with the same result.
Both run on stand-in stages (no process group); the time includes the lowered schedule with
send/recv that the runtime executes (``pipeline_order_with_comms``).

Run: ``python -m benchmarks.scale.build_time`` (a few minutes: torch runs until its timeout), or
``--quick`` for the pp=64, 1024-unit rows only. Seq1F1B: best of 3 per rank, max over rank 0
and rank pp-1. torch: ``_prepare_schedule_with_comms`` of the same compute order (what
``_PipelineScheduleRuntime`` runs on each rank) in a fresh subprocess, stopped after
``--torch-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from seq1f1b import ScheduleSeq1F1B
from seq1f1b._runtime import reference as torch_ref
from seq1f1b._runtime import stand_in_stages
from seq1f1b.orders.order import OrderSpec, build_orders

# (pp, stages per rank, M, K): units M*K = 16*pp, then a units curve at pp=32
SCALE = [(pp, v, pp, 16) for v in (1, 2) for pp in (8, 16, 32, 64)]
CURVE = [(32, v, m, 16) for v in (1, 2) for m in (8, 16, 32, 64, 128)]
PP64 = [(64, v, 64, 16) for v in (1, 2)]


class _Timeout(Exception):
    pass


def seq1f1b_seconds(pp: int, v: int, m: int, k: int, repeats: int = 3) -> float:
    """Max over rank 0 and rank pp-1 of the best-of-``repeats`` build time."""
    worst = 0.0
    for rank in sorted({0, pp - 1}):
        best = float("inf")
        for _ in range(repeats):
            stages = stand_in_stages(pp, v, rank=rank)
            start = time.perf_counter()
            sched = ScheduleSeq1F1B(stages, m, k)
            best = min(best, time.perf_counter() - start)
            assert sched.pipeline_order_with_comms[rank]
            del sched
        worst = max(worst, best)
    return worst


def torch_seconds(pp: int, v: int, m: int, k: int, timeout: float) -> float | None:
    """torch's lowering on rank 0 in a subprocess (fresh heap); None if over ``timeout``."""
    cmd = [sys.executable, "-m", "benchmarks.scale.build_time", "--torch-child", str(pp), str(v)]
    cmd += [str(m), str(k)]
    cmd += ["--torch-timeout", str(timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["seconds"]


def _torch_child(pp: int, v: int, m: int, k: int, timeout: float) -> None:
    def _alarm(*_: object) -> None:
        raise _Timeout

    signal.signal(signal.SIGALRM, _alarm)
    stages = stand_in_stages(pp, v)
    order = build_orders(OrderSpec(pp, v, m, k))
    signal.setitimer(signal.ITIMER_REAL, timeout)
    start = time.perf_counter()
    try:
        torch_ref.lowering(stages, order, m * k)
        seconds: float | None = time.perf_counter() - start
    except _Timeout:
        seconds = None
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(json.dumps({"seconds": seconds}))


def _fmt(seconds: float | None, timeout: float) -> str:
    return f"skipped (>{timeout:g} s)" if seconds is None else f"{seconds:.2f}"


def _ratio(theirs: float | None, ours: float) -> str:
    return "" if theirs is None else f"{theirs / ours:.0f}x"


def _table(
    title: str,
    rows: list[tuple[int, int, int, int]],
    measure: Callable[[int, int, int, int], tuple[float, float | None]],
    timeout: float,
) -> None:
    print(f"\n{title}\n")
    print(
        "| pp | stages/rank | M | K | units M·K | Seq1F1B build (s) | µs per action (all ranks) "
        "| torch's lowering, same order (s) | torch / ours |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for pp, v, m, k in rows:
        ours, theirs = measure(pp, v, m, k)
        actions = pp * 2 * v * m * k  # one F and one B per unit and stage
        print(
            f"| {pp} | {v} | {m} | {k} | {m * k} | {ours:.2f} | {ours / actions * 1e6:.1f} "
            f"| {_fmt(theirs, timeout)} | {_ratio(theirs, ours)} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-timeout", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="only pp=64 with 1024 units")
    parser.add_argument("--torch-child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_child:
        _torch_child(*args.torch_child, timeout=args.torch_timeout)
        return
    timeout = args.torch_timeout
    done: dict[tuple[int, int, int, int], tuple[float, float | None]] = {}

    def measure(pp: int, v: int, m: int, k: int) -> tuple[float, float | None]:
        if (pp, v, m, k) not in done:
            ours = seq1f1b_seconds(pp, v, m, k)
            # torch grows faster than linearly: a size above one that timed out is skipped
            over = any(
                (p, w) == (pp, v) and mm * kk <= m * k and theirs is None
                for (p, w, mm, kk), (_, theirs) in done.items()
            )
            theirs = None if over else torch_seconds(pp, v, m, k, timeout)
            done[(pp, v, m, k)] = (ours, theirs)
        return done[(pp, v, m, k)]

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, torch timeout {timeout:g} s")
    if args.quick:
        _table("Build time at pp = 64, 1024 units", PP64, measure, timeout)
        return
    _table("Build time vs pp (units = 16·pp, K = 16)", SCALE, measure, timeout)
    _table("Build time vs units at pp = 32 (K = 16)", CURVE, measure, timeout)


if __name__ == "__main__":
    main()
