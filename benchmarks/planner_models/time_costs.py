"""Calibrate the planner's time model on measured actions; predicted vs measured step times.

    python -m benchmarks.planner_models.time_costs [--quick|--smoke] --out DIR

Why: the planner ranks schedules by simulated step time, so its per-action costs decide the
ranking. This measures every schedule of the pp=2 comparison on real gloo ranks (the same
harness as ``python -m benchmarks``), takes each action's measured CPU time from the traces
(F, B, I, W of segments of every length the splits produce, on every stage), fits the cost
model's constants (:func:`seq1f1b.planning.calibration.fit_action_costs`: seconds per linear FLOP,
per attention FLOP, per element and per action, for each kind of action), and then prices
every measured setting with the planner's own code (:func:`seq1f1b.planning.planner.price`: the
schedule's order simulated with the fitted costs) and prints its predicted step time vs
1F1B next to the measured one (wall-clock median and replayed).

Measured: ``replayed`` replays each rank's actions in the order they ran with each action's
fastest CPU time over the timed steps (what the ranks would take with their cores to
themselves); ``wall`` is the wall-clock median, which other jobs on a shared machine inflate.

Two predictions: ``fit on all`` uses constants fitted to every run's actions; ``held out``
refits without the run being predicted (its actions never seen), the honest check that the
constants transfer to a schedule they were not fitted on. ``python -m benchmarks`` runs the
same on its own pp=2 measurements.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from seq1f1b.planning.calibration import KINDS, Sample, fit_action_costs, save_action_costs
from seq1f1b.planning.costmodel import ActionCosts, Hardware, action_work
from seq1f1b.planning.fitting import (
    action_observations,
    cpu_profile,
    held_out_errors,
    largest_error,
    relative_errors,
)
from seq1f1b.planning.planner import Setting as PlanSetting
from seq1f1b.planning.planner import price
from seq1f1b.planning.profiles import GpuProfile, machine_spec
from seq1f1b.registry import REGISTRY, is_baseline, lookup
from seq1f1b.schedules.partition import resolve_split
from seq1f1b.testing import TinyConfig

from ..harness.cpu_replay import replay_step_time
from ..harness.measured import RunSpec, Setting, measure, model_shape
from ..harness.presets import PP2_SPECS, PRESETS

__all__ = [
    "CALIBRATION_SPECS",
    "calibrate",
    "largest_ratio_errors",
    "profile_summary",
    "ratio_table",
    "samples_of_run",
]

#: the pp=2 comparison plus the schedules it leaves out (every registry schedule the
#: benchmark model can run at pp=2 with 1, 2 or 4 stages per rank), each once
_EXTRA = (RunSpec("ZBSeq1F1B", 4, "compute"), RunSpec("InterleavedSeq1F1B", 2, "compute"))
CALIBRATION_SPECS = tuple(
    {s.label: s for s in (*PP2_SPECS, *_EXTRA) if s.schedule in {e.name for e in REGISTRY}}.values()
)


def _lengths(run: dict[str, Any], cfg: TinyConfig) -> list[int]:
    entry = lookup(run["schedule"])
    k = run["seq_chunks"] if entry.seq_chunked else 1
    split = run["split"] if entry.seq_chunked else "uniform"
    return resolve_split(split, run["seq_len"], k, shape=model_shape(cfg))


def fastest_trace(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The last timed step's actions (all ranks, in the order they ran), each with its
    smallest CPU time over the timed steps: other jobs on the machine only ever add time
    (cache and memory-bandwidth contention inflate even CPU time), so the minimum is the
    action's own cost."""
    steps = run.get("step_traces") or [run["trace"]]
    best: dict[tuple[int, int, str, int], float] = {}
    for step in steps:
        for ev in step:
            key = (ev.get("rank", 0), ev["stage"], ev["kind"], ev["mb"])
            best[key] = min(best.get(key, ev["cpu"]), ev["cpu"])
    return [
        dict(ev, cpu=best[(ev.get("rank", 0), ev["stage"], ev["kind"], ev["mb"])])
        for ev in steps[-1]
    ]


