"""Unit overhead: what a Seq1F1B step costs that Schedule1F1B's step on the same tokens does
not, with no pipeline bubble to hide or gain anything (one stage, pp=1).

Why: at pp > 1 Seq1F1B's gain is the bubble it removes minus what its segments cost; the
second part is easy to lose in step-time noise and it grows with every feature a unit pays
for (K/V bookkeeping, receive checks, guards, the attention's tiles and merges). Here the
model runs as one stage, so the ratio Seq1F1B / 1F1B is that cost alone, and with a profiled
step of each it is split by where the time goes:

* ``attention kernels``: the flash attention calls (one causal call per layer for 1F1B, the
  planned tiles for Seq1F1B);
* ``matmuls``: ``aten::mm`` / ``addmm`` / ``bmm`` (smaller row counts per call for segments);
* ``other ops``: every other aten op (norms, RoPE, merges by log-sum-exp, K/V gradient adds);
* ``outside ops``: the step's wall time minus all op time: Python and dispatch (the
  schedule, the unit context, the attention's planning).

Each part is reported as the Seq1F1B step's excess over 1F1B's, in ms per unit (a unit is
one segment's forward and backward; ``M * K`` of them per step).

``python -m benchmarks.step_time.unit_overhead [--preset full|quick|smoke] [--layers N]
[--chunks 2,4,8] [--steps N] [--out DIR] [--record FILE]``. ``--record`` appends this run,
keyed by the checkout's commit, to a JSON history and rewrites the markdown table beside it
(``benchmarks/results/unit_overhead.{json,md}`` is the one kept in the repository), so a
change that adds per-unit overhead shows as a new row next to the commit before it.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from seq1f1b import ScheduleSeq1F1B, SequenceSplit
from seq1f1b.testing import TinyConfig, build_stages

from ..harness.tiny_shape import model_shape

__all__ = ["Config", "categories", "measure", "record"]

KERNELS = ("flash_attention", "scaled_dot_product", "_efficient_attention")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
PARTS = ("attention kernels", "matmuls", "other ops", "outside ops")
#: the benchmark presets' models (``benchmarks.harness.presets``), repeated here so that this
#: module imports only the library's public API and runs against older checkouts unchanged
MODELS = {
    "full": TinyConfig(vocab=4096, dim=512, n_heads=8, n_kv_heads=8, n_layers=8, ffn=1376),
    "quick": TinyConfig(vocab=1024, dim=128, n_heads=2, n_kv_heads=2, n_layers=4, ffn=344),
    "smoke": TinyConfig(vocab=64, dim=32, n_heads=2, n_kv_heads=2, n_layers=8, ffn=64),
}


@dataclass(frozen=True)
class Config:
    """The model (a preset's, with ``layers`` of them), its batch and what is compared."""

    model: TinyConfig
    seq_len: int = 4096
    microbatches: int = 2
    chunks: tuple[int, ...] = (2, 4, 8)
    split: str = "compute"
    steps: int = 2  # timed steps per schedule, alternated; the median is reported
    profile: bool = True
    compiled: bool = False  # every block torch.compile'd (fullgraph), as torchtitan does


@dataclass
class Row:
    label: str
    units: int
    step_s: float
    steps_s: list[float]
    ratio_vs_1f1b: float = 1.0
    parts_s: dict[str, float] = field(default_factory=dict)  # profiled step, by part
    excess_ms_per_unit: dict[str, float] = field(default_factory=dict)  # vs 1F1B, by part


def categories(events: Any, wall_s: float) -> dict[str, float]:
    """A profiled step's time by part (see the module docstring): op self-times summed by
    name, and the wall time not spent in any op."""
    parts = dict.fromkeys(PARTS, 0.0)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not e.key.startswith("aten::"):
            continue
        s = e.self_cpu_time_total / 1e6
        if any(k in e.key for k in KERNELS):
            parts["attention kernels"] += s
        elif e.key in MATMULS:
            parts["matmuls"] += s
        else:
            parts["other ops"] += s
    ops = parts["attention kernels"] + parts["matmuls"] + parts["other ops"]
    parts["outside ops"] = max(wall_s - ops, 0.0)
    return parts


#: the split's keyword (``split`` in checkouts before the schedules took torch's naming)
_SPLIT_ARG = "seq_split" if "seq_split" in str(inspect.signature(ScheduleSeq1F1B)) else "split"


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def measure(cfg: Config) -> list[Row]:
    """Both kinds of step on one stage; needs an initialised (one-rank) process group."""
    mod = build_stages(cfg.model, 1, seed=0)[0]
    if cfg.compiled:
        for block in mod.layers:
            block.compile(fullgraph=True)
    g = torch.Generator().manual_seed(0)
    shape = (cfg.microbatches, cfg.seq_len)
    x = torch.randint(0, cfg.model.vocab, shape, generator=g)
    y = torch.randint(0, cfg.model.vocab, shape, generator=g)
    cpu = torch.device("cpu")
    scheds: dict[str, tuple[Any, int]] = {
        "1F1B": (Schedule1F1B(PipelineStage(mod, 0, 1, cpu), cfg.microbatches, loss_fn=_loss), 1)
    }
    for k in cfg.chunks:
        split = SequenceSplit(cfg.split, model_shape=model_shape(cfg.model), seq_len=cfg.seq_len)
        stage = PipelineStage(mod, 0, 1, cpu)
        sched = ScheduleSeq1F1B([stage], cfg.microbatches, k, _loss, **{_SPLIT_ARG: split})
        scheds[f"Seq1F1B K={k} {cfg.split}"] = (sched, k)

    def step(s: Any) -> float:
        t0 = time.perf_counter()
        s.step(x, target=y, losses=[])
        for p in mod.parameters():
            p.grad = None
        return time.perf_counter() - t0

    for _ in range(2 if cfg.compiled else 1):  # compiled: a static, then a dynamic variant
        for s, _ in scheds.values():
            step(s)  # the first step checks itself (Seq1F1B) and warms the allocator
    times: dict[str, list[float]] = {name: [] for name in scheds}
    for _ in range(cfg.steps):
        for name, (s, _) in scheds.items():
            times[name].append(step(s))
    rows = []
    for name, (s, k) in scheds.items():
        row = Row(name, cfg.microbatches * k, statistics.median(times[name]), times[name])
        if cfg.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                wall = step(s)
            row.parts_s = categories(p.key_averages(), wall)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row.ratio_vs_1f1b = row.step_s / base.step_s
        row.excess_ms_per_unit = {
            part: 1e3 * (row.parts_s.get(part, 0.0) - base.parts_s.get(part, 0.0)) / row.units
            for part in PARTS
        }
        row.excess_ms_per_unit["step (timed)"] = 1e3 * (row.step_s - base.step_s) / row.units
    return rows


def _commit() -> str:
    """The commit of the ``seq1f1b`` imported, ``+dirty`` if its files differ from it."""
    import seq1f1b

    here = os.path.dirname(os.path.abspath(seq1f1b.__file__))  # the library measured
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") or "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(cfg: Config) -> dict[str, Any]:
    """One measurement on a fresh one-rank gloo group (one thread, pinned to one core)."""
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        rows = measure(cfg)
    finally:
        dist.destroy_process_group()
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "config": {**asdict(cfg), "model": asdict(cfg.model)},
        "rows": [asdict(r) for r in rows],
    }


