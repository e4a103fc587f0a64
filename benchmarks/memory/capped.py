"""``python -m benchmarks.memory.capped [--quick|--smoke] --out DIR``: memory against speed
per split.

Why: the uniform split fits the longest sequence and the compute-balanced split runs fastest;
``split="memory_capped"`` searches for the fastest split under the uniform split's activation
peak (or a multiple of it). This measures all of them in one run, at pp=2, M=2: step time
against Schedule1F1B, and the longest sequence whose per-stage peak of saved activations fits
Schedule1F1B's peak at the benchmark length (fitted like :mod:`benchmarks.memory.budget`, then
measured at the answer and stepped down if over).

It also reports the ceiling no split can pass at pp=2: a sample's last segment runs its forward
on the last stage before any backward of that sample, so the last stage holds one whole sample,
as Schedule1F1B's last stage does; the longest sequence of any Seq1F1B split is at most
Schedule1F1B's budget over its last-stage peak per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from seq1f1b.orders.order import OrderSpec
from seq1f1b.planning.simulate import FlopsCosts, simulate

from ..harness.measured import RunSpec, Setting, measure, model_shape, run_split
from ..harness.presets import PRESETS, Preset
from .budget import budget_rows, verify_rows

__all__ = ["SPECS", "capped_comparison", "markdown_table"]

SPECS = (
    RunSpec("1F1B"),
    RunSpec("Seq1F1B", 4, "uniform"),
    RunSpec("Seq1F1B", 4, "compute"),
    RunSpec("Seq1F1B", 4, "memory_capped"),
    RunSpec("Seq1F1B", 4, "memory_capped", memory_cap=1.15),
    RunSpec("Seq1F1B", 8, "uniform"),
    RunSpec("Seq1F1B", 8, "compute"),
    RunSpec("Seq1F1B", 8, "memory_capped"),
    RunSpec("Seq1F1B", 8, "memory_capped", memory_cap=1.15),
)
PP, M, GRANULE = 2, 2, 64


def _log(msg: str) -> None:
    print(f"[benchmarks.memory.capped] {msg}", flush=True)


def _lengths(spec: RunSpec, preset: Preset, seq_len: int) -> list[int]:
    if not spec.entry.seq_chunked:
        return [seq_len]
    order = OrderSpec(PP, 1, M, spec.seq_chunks)
    return run_split(spec, preset.model, seq_len).lengths(seq_len, spec.seq_chunks, 1, order)


def _simulated_time(spec: RunSpec, preset: Preset, lengths: list[int]) -> float:
    """Makespan of the schedule's real order with FLOPs costs (what the search minimises)."""
    orders = spec.entry.compute_orders(PP, M, spec.seq_chunks if spec.entry.seq_chunked else 1)
    costs = FlopsCosts(model_shape(preset.model), tuple(lengths), PP, PP)
    return simulate(orders, costs.cost, activation=costs.activation).makespan


