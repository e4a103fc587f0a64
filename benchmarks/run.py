"""Everything ``python -m benchmarks`` does, in order, into one results dict.

Why: one invocation runs simulation, measured comparisons, the memory-budget search and the
planner example side by side, so every number in the README comes from the same run.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from seq1f1b.planning.costmodel import GB, Hardware
from seq1f1b.planning.planner import search
from seq1f1b.registry import is_baseline, lookup

from .cp.seq1f1b_cp import longest_sequences, measure_cp
from .documents.masked import measure_skipping, simulate_masked_splits
from .harness.measured import RunSpec, Setting, measure, model_shape
from .harness.pipeline_orders import ScheduleSpec
from .harness.presets import Preset
from .headline import headline_rows
from .memory.budget import budget_rows, verify_rows
from .memory.units_in_flight import memory_bound_rows
from .output.trace import write_chrome_trace
from .planner_models.time_costs import calibrate
from .planner_models.vs_published import memory_vs_published
from .step_time.simtables import PAPER_SHAPE, simulate_spec, simulation_table

__all__ = ["run_all"]

PINNING = (
    "one process per rank, each pinned to core rank % 2 with os.sched_setaffinity and running "
    "one thread (torch.set_num_threads(1), OMP_NUM_THREADS=1)"
)
MEMORY_DEF = (
    "peak bytes of tensors saved for backward and alive at once during the step "
    "(saved_tensors_hooks, storages counted once, parameters excluded)"
)


def _log(msg: str) -> None:
    print(f"[benchmarks] {msg}", flush=True)


def _load() -> str:
    """1-minute load average: how busy the machine was (other jobs inflate wall times)."""
    return f"{os.getloadavg()[0]:.1f}"


def _usable(spec: RunSpec, pp: int, preset: Preset) -> bool:
    return preset.model.n_layers % spec.model_stages(pp) == 0


def _simulated(runs: list[dict[str, Any]], preset: Preset) -> None:
    """Add the cost model's bubble and time vs 1F1B at the measured size to each run."""
    shape = model_shape(preset.model)
    spans = {}
    for r in runs:
        k = r["seq_chunks"] if lookup(r["schedule"]).seq_chunked else 1
        spec = ScheduleSpec(r["schedule"], r["pp"], r["microbatches"], k)
        res, _ = simulate_spec(spec, shape, r["seq_len"], r["split"] or "uniform")
        r["simulated_bubble_ratio"] = res.bubble_ratio
        spans[r["label"]] = res.makespan
    base = next((spans[r["label"]] for r in runs if is_baseline(r["schedule"])), None)
    for r in runs:
        r["simulated_time_vs_1f1b"] = spans[r["label"]] / base if base else None


def _measure_pp2(preset: Preset, seq_len: int, with_fits: bool) -> list[dict[str, Any]]:
    specs = [
        s for s in (preset.pp2_specs if with_fits else preset.long_specs) if _usable(s, 2, preset)
    ]
    if with_fits:
        specs += [
            replace(s, seq_len=int(seq_len * f), memory_only=True)
            for s in preset.budget_specs
            for f in preset.fit_fractions
        ]
    return measure(Setting(2, 2, seq_len, preset.model, tuple(specs), preset.timed_steps))


def _budget(
    preset: Preset, runs: list[dict[str, Any]], budget: float | None, baseline: str = "1F1B"
) -> dict[str, Any]:
    """Fit peak(S) per schedule, solve for the budget (``baseline``'s peak unless given),
    verify at the answer."""
    main = {r["label"]: r for r in runs if not r["label"].count("@")}
    fits: dict[str, list[dict[str, Any]]] = {}
    for spec in preset.budget_specs:
        pts = [r for r in runs if r["label"].startswith(spec.label + " @")]
        fits[spec.label] = [*pts, main[spec.label]]
    if budget is None:  # per rank: V placements hold two stages on each
        budget = float(max(main[baseline]["peak_activation_rank_bytes"]))
    rows = budget_rows(fits, budget, granule=64)
    by_label = {s.label: s for s in preset.budget_specs}

    def measure_peaks(lengths: dict[str, int]) -> dict[str, float]:
        specs = tuple(
            replace(by_label[label], seq_len=n, memory_only=True) for label, n in lengths.items()
        )
        check = Setting(2, 2, preset.seq_lens[0], preset.model, specs, 0, keep_trace=False)
        runs = measure(check)
        return {
            label: float(max(r["peak_activation_rank_bytes"]))
            for label, r in zip(lengths, runs, strict=True)
        }

    if preset.verify_budget:
        verify_rows(rows, measure_peaks, budget, granule=64)
    return {
        "budget_bytes": budget,
        "rows": rows,
        "note": (
            f"pp=2, M=2. Budget: the largest per-rank peak of {baseline} at "
            f"{preset.seq_lens[0]} tokens. Peak = max over ranks of saved activations, fitted "
            "linearly over "
            f"{', '.join(str(int(preset.seq_lens[0] * f)) for f in preset.fit_fractions)} and "
            f"{preset.seq_lens[0]} tokens, solved for the budget (multiples of 64 tokens)"
            + (
                ", then measured again at that length (and stepped down if over)."
                if preset.verify_budget
                else " (not re-measured in this mode; the full mode does)."
            )
        ),
    }


