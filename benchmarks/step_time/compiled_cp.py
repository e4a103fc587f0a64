"""The compile gain under context parallelism beside the gain without it (CPU, gloo, pp=2).

Each schedule's compiled / eager median step time, at cp = 1 (2 ranks) and cp = 2 (pp=2 x
cp=2, 4 ranks): under CP the ring's hops run inside the compiled attention's custom ops, so a
compiled block has no graph break per hop, and the gain should be the one without CP. Every
block is ``torch.compile``'d (``fullgraph=True``) for the compiled rows. Each run's first
step (memory, self-checked: compiled stages run it eagerly) and one warm-up step (it
compiles) are untimed; the timed steps interleave the schedules of a setting.

    python -m benchmarks.step_time.compiled_cp [--preset quick|full] [--steps 3]

On a machine with fewer than 4 cores the cp = 2 ranks share cores, so its absolute times are
not comparable with cp = 1's. Where other jobs share the cores, wall times are noise: read
the compute CPU seconds (all ranks' CPU time in compute actions, per step) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from ..harness.measured import RunSpec
from ..harness.presets import PRESETS
from .compiled import paired_rows

#: uniform splits: a CP segment must be a multiple of 2 * cp tokens
CP1_SPECS = (RunSpec("1F1B"), RunSpec("Seq1F1B", 4, "uniform"), RunSpec("ZBVSeq1F1B", 4, "uniform"))
CP2_SPECS = (
    RunSpec("Seq1F1B", 1, "uniform"),  # 1F1B's order over whole samples, CP-sharded
    RunSpec("Seq1F1B", 4, "uniform"),
    RunSpec("ZBVSeq1F1B", 4, "uniform"),
)


def _compute_cpu_s(row: dict[str, Any]) -> float:
    """Median over the timed steps of the CPU seconds all ranks spent in compute actions:
    what compiling changes, and robust where other jobs share the cores (wall time is not)."""
    return statistics.median(sum(ev["cpu"] for ev in step) for step in row["step_traces"])


def _ratios(cp: int, specs: tuple[RunSpec, ...], args: argparse.Namespace) -> list[tuple]:
    """(label, eager s, compiled s, eager CPU s, compiled CPU s) of each spec at this CP
    degree."""
    pairs = paired_rows(specs, args.seq_len, PRESETS[args.preset].model, args.steps, cp=cp,
                        warmup_steps=1)  # fmt: skip
    return [(spec.label, eager["step_time_s"], comp["step_time_s"], _compute_cpu_s(eager),
             _compute_cpu_s(comp)) for spec, eager, comp in pairs]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="quick")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per schedule")
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"preset {args.preset}: pp=2, M=2, {args.seq_len} tokens, {args.steps} timed steps")
    print("| cp | schedule | eager s | compiled s | compiled / eager | compute CPU s eager | "
          "compiled | compiled / eager |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for cp, specs in ((1, CP1_SPECS), (2, CP2_SPECS)):
        for label, eager, comp, eager_cpu, comp_cpu in _ratios(cp, specs, args):
            print(f"| {cp} | {label} | {eager:.3f} | {comp:.3f} | {comp / eager:.3f} | "
                  f"{eager_cpu:.3f} | {comp_cpu:.3f} | {comp_cpu / eager_cpu:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
