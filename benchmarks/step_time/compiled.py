"""Compiled vs eager step time, side by side with torch's 1F1B in one run (CPU, gloo, pp=2).

Every block is ``torch.compile``'d (``fullgraph=True``, as torchtitan compiles) for the
compiled rows; the eager rows are the same schedules uncompiled. Ratios: each schedule's
median step time to compiled (or eager) Schedule1F1B's, and compiled to eager per schedule.
The first (memory) step of each run compiles; the timed steps that follow interleave the
schedules, so machine noise falls on all alike.

    python -m benchmarks.step_time.compiled [--preset quick|full] [--steps 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..harness.measured import RunSpec, Setting, measure
from ..harness.presets import PRESETS

SPECS = (
    RunSpec("1F1B"),
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("ZBVSeq1F1B", 4, "compute"),
)


def paired_rows(
    specs: Sequence[RunSpec], seq_len: int, model: Any, steps: int, **setting: Any
) -> list[tuple[RunSpec, dict[str, Any], dict[str, Any]]]:
    """Each of ``specs`` eager and compiled, measured in one run at pp=2, M=2 (the timed steps
    of all of them interleaved): ``(spec, eager row, compiled row)``; ``setting``: more of
    :class:`~benchmarks.harness.measured.Setting`'s fields (``cp``, ``warmup_steps``)."""
    both = tuple(replace(s, compiled=c) for c in (False, True) for s in specs)
    rows = {r["label"]: r for r in measure(Setting(2, 2, seq_len, model, both,
                                                   timed_steps=steps, keep_trace=False,
                                                   **setting))}  # fmt: skip
    return [(s, rows[s.label], rows[replace(s, compiled=True).label]) for s in specs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="quick")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule")
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args(argv)
    pairs = paired_rows(SPECS, args.seq_len, PRESETS[args.preset].model, args.steps)
    print(f"preset {args.preset}: pp=2, M=2, {args.seq_len} tokens, {args.steps} timed steps")
    print("| schedule | eager s | compiled s | compiled / eager | vs 1F1B eager | "
          "vs 1F1B compiled |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    base = {False: pairs[0][1]["step_time_s"], True: pairs[0][2]["step_time_s"]}  # 1F1B
    for spec, eager_row, comp_row in pairs:
        eager, comp = eager_row["step_time_s"], comp_row["step_time_s"]
        print(f"| {spec.label} | {eager:.3f} | {comp:.3f} | {comp / eager:.3f} | "
              f"{eager / base[False]:.3f} | {comp / base[True]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
