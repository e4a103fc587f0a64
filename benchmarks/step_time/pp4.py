"""pp=4 timed: the full model on 4 ranks, M=4, Seq1F1B-family schedules against 1F1B.

Why: the main run measures pp=4 for memory only (4 ranks outnumber the 2 cores of the CI
machine, so wall time there is shared). The replayed step (each action's CPU time, replayed in
the schedule's order with its dependencies, :mod:`benchmarks.harness.cpu_replay`) does not
depend on how many cores the ranks had, so it is the number to read; wall time is reported
beside it with the wall/CPU of the actions, which says how far the cores were shared.

``python -m benchmarks.step_time.pp4 [--preset full|quick] [--steps N] [--seq-len N]
[--out DIR]``. The limit of a schedule's step vs 1F1B at pp=4, M=4 is 4/7 = 0.571 (no bubble).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from ..harness.measured import RunSpec, Setting, measure
from ..harness.presets import PRESETS

__all__ = ["SPECS", "main", "rows"]

SPECS = (
    RunSpec("1F1B"),  # first: the baseline of every ratio
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("InterleavedSeq1F1B", 4, "compute"),
    RunSpec("ZBVSeq1F1B", 4, "compute"),
)


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: replayed and wall step time, each as a ratio to 1F1B's in the same run."""
    base = runs[0]  # SPECS[0], the baseline
    out = []
    for r in runs:
        out.append(
            {
                "label": r["label"],
                "replay_step_time_s": r["replay_step_time_s"],
                "step_time_s": r["step_time_s"],
                "replayed_vs_1f1b": r["replay_step_time_s"] / base["replay_step_time_s"],
                "wall_vs_1f1b": r["step_time_s"] / base["step_time_s"],
                "wall_over_cpu": r["action_wall_over_cpu"],
                "simulated_vs_1f1b": r.get("simulated_time_vs_1f1b"),
                "loss": r["loss"],
            }
        )
    return out


def markdown(table: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"## {title}",
        "",
        "| schedule | replayed vs 1F1B | wall vs 1F1B | step s (replayed / wall) | wall/CPU "
        "| loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['label']} | {r['replayed_vs_1f1b']:.3f} | {r['wall_vs_1f1b']:.3f} | "
            f"{r['replay_step_time_s']:.2f} / {r['step_time_s']:.2f} | {r['wall_over_cpu']:.2f} "
            f"| {r['loss']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_time.pp4", description=__doc__)
    ap.add_argument("--preset", choices=["full", "quick", "smoke"], default="full")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per schedule")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="directory for pp4.json and pp4.md")
    a = ap.parse_args(argv)
    preset = PRESETS[a.preset]
    setting = Setting(4, 4, a.seq_len, preset.model, SPECS, a.steps, keep_trace=False)
    runs = measure(setting)
    for r in runs:
        r.pop("trace", None)
        r.pop("step_traces", None)
    table = rows(runs)
    title = f"pp=4, M=4, {a.seq_len} tokens, {a.preset} model, {a.steps} timed steps"
    report = markdown(table, title)
    print(report)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "pp4.json"), "w") as f:
            json.dump({"setting": title, "rows": table}, f, indent=1)
        with open(os.path.join(a.out, "pp4.md"), "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