def replay_fastest(run: dict[str, Any]) -> float:
    """The step time the ranks would have had with each action at its fastest (replayed)."""
    trace = fastest_trace(run)
    ranks = sorted({ev.get("rank", 0) for ev in trace})
    per_rank = [[ev for ev in trace if ev.get("rank", 0) == r] for r in ranks]
    return replay_step_time(per_rank, lookup(run["schedule"]).replicas)


def samples_of_run(run: dict[str, Any], cfg: TinyConfig) -> list[Sample]:
    """Every action of a measured run as (kind, work, fastest CPU seconds over the steps)."""
    entry = lookup(run["schedule"])
    shape = model_shape(cfg)
    n = entry.model_stages(run["pp"])
    layers = cfg.n_layers // n
    lengths = _lengths(run, cfg)
    k = len(lengths)
    ends = [sum(lengths[: i + 1]) for i in range(k)]
    out = []
    for ev in fastest_trace(run):
        if ev["cpu"] <= 0:
            continue
        seg = ev["mb"] % k
        last = ev["stage"] % n == n - 1
        work = action_work(shape, layers, last, lengths[seg], ends[seg])
        out.append(Sample(ev["kind"], work, ev["cpu"], f"{run['label']} @{run['seq_len']}"))
    return out


def _predicted_seconds(
    run: dict[str, Any], cfg: TinyConfig, costs: ActionCosts, hw: Hardware | None = None
) -> float:
    """The planner's step time of ``run`` priced with ``costs`` on ``hw`` (default: links
    that cost nothing worth noting)."""
    entry = lookup(run["schedule"])
    k = run["seq_chunks"] if entry.seq_chunked else 1
    setting = PlanSetting(
        pp=run["pp"],
        tp=1,
        fsdp=1,
        seq_chunks=k,
        microbatches=run["microbatches"],
        split=run["split"] or "uniform",
        recompute=False,
        bf16=True,
        name=entry.name,
        stages_per_rank=entry.stages_per_rank,
    )
    hw = hw or Hardware(run["pp"], 1e6, reserve_gb=0.0)
    return price(setting, model_shape(cfg), run["seq_len"], hw, actions=costs).step_seconds


def _profile_seconds(run: dict[str, Any], cfg: TinyConfig, prof: GpuProfile) -> float:
    """``run``'s step time as the planner prices it with a CPU profile (``--gpu cpu``)."""
    return _predicted_seconds(run, cfg, prof.action_costs(), prof.hardware(run["pp"]))