def capped_comparison(
    preset: Preset, verify: bool = True, steps: int | None = None
) -> dict[str, Any]:
    """Measure every split of :data:`SPECS` at ``preset.seq_lens[0]`` tokens; rows vs 1F1B
    (median of ``steps`` timed steps, the preset's count by default)."""
    seq = preset.seq_lens[0]
    steps = preset.timed_steps if steps is None else steps
    load_before = f"{os.getloadavg()[0]:.1f}"
    fit_specs = [
        replace(s, seq_len=int(seq * f), memory_only=True)
        for s in SPECS
        for f in preset.fit_fractions
    ]
    _log(f"measuring pp={PP}, M={M}, {seq} tokens and the fit points (load {load_before})")
    runs = measure(Setting(PP, M, seq, preset.model, (*SPECS, *fit_specs), steps))
    main = {r["label"]: r for r in runs if "@" not in r["label"]}
    base = main["1F1B"]
    budget = float(max(base["peak_activation_bytes"]))
    fits = {
        s.label: [*(r for r in runs if r["label"].startswith(s.label + " @")), main[s.label]]
        for s in SPECS
    }
    rows = budget_rows(fits, budget, GRANULE)
    by_label = {s.label: s for s in SPECS}

    def measure_peaks(lengths: dict[str, int]) -> dict[str, float]:
        specs = tuple(
            replace(by_label[label], seq_len=n, memory_only=True) for label, n in lengths.items()
        )
        out = measure(Setting(PP, M, seq, preset.model, specs, 0, keep_trace=False))
        return {
            label: float(max(r["peak_activation_bytes"]))
            for label, r in zip(lengths, out, strict=True)
        }

    if verify:
        _log("measuring each answer at its length")
        verify_rows(rows, measure_peaks, budget, GRANULE)
    load = f"{load_before} before, {os.getloadavg()[0]:.1f} after"
    longest = {row["label"]: row["longest_seq_len"] for row in rows}
    base_sim = _simulated_time(SPECS[0], preset, [seq])
    table = []
    for spec in SPECS:
        r = main[spec.label]
        lengths = _lengths(spec, preset, seq)
        table.append(
            {
                "label": spec.label,
                "lengths": lengths,
                "step_time_s": r["step_time_s"],
                "time_vs_1f1b": r["step_time_s"] / base["step_time_s"],
                "replayed_vs_1f1b": r["replay_step_time_s"] / base["replay_step_time_s"],
                "simulated_vs_1f1b": _simulated_time(spec, preset, lengths) / base_sim,
                "wall_over_cpu": r["action_wall_over_cpu"],
                "peak_vs_budget": [b / budget for b in r["peak_activation_bytes"]],
                "longest_seq_len": longest[spec.label],
                "longest_vs_1f1b": longest[spec.label] / longest["1F1B"],
            }
        )
    # the last stage holds one whole sample under any split, as 1F1B's does
    ceiling = budget / base["peak_activation_bytes"][-1]
    return {
        "setting": f"pp={PP}, M={M}, {seq} tokens, median of {steps} steps, model {preset.model}",
        "budget_bytes": budget,
        "last_stage_ceiling": ceiling,
        "load_average": load,
        "rows": table,
        "budget_rows": rows,
    }


def markdown_table(res: dict[str, Any]) -> str:
    """The comparison as a markdown table, ratios against Schedule1F1B."""
    lines = [
        f"Splits, measured: {res['setting']} (load average {res['load_average']}). Budget: "
        f"Schedule1F1B's largest per-stage peak of saved activations, "
        f"{res['budget_bytes'] / 2**20:.0f} MiB. Ceiling for any split at pp=2 (the last stage "
        f"holds one sample): {res['last_stage_ceiling']:.2f}x.",
        "",
        "| split | lengths | step | replayed | simulated | wall/CPU | stage peaks / budget "
        "| longest sequence | vs 1F1B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in res["rows"]:
        peaks = " / ".join(f"{p:.2f}" for p in t["peak_vs_budget"])
        lines.append(
            f"| {t['label']} | {t['lengths']} | {t['time_vs_1f1b']:.3f} "
            f"({t['step_time_s']:.2f} s) | {t['replayed_vs_1f1b']:.3f} | "
            f"{t['simulated_vs_1f1b']:.3f} | {t['wall_over_cpu']:.2f} | {peaks} | "
            f"{t['longest_seq_len']} | {t['longest_vs_1f1b']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory.capped", description=__doc__)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the quick model (default)")
    mode.add_argument("--full", action="store_true", help="REFERENCE's model (slow)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (median reported)")
    a = ap.parse_args(argv)
    preset = PRESETS["smoke" if a.smoke else "full" if a.full else "quick"]
    os.makedirs(a.out, exist_ok=True)
    res = capped_comparison(preset, verify=not a.smoke, steps=a.steps)
    res["command"] = "python -m benchmarks.memory.capped " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    with open(os.path.join(a.out, "capped.json"), "w") as f:
        json.dump(res, f, indent=1)
    report = markdown_table(res)
    with open(os.path.join(a.out, "capped.md"), "w") as f:
        f.write(report + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
