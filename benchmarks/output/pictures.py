"""Which timelines get drawn: one PNG per simulated schedule, the README figure, measured runs.

Why: keeps the choice of pictures (sizes, titles, file names) apart from how a timeline is
drawn (:mod:`benchmarks.output.timeline`) and from running anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from seq1f1b.schedules.partition import ModelShape

from ..harness.pipeline_orders import ScheduleSpec
from ..step_time.simtables import PAPER_SHAPE, simulate_spec
from .timeline import Panel, draw_panels, measured_blocks, simulated_blocks

__all__ = ["measured_picture", "readme_picture", "schedule_pictures"]


def _sim_panel(
    spec: ScheduleSpec, split: str, shape: ModelShape, seq_len: int, base: float | None
) -> tuple[Panel, float]:
    res, _ = simulate_spec(spec, shape, seq_len, split)
    k = spec.seq_chunks if spec.entry.seq_chunked else 1
    name = spec.label + (f" {split}" if k > 1 else "")
    rel = f", time {res.makespan / base:.2f}x 1F1B" if base else ""
    title = f"{name}: bubble {res.bubble_ratio:.3f}{rel}"
    scale = 1.0 / (base or res.makespan)  # time axis: 1F1B's step = 1
    blocks = [
        replace(b, start=b.start * scale, end=b.end * scale) for b in simulated_blocks(res, k)
    ]
    return Panel(title, blocks, spec.pp), res.makespan


def schedule_pictures(
    out_dir: str,
    pp: int = 4,
    m: int = 8,
    k: int = 2,
    shape: ModelShape = PAPER_SHAPE,
    seq_len: int = 32768,
) -> list[str]:
    """One PNG per schedule (simulated, causal FLOPs costs); returns the file paths."""
    os.makedirs(out_dir, exist_ok=True)
    specs = [
        (ScheduleSpec("GPipe", pp, m), "-"),
        (ScheduleSpec("1F1B", pp, m), "-"),
        (ScheduleSpec("Interleaved1F1B", pp, m), "-"),
        (ScheduleSpec("ZBVZeroBubble", pp, m), "-"),
        (ScheduleSpec("DualPipeV", pp, m), "-"),
        (ScheduleSpec("Seq1F1B", pp, m, k), "uniform"),
        (ScheduleSpec("Seq1F1B", pp, m, k), "compute"),
        (ScheduleSpec("InterleavedSeq1F1B", pp, m, k), "compute"),
    ]
    _, base = _sim_panel(ScheduleSpec("1F1B", pp, m), "-", shape, seq_len, None)
    paths = []
    for spec, split in specs:
        try:
            panel, _ = _sim_panel(spec, split, shape, seq_len, base)
        except ValueError:  # torch refuses this size
            continue
        name = spec.label.replace(" ", "_").replace("=", "") + (f"_{split}" if split != "-" else "")
        path = os.path.join(out_dir, f"sim_{name}.png")
        title = f"simulated, pp={pp}, M={m}, 7B-like at {seq_len // 1024}k tokens - {panel.title}"
        draw_panels([Panel(title, panel.blocks, panel.n_ranks)], path, "time (1F1B step = 1)")
        paths.append(path)
    return paths


def readme_picture(
    path: str, pp: int = 4, m: int = 4, k: int = 4, shape: ModelShape = PAPER_SHAPE
) -> None:
    """1F1B against Seq1F1B with a uniform and a compute-balanced split, one time axis."""
    seq_len = 32768
    _, base = _sim_panel(ScheduleSpec("1F1B", pp, m), "-", shape, seq_len, None)
    panels = [
        _sim_panel(ScheduleSpec("1F1B", pp, m), "-", shape, seq_len, base)[0],
        _sim_panel(ScheduleSpec("Seq1F1B", pp, m, k), "uniform", shape, seq_len, base)[0],
        _sim_panel(ScheduleSpec("Seq1F1B", pp, m, k), "compute", shape, seq_len, base)[0],
    ]
    head = f"simulated, pp={pp}, M={m}, 7B-like at 32k tokens, causal FLOPs costs - "
    panels[0] = Panel(head + panels[0].title, panels[0].blocks, panels[0].n_ranks)
    draw_panels(panels, path, "time (1F1B step = 1)", width=11.0)


def measured_picture(
    path: str,
    runs: Sequence[dict[str, Any]],
    title: str,
    only: Sequence[str] | None = None,
) -> None:
    """The measured step of each schedule (one panel each), on one shared seconds axis."""
    panels = []
    for r in runs:
        if only is not None and r["label"] not in only:
            continue
        blocks = measured_blocks(r.get("trace") or [])
        if not blocks:
            continue
        n = max(b.rank for b in blocks) + 1
        span = max(b.end for b in blocks)
        t = r.get("step_time_s")
        med = f", median step {t:.2f} s" if t else ""
        panels.append(Panel(f"{title}: {r['label']}: this step {span:.2f} s{med}", blocks, n))
    if panels:
        draw_panels(panels, path, "time (s)")