def _planner_vs_published() -> dict:
    """The planner on the paper's 7B, 32 A100s of 80 GB (pp 8 x tp 4), 8 microbatches, no
    recomputation, next to its published memory: 1F1B 51.4 GB and Seq1F1B 34.3 GB at 64k,
    1F1B out of memory and Seq1F1B running at 128k."""
    out: dict = {
        "args": "--model paper-7b --gpus 32 --gpu-memory-gb 80 --reserve-gb 0 --global-batch 8 "
        "--pp 8 --tp 4 --ac none --min-segment 1 --split compute --chunks 1,2,4,8 "
        "--schedules 1F1B,Seq1F1B --precision bf16",
        "published_gb": {"65536": {"1F1B": 51.4, "Seq1F1B": 34.3}, "131072": {"1F1B": "OOM"}},
    }
    for seq in (65536, 131072):
        p = search(
            PAPER_SHAPE,
            seq,
            Hardware(32, 80.0, reserve_gb=0.0),
            8,
            pp=[8],
            tp=[4],
            chunks=(1, 2, 4, 8),
            splits=("compute",),
            recompute=(False,),
            min_segment=1,
            schedules=("1F1B", "Seq1F1B"),
        )
        out[str(seq)] = {
            f"K={c.setting.seq_chunks}": {"gb": round(c.max_bytes / GB, 1), "fits": c.fits}
            for c in p.candidates
        }
    return out


