"""``python -m benchmarks [--quick] --out DIR``: Seq1F1B against torch's schedules.

Writes ``DIR/results.json`` (every number), ``DIR/results.md`` (the tables), timeline PNGs
(``DIR/timelines/``, ``DIR/*.png``) and Chrome/Perfetto traces of the measured runs
(``DIR/traces/``). See docs/benchmarks.md for what each part measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from .harness.presets import PRESETS
from .output.report import markdown_report
from .run import run_all


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller model, under 5 minutes")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="activation budget per stage (default: Schedule1F1B's peak at the first length)",
    )
    ap.add_argument(
        "--only",
        choices=["pp2"],
        default=None,
        help="pp2: only the timed pp=2 comparison at the first length, the memory budget, the "
        "simulations and the headline ratios",
    )
    ap.add_argument(
        "--runs",
        default=None,
        help="comma-separated labels of the pp=2 runs to keep (1F1B always), e.g. "
        "'ZBSeq1F1B K=8 uniform,ZBVSeq1F1B K=4 compute'",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: the mode's)")
    a = ap.parse_args(argv)
    preset = PRESETS["smoke" if a.smoke else "quick" if a.quick else "full"]
    if a.runs:
        preset = preset.only([x.strip() for x in a.runs.split(",") if x.strip()])
    if a.steps:
        preset = replace(preset, timed_steps=a.steps)
    command = "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)
    budget = a.budget_mib * 1024 * 1024 if a.budget_mib else None
    results = run_all(preset, a.out, command, budget, pp2_only=a.only == "pp2")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    report = markdown_report(results)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
