"""Measured vs simulated step time of Seq1F1B on the quick model, optionally A/B against
another checkout of the library, alternating in one session.

Why: the simulator's FLOPs model leaves out per-unit overhead (Python around each action,
accumulators, merges, kernel efficiency of short segments). The gap between a measured and a
simulated step-time ratio (vs Schedule1F1B) is that overhead; comparing two versions of the
library on a shared machine is only honest when their runs alternate in the same session.

``python -m benchmarks.step_time.gap [--chunks 4 8] [--steps 3] [--seq-len 4096]`` measures the
current tree (pp=2, M=2, the quick preset's model, same harness as ``python -m benchmarks``);
``--compare OLD_TREE --rounds 3`` runs OLD_TREE's ``seq1f1b`` and this tree's alternately (each
run a fresh process: a temporary directory links ``seq1f1b`` of the tree under test next to
this ``benchmarks`` package) and prints a markdown table of the medians, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "measure_gap"]

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_gap(chunks: Sequence[int], steps: int, seq_len: int) -> dict[str, Any]:
    """One measured run of 1F1B and Seq1F1B K=chunks (compute split) with simulated ratios."""
    import seq1f1b

    from ..harness.measured import RunSpec, Setting, measure
    from ..harness.presets import PRESETS
    from ..run import _simulated

    preset = PRESETS["quick"]
    specs = (RunSpec("1F1B"), *(RunSpec("Seq1F1B", k, "compute") for k in chunks))
    load_before = os.getloadavg()[0]
    runs = measure(Setting(2, 2, seq_len, preset.model, specs, steps, keep_trace=False))
    load_after = os.getloadavg()[0]
    _simulated(runs, preset)
    base, base_replay = runs[0]["step_time_s"], runs[0]["replay_step_time_s"]
    rows = {}
    for r in runs:
        rows[r["label"]] = {
            "step_time_s": r["step_time_s"],
            "replay_step_time_s": r["replay_step_time_s"],
            "wall_vs_1f1b": r["step_time_s"] / base,
            "replay_vs_1f1b": r["replay_step_time_s"] / base_replay,
            "simulated_vs_1f1b": r["simulated_time_vs_1f1b"],
            "wall_over_cpu": r["action_wall_over_cpu"],
        }
    return {
        "library": os.path.dirname(os.path.realpath(seq1f1b.__file__)),
        "load": [load_before, load_after],
        "runs": rows,
    }


def _run_tree(tree: str, argv: list[str]) -> dict[str, Any]:
    """``measure_gap`` in a fresh interpreter that imports ``seq1f1b`` from ``tree``."""
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(os.path.join(os.path.abspath(tree), "seq1f1b"), os.path.join(tmp, "seq1f1b"))
        os.symlink(os.path.join(HERE, "benchmarks"), os.path.join(tmp, "benchmarks"))
        env = dict(os.environ, PYTHONPATH=tmp, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "benchmarks.step_time.gap", "--json", *argv]
        out = subprocess.run(cmd, cwd=tmp, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Medians over rounds, per tree and schedule."""
    lines = [
        "| tree | schedule | wall vs 1F1B | replayed vs 1F1B | simulated | wall gap | replay gap "
        "| step (s) | wall/CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rounds in results.items():
        for label in rounds[0]["runs"]:
            rs = [r["runs"][label] for r in rounds]
            med = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
            lines.append(
                f"| {name} | {label} | {med['wall_vs_1f1b']:.3f} | {med['replay_vs_1f1b']:.3f} "
                f"| {med['simulated_vs_1f1b']:.3f} "
                f"| {med['wall_vs_1f1b'] - med['simulated_vs_1f1b']:+.3f} "
                f"| {med['replay_vs_1f1b'] - med['simulated_vs_1f1b']:+.3f} "
                f"| {med['step_time_s']:.3f} | {med['wall_over_cpu']:.2f} |"
            )
    loads = [x for rounds in results.values() for r in rounds for x in r["load"]]
    lines.append(
        f"\nload average (1 min) over the runs: {min(loads):.2f}-{max(loads):.2f}; "
        f"medians of {len(next(iter(results.values())))} alternating rounds"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_time.gap", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule and run")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--compare", metavar="OLD_TREE", help="another checkout to alternate with")
    ap.add_argument("--rounds", type=int, default=3, help="with --compare: runs per tree")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    a = ap.parse_args(argv)
    sub = ["--chunks", *map(str, a.chunks), "--steps", str(a.steps), "--seq-len", str(a.seq_len)]
    if a.compare:
        results: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for i in range(a.rounds):
            order = [("old", a.compare), ("new", HERE)]
            for name, tree in order if i % 2 == 0 else reversed(order):
                results[name].append(_run_tree(tree, sub))
                print(f"[gap] round {i} {name}: load {results[name][-1]['load']}", flush=True)
    else:
        results = {"this": [measure_gap(a.chunks, a.steps, a.seq_len)]}
    if a.json:
        print(json.dumps(results["this"][0]))
        return 0
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