def _pictures(out: str, results: dict[str, Any], log: Callable[[str], None]) -> list[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no PNGs")
        return []
    from .output.pictures import measured_picture, readme_picture, schedule_pictures

    paths = schedule_pictures(os.path.join(out, "timelines"))
    readme = os.path.join(out, "timeline_1f1b_vs_seq1f1b.png")
    readme_picture(readme)
    paths.append(readme)
    for key, setting in results["measured"].items():
        if not setting["timed"]:
            continue
        path = os.path.join(out, f"measured_{key}.png")
        measured_picture(path, setting["runs"], f"measured {setting['short']}")
        if os.path.exists(path):
            paths.append(path)
    first = next((s for s in results["measured"].values() if s["timed"]), None)
    if first:  # docs/benchmarks.md's picture: 1F1B against Seq1F1B K=4, both splits, as measured
        path = os.path.join(out, "timeline_measured_1f1b_vs_seq1f1b.png")
        only = ("1F1B", "Seq1F1B K=4 uniform", "Seq1F1B K=4 compute")
        measured_picture(path, first["runs"], f"measured {first['short']}", only)
        paths.append(path)
    return paths


def run_all(
    preset: Preset, out: str, command: str, budget: float | None = None, pp2_only: bool = False
) -> dict[str, Any]:
    """Run every part of the benchmark for ``preset``; write nothing but traces and PNGs.

    ``pp2_only``: the simulations, the timed pp=2 comparison at the first length, the memory
    budget and the headline ratios, without pp=4, documents, CP and the planner example (the
    full model's pp=2 numbers in a quarter of the full run's time)."""
    if pp2_only:
        preset = replace(preset, seq_lens=preset.seq_lens[:1])
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    results: dict[str, Any] = {"measured": {}}

    t = time.perf_counter()
    _log("simulating the paper's settings")
    results["simulation"] = simulation_table(
        preset.sim_pps, preset.sim_microbatches, preset.sim_seq_lens, PAPER_SHAPE
    )
    m0, s0 = preset.sim_microbatches[0], preset.sim_seq_lens[0]
    results["simulation_views"] = [(pp, m0, s0) for pp in reversed(preset.sim_pps)]
    timings["simulation_s"] = time.perf_counter() - t

    pp2_runs: list[dict[str, Any]] = []
    for i, seq_len in enumerate(preset.seq_lens):
        t = time.perf_counter()
        load_before = _load()
        _log(f"measuring pp=2, M=2, {seq_len} tokens (load average {load_before})")
        runs = _measure_pp2(preset, seq_len, with_fits=i == 0)
        load = f"{load_before} before, {_load()} after"
        main_runs = [r for r in runs if "@" not in r["label"]]
        _simulated(main_runs, preset)
        results["measured"][f"pp2_{seq_len}"] = {
            "title": f"pp=2, M=2, {seq_len} tokens per sample",
            "short": f"pp=2, M=2, {seq_len} tokens",
            "pp": 2,
            "seq_len": seq_len,
            "timed": True,
            "load_average": load,
            "note": (
                f"{PINNING}. Median of {preset.timed_steps} steps, each the slowest rank's time; "
                "schedules alternate step by step. `replayed`: the measured CPU time of each "
                "action run through the simulator in the order each rank ran them (immune to "
                "other jobs taking the cores; see benchmarks/harness/cpu_replay.py). "
                "`simulated`: the FLOPs cost model for the same shapes. `wall/CPU`: the actions' "
                "wall time over their CPU time, 1.0 when the ranks have their cores to "
                f"themselves. Machine load average: {load}. Memory: {MEMORY_DEF}."
            ),
            "runs": main_runs,
        }
        if i == 0:
            pp2_runs = runs
        timings[f"pp2_{seq_len}_s"] = time.perf_counter() - t

    t = time.perf_counter()
    _log("calibrating the planner's time model on the measured pp=2 actions")
    timed_runs = [r for s in results["measured"].values() if s["timed"] for r in s["runs"]]
    results["calibration"] = calibrate(timed_runs, preset.model)
    timings["calibration_s"] = time.perf_counter() - t

    if not pp2_only:
        t = time.perf_counter()
        _log(f"measuring memory at pp=4, M=4, {preset.pp4_seq_len} tokens")
        specs = tuple(s for s in preset.pp4_specs if _usable(s, 4, preset))
        setting = Setting(
            4, 4, preset.pp4_seq_len, preset.model, specs, 0, preset.pp4_fresh_processes
        )
        pp4 = measure(setting)
        results["measured"]["pp4"] = {
            "title": f"pp=4, M=4, {preset.pp4_seq_len} tokens per sample (memory only)",
            "short": f"pp=4, M=4, {preset.pp4_seq_len} tokens",
            "pp": 4,
            "seq_len": preset.pp4_seq_len,
            "timed": False,
            "note": (
                "Memory only: 4 ranks share 2 cores, so step times would measure the OS "
                f"scheduler, not the schedule. Memory: {MEMORY_DEF}."
                + (
                    " Peak RSS: growth of the rank process's ru_maxrss over its first step, one "
                    "fresh process group per schedule."
                    if preset.pp4_fresh_processes
                    else ""
                )
            ),
            "runs": pp4,
        }
        timings["pp4_s"] = time.perf_counter() - t

    t = time.perf_counter()
    _log("memory-budget search")
    results["budget"] = _budget(preset, pp2_runs, budget)
    timings["budget_s"] = time.perf_counter() - t

    if not pp2_only:
        results["planner_example"] = _planner_vs_published()
        results["memory_vs_published"] = memory_vs_published()

        t = time.perf_counter()
        _log("packed documents: skipping on / off (measured), mask-aware split (simulated)")
        results["masks"] = {
            "measured": measure_skipping(preset),
            "simulated": simulate_masked_splits(PAPER_SHAPE, chunks=(4, 8)),
        }
        timings["masks_s"] = time.perf_counter() - t

        t = time.perf_counter()
        _log("context parallelism: pp=2 x cp=2 (measured), longest sequence at 8B (simulated)")
        results["context_parallel"] = {
            "measured": measure_cp(preset),
            "simulated": longest_sequences(),
        }
        timings["context_parallel_s"] = time.perf_counter() - t
    first_pp2 = next((s for k, s in results["measured"].items() if k.startswith("pp2_")), None)
    results["memory_bounds"] = memory_bound_rows(first_pp2["runs"] if first_pp2 else [])
    results["headline"] = headline_rows(results)

    t = time.perf_counter()
    trace_dir = os.path.join(out, "traces")
    os.makedirs(trace_dir, exist_ok=True)
    for key, setting in results["measured"].items():
        write_chrome_trace(os.path.join(trace_dir, f"{key}.json"), setting["runs"])
    results["pictures"] = _pictures(out, results, _log)
    timings["pictures_s"] = time.perf_counter() - t
    for setting in results["measured"].values():
        for r in setting["runs"]:
            r.pop("trace", None)  # kept in traces/*.json
            r.pop("step_traces", None)
    timings["total_s"] = time.perf_counter() - t_start
    results["meta"] = {
        "mode": preset.name,
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "model": asdict(preset.model),
        "pinning": PINNING,
        "memory_definition": MEMORY_DEF,
        "timings": timings,
        "summary": (
            f"{preset.name} mode, {timings['total_s']:.0f} s on {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}; model {asdict(preset.model)}"
        ),
    }
    return results