def markdown(history: list[dict[str, Any]]) -> str:
    """One row per (run, K): the step ratio to 1F1B and the per-unit excess by part."""
    lines = [
        "# Unit overhead (pp=1): Seq1F1B step vs Schedule1F1B on the same tokens",
        "",
        "Written by `python -m benchmarks.step_time.unit_overhead --record FILE`; ms per unit "
        "of Seq1F1B's excess over 1F1B (one profiled step of each; `step` from the timed "
        "median).",
        "",
        "| commit | date | torch | model | K | step vs 1F1B | step | attention kernels | "
        "matmuls | other ops | outside ops |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in history:
        m = run_["config"]["model"]
        model = f"d{m['dim']} L{m['n_layers']} S{run_['config']['seq_len']}"
        if run_["config"].get("compiled"):
            model += " compiled"
        for r in run_["rows"][1:]:
            e = r["excess_ms_per_unit"]
            k = r["label"].split("K=")[1].split()[0]
            lines.append(
                f"| {run_['commit']} | {run_['date']} | {run_['torch']} | {model} | {k} | "
                f"{r['ratio_vs_1f1b']:.3f} | {e['step (timed)']:+.1f} | "
                + " | ".join(f"{e.get(p, 0.0):+.1f}" for p in PARTS)
                + " |"
            )
    return "\n".join(lines)


def record(result: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """Append ``result`` to the JSON history at ``path``; rewrite ``path``'s ``.md`` table."""
    history: list[dict[str, Any]] = []
    if os.path.exists(path):
        with open(path) as f:
            history = json.load(f)
    history.append(result)
    with open(path, "w") as f:
        json.dump(history, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(markdown(history) + "\n")
    return history


def main(argv: Sequence[str] | None = None, runner: Callable[[Config], dict] = run) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_time.unit_overhead", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", choices=["full", "quick", "smoke"], default="full")
    ap.add_argument("--layers", type=int, default=4, help="layers of the preset's model")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--chunks", default="2,4,8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--compiled", action="store_true", help="compile every block")
    ap.add_argument("--out", default=None, help="directory for unit_overhead.json / .md")
    ap.add_argument("--record", default=None, help="JSON history to append this run to")
    a = ap.parse_args(argv)
    model = replace(MODELS[a.preset], n_layers=a.layers)
    cfg = Config(
        model,
        seq_len=a.seq_len,
        chunks=tuple(int(c) for c in a.chunks.split(",")),
        steps=a.steps,
        profile=not a.no_profile,
        compiled=a.compiled,
    )
    result = runner(cfg)
    report = markdown([result])
    print(report)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "unit_overhead.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(a.out, "unit_overhead.md"), "w") as f:
            f.write(report + "\n")
    if a.record:
        record(result, a.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