def calibrate(runs: Sequence[dict[str, Any]], cfg: TinyConfig) -> dict[str, Any]:
    """Fit on the runs' traces; each run's step time predicted by the per-kind constants and
    by the CPU profile (each fitted on every run, and refitted without the run: held out),
    and measured, and each one's ratio to the 1F1B run of the same length."""
    timed = [r for r in runs if (r.get("step_traces") or r.get("trace")) and r.get("step_time_s")]
    per_run = {(r["label"], r["seq_len"]): samples_of_run(r, cfg) for r in timed}
    everything = [s for ss in per_run.values() for s in ss]
    costs = fit_action_costs(everything, source="fit on every measured action")
    prof = cpu_profile(everything, machine_spec(1.0), held_out=False)
    bases = {r["seq_len"]: r for r in timed if is_baseline(r["schedule"])}
    rows = []
    for r in timed:
        base = bases.get(r["seq_len"])
        if base is None:
            continue
        others = [s for key, ss in per_run.items() if key != (r["label"], r["seq_len"]) for s in ss]
        held = fit_action_costs(others, source=f"without {r['label']}")
        held_prof = cpu_profile(others, machine_spec(1.0), held_out=False)
        pred_s = _predicted_seconds(r, cfg, costs)
        pred_all = pred_s / _predicted_seconds(base, cfg, costs)
        pred_held = _predicted_seconds(r, cfg, held) / _predicted_seconds(base, cfg, held)
        prof_s = _profile_seconds(r, cfg, prof)
        prof_all = prof_s / _profile_seconds(base, cfg, prof)
        prof_held = _profile_seconds(r, cfg, held_prof) / _profile_seconds(base, cfg, held_prof)
        wall = r["step_time_s"] / base["step_time_s"]
        replay_s = replay_fastest(r)
        replay = replay_s / replay_fastest(base)
        rows.append(
            {
                "label": r["label"],
                "seq_len": r["seq_len"],
                "predicted_s": pred_s,
                "profile_s": prof_s,
                "replayed_s": replay_s,
                "wall_s": r["step_time_s"],
                "predicted_vs_1f1b": pred_all,
                "predicted_held_out_vs_1f1b": pred_held,
                "profile_vs_1f1b": prof_all,
                "profile_held_out_vs_1f1b": prof_held,
                "measured_wall_vs_1f1b": wall,
                "measured_replayed_vs_1f1b": replay,
                "action_wall_over_cpu": r.get("action_wall_over_cpu"),
                "error_vs_wall": pred_all / wall - 1,
                "error_held_out_vs_wall": pred_held / wall - 1,
                "error_vs_replayed": pred_all / replay - 1,
                "error_held_out_vs_replayed": pred_held / replay - 1,
                "error_profile_vs_replayed": prof_all / replay - 1,
                "error_profile_held_out_vs_replayed": prof_held / replay - 1,
            }
        )
    residual = [
        costs.of(_kind(s.kind)).seconds(s.work) / s.seconds - 1 for s in everything if s.seconds
    ]
    e = prof.efficiency
    return {
        "constants": asdict(costs),
        "profile": {"linear": e.linear, "attention": e.attention, "overhead_s": e.overhead_s},
        "actions": len(everything),
        "action_error_median_abs": sorted(abs(e) for e in residual)[len(residual) // 2],
        "rows": rows,
    }


def _kind(name: str) -> Any:
    from seq1f1b._runtime import ComputationType

    return ComputationType(name)


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`calibrate`'s rows."""
    lines = [
        "| setting | predicted vs 1F1B | held out | replayed | wall | error vs replayed "
        "(all / held out) | error vs wall | wall/CPU | step s: predicted / replayed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        rep = r["measured_replayed_vs_1f1b"]
        err = (
            ""
            if rep is None
            else f"{r['error_vs_replayed']:+.1%} / {r['error_held_out_vs_replayed']:+.1%}"
        )
        ratio = r.get("action_wall_over_cpu")
        lines.append(
            f"| {r['label']} @{r['seq_len']} | {r['predicted_vs_1f1b']:.3f} | "
            f"{r['predicted_held_out_vs_1f1b']:.3f} | {'' if rep is None else f'{rep:.3f}'} | "
            f"{r['measured_wall_vs_1f1b']:.3f} | {err} | {r['error_vs_wall']:+.1%} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | "
            f"{r['predicted_s']:.3f} / {r['replayed_s']:.3f} "
            f"({r['predicted_s'] / r['replayed_s'] - 1:+.1%}) |"
        )
    return "\n".join(lines)


def ratio_table(result: dict[str, Any]) -> str:
    """Each schedule's step time and ratio to 1F1B, measured (replayed) and predicted by the
    CPU profile and by the per-kind constants, with the ratios' errors (fitted on every run /
    held out), then the largest of each."""
    lines = [
        "| setting | step s: replayed / profile / per-kind | vs 1F1B: replayed | profile | "
        "error (all / held out) | per-kind | error (all / held out) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['label']} @{r['seq_len']} | {r['replayed_s']:.3f} / {r['profile_s']:.3f} / "
            f"{r['predicted_s']:.3f} | {r['measured_replayed_vs_1f1b']:.3f} | "
            f"{r['profile_vs_1f1b']:.3f} | {r['error_profile_vs_replayed']:+.1%} / "
            f"{r['error_profile_held_out_vs_replayed']:+.1%} | {r['predicted_vs_1f1b']:.3f} | "
            f"{r['error_vs_replayed']:+.1%} / {r['error_held_out_vs_replayed']:+.1%} |"
        )
    worst = largest_ratio_errors(result)
    lines.append(
        "largest |error| of a ratio to 1F1B vs replayed (all / held out): profile "
        f"{worst['profile']:.1%} / {worst['profile_held_out']:.1%}, per-kind constants "
        f"{worst['per_kind']:.1%} / {worst['per_kind_held_out']:.1%}"
    )
    return "\n".join(lines)


def largest_ratio_errors(result: dict[str, Any]) -> dict[str, float]:
    """The largest |error| of a predicted ratio to 1F1B vs the replayed one, per model."""
    keys = {
        "profile": "error_profile_vs_replayed",
        "profile_held_out": "error_profile_held_out_vs_replayed",
        "per_kind": "error_vs_replayed",
        "per_kind_held_out": "error_held_out_vs_replayed",
    }
    return {k: max((abs(r[v]) for r in result["rows"]), default=0.0) for k, v in keys.items()}


def profile_summary(samples: Sequence[Sample], source: str) -> str:
    """The CPU profile fitted on ``samples`` (:func:`seq1f1b.planning.fitting.cpu_profile`)
    and the per-kind constants (:func:`seq1f1b.planning.calibration.fit_action_costs`): each
    one's median error per action and largest held-out run's error."""
    prof = cpu_profile(samples, machine_spec(1.0, source=source))
    e = prof.efficiency
    costs = fit_action_costs(samples)
    per_action = [costs.of(KINDS[s.kind]).seconds(s.work) / s.seconds - 1 for s in samples]
    _, held = largest_error(held_out_errors(prof, samples, per_action=True))
    return (
        f"CPU profile (efficiencies of a nominal {prof.peak_tflops:g} TFLOP/s): linear "
        f"{e.linear:.3g}, attention {e.attention:.3g}, {e.overhead_s * 1e3:.3g} ms per action; "
        f"median |error| per action "
        f"{_median_abs(relative_errors(prof, action_observations(samples))):.1%}; "
        f"{e.error_source}\nper-kind constants (--calibration-model per-action): median |error| "
        f"per action {_median_abs(per_action):.1%}; {held}"
    )


def _median_abs(errors: Sequence[float]) -> float:
    return sorted(abs(e) for e in errors)[len(errors) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_models.time_costs", description=__doc__
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, help="tokens per sample (default: the preset's)")
    ap.add_argument("--steps", type=int, help="timed steps per schedule (default: the preset's)")
    ap.add_argument(
        "--reuse",
        help="a directory this command wrote before: refit on its traces, measure nothing",
    )
    a = ap.parse_args(argv)
    preset = PRESETS["smoke" if a.smoke else "quick" if a.quick else "full"]
    os.makedirs(a.out, exist_ok=True)
    seq_len = a.seq_len or preset.seq_lens[0]
    if a.reuse:
        with open(os.path.join(a.reuse, "calibration_results.json")) as f:
            runs = json.load(f)["runs"]
        with open(os.path.join(a.reuse, "traces.json")) as f:
            traces = json.load(f)
        for r in runs:
            r["step_traces"] = traces[r["label"]]
            r["trace"] = r["step_traces"][-1]
        seq_len = runs[0]["seq_len"]
    else:
        specs = tuple(
            s
            for s in CALIBRATION_SPECS
            if preset.model.n_layers % s.model_stages(2) == 0 and not s.memory_only
        )
        steps = a.steps or max(preset.timed_steps, 1)
        setting = Setting(2, 2, seq_len, preset.model, specs, steps)
        runs = measure(setting)
    result = calibrate(runs, preset.model)
    result["setting"] = f"pp=2, M=2, {seq_len} tokens, model {asdict(preset.model)}"
    samples = [s for r in runs for s in samples_of_run(r, preset.model)]
    source = f"benchmarks.planner_models.time_costs {preset.name} @{seq_len}"
    save_action_costs(
        fit_action_costs(samples, source, precision="fp32"),  # the CPU ranks run fp32
        os.path.join(a.out, "calibration.json"),
        samples,
    )
    with open(os.path.join(a.out, "traces.json"), "w") as f:
        json.dump({r["label"]: r.pop("step_traces") for r in runs}, f)
    for r in runs:
        r.pop("trace", None)
    with open(os.path.join(a.out, "calibration_results.json"), "w") as f:
        json.dump({**result, "runs": runs}, f, indent=1)
    print(
        f"{result['setting']}; {result['actions']} actions, median |error| per action "
        f"{result['action_error_median_abs']:.1%}"
    )
    print(table(result))
    print(ratio_table(result))
    print(profile_summary(samples, source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
