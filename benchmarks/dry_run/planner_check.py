"""``python -m benchmarks.dry_run.planner_check [--quick]``: the planner's peak memory against
the dry run's, over a grid of schedules (split backwards included) x K x activation
checkpointing x tensor parallelism.

Each cell is the direct API's Llama-style model (:mod:`seq1f1b.testing`) at a moderate width
(:data:`GRID_CFG`), pipeline rank 0 (TP rank 0) dry-run in a process of its own
(:func:`~benchmarks.dry_run.model_ranks.dry_run_isolated`), and the planner's price of the same
setting for the same trainer (:func:`planner_peak`: the model's shape, 8 bytes of state a
parameter, the saved tensors of torch's eager path on the dry run's device,
:data:`~seq1f1b.planning.saved.TORCH_EAGER_CPU`). Printed: each cell's two peaks, their ratio,
and the split (state, activations, temporaries) of each; then the worst ratio.

Why moderate sizes: the planner's formulas are per token and layer, so they hold at any size;
a cell of a 1024-wide model at 8k tokens dry-runs in seconds.
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from seq1f1b.planning.dryrun import RankReport
from seq1f1b.planning.planner import Candidate, Setting, price
from seq1f1b.planning.profiles import profile
from seq1f1b.planning.saved import PROFILES, TORCH_EAGER_CPU, SavedTensors
from seq1f1b.testing import TinyConfig

from .model_ranks import dry_run_isolated, model_shape

__all__ = ["GRID_CFG", "CheckCell", "Row", "grid", "main", "planner_peak", "priced", "run_cells"]

GIB = 2.0**30
GPU = "h100-80gb"
#: the dry run keeps bf16 weights, bf16 gradients and bf16 AdamW moments: 8 bytes a parameter
DRY_STATE_BYTES = 8.0
#: a Llama-style model of moderate width: 8 layers (4 a stage at pp 2, 2 a stage at pp 2 x 2
#: stages), GQA 16 heads over 8 K/V heads of 64, SwiGLU, a 16k vocabulary
GRID_CFG = TinyConfig(vocab=16384, dim=1024, n_heads=16, n_kv_heads=8, n_layers=8, ffn=2816)


@dataclass(frozen=True)
class CheckCell:
    """One grid cell: a registry schedule (``v`` stages per rank), K, AC mode, TP degree."""

    schedule: str
    k: int
    ac: str  # "none", "full" or "selective"
    tp: int
    seq_len: int = 8192
    pp: int = 2
    v: int = 1
    microbatches: int = 4
    cfg: TinyConfig = GRID_CFG

    @property
    def label(self) -> str:
        v = f" v{self.v}" if self.v > 1 else ""
        return f"{self.schedule}{v} K{self.k} {self.ac} tp{self.tp} {self.seq_len // 1024}k"

    def job(self) -> tuple[tuple, dict, int, int, str]:
        """:func:`~benchmarks.dry_run.model_ranks.dry_run_isolated`'s job: pipeline rank 0."""
        args = (self.cfg, self.schedule, self.pp, self.v, self.microbatches, self.k,
                self.seq_len, self.microbatches, 16, self.tp, "uniform")  # fmt: skip
        return args, {"ac": self.ac}, 0, self.pp * self.tp, GPU

    def setting(self) -> Setting:
        return Setting(self.pp, self.tp, 1, self.k, self.microbatches, "uniform",
                       self.ac == "full", True, self.schedule, self.v,
                       selective=self.ac == "selective")  # fmt: skip


def planner_peak(cell: CheckCell, saved: SavedTensors = TORCH_EAGER_CPU) -> Candidate:
    """The planner's price of ``cell`` for the dry run's model and trainer: SwiGLU, bf16
    state of 8 bytes a parameter, torch's posted P2P, the loss in 16 chunks, the tensors
    ``saved`` describes (the dry run's: torch's eager ops on the CPU)."""
    prof = profile(GPU)
    return price(cell.setting(), model_shape(cell.cfg), cell.seq_len,
                 prof.hardware(cell.pp * cell.tp, 0.0), actions=prof.action_costs(),
                 state_bytes_per_param=DRY_STATE_BYTES, saved=saved,
                 loss_chunks=16)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """A cell's dry run against the planner (GiB, rank 0)."""

    cell: CheckCell
    dry: RankReport
    planned: float  # the planner's peak
    planned_state: float
    planned_transient: float

    @property
    def ratio(self) -> float:
        return self.planned / (self.dry.peak.total / GIB)


def grid(quick: bool = False) -> list[CheckCell]:
    """The grid: torch's 1F1B, Interleaved1F1B and GPipe (K = 1) and Seq1F1B,
    InterleavedSeq1F1B (K = 2, 4, 8) x AC (none, full, selective) x TP (1, 2, 4, with
    sequence parallelism); ZBSeq1F1B and ZBVSeq1F1B (K = 4) x AC x TP (1, 2). ``quick``: five
    cells across the axes."""
    if quick:
        return [
            CheckCell("1F1B", 1, "none", 1),
            CheckCell("Seq1F1B", 4, "none", 2),
            CheckCell("InterleavedSeq1F1B", 4, "full", 1, v=2),
            CheckCell("Interleaved1F1B", 1, "selective", 2, v=2),
            CheckCell("Seq1F1B", 8, "full", 4),
        ]
    cells = []
    for tp in (1, 2, 4):
        for ac in ("none", "full", "selective"):
            cells += [CheckCell("1F1B", 1, ac, tp), CheckCell("Interleaved1F1B", 1, ac, tp, v=2)]
            for k in (2, 4, 8):
                cells += [CheckCell("Seq1F1B", k, ac, tp),
                          CheckCell("InterleavedSeq1F1B", k, ac, tp, v=2)]  # fmt: skip
    cells += [CheckCell("GPipe", 1, "none", 2), CheckCell("LoopedBFS", 1, "none", 2, v=2)]
    # the split backwards (zero bubble: each unit's weight half deferred), K = 4
    for ac in ("none", "full", "selective"):
        for tp in (1, 2):
            cells += [CheckCell("ZBSeq1F1B", 4, ac, tp), CheckCell("ZBVSeq1F1B", 4, ac, tp, v=2)]
    # a longer sequence: the per-token formulas at 16k
    cells += [replace(c, seq_len=16384) for c in (CheckCell("1F1B", 1, "none", 4),
                                                  CheckCell("Seq1F1B", 4, "none", 4))]  # fmt: skip
    return cells


def run_cells(cells: Sequence[CheckCell], saved: SavedTensors = TORCH_EAGER_CPU,
              workers: int = 1) -> list[Row]:  # fmt: skip
    """Dry-run each cell (rank 0, a process each) and price it."""
    return priced(cells, dry_run_isolated([c.job() for c in cells], workers), saved)


def priced(cells: Sequence[CheckCell], reports: Sequence[RankReport],
           saved: SavedTensors = TORCH_EAGER_CPU) -> list[Row]:  # fmt: skip
    """Each cell's dry run beside the planner's price of it with the profile ``saved``."""
    rows = []
    for cell, rep in zip(cells, reports, strict=True):
        cand = planner_peak(cell, saved)
        state, _, transient = cand.memory_parts[0]
        rows.append(Row(cell, rep, cand.peak_bytes[0] / GIB, state / GIB, transient / GIB))
    return rows


def _dry_runs(cells: Sequence[CheckCell], save: str | None,
              resume: bool = False) -> tuple[list, list]:  # fmt: skip
    """Each cell dry-run in a process of its own, one after the other (a cell that fails is
    named and left out); with ``save``, the cells done so far pickled after each one, and with
    ``resume`` those the file holds already are not run again."""
    done: list[CheckCell] = []
    reports: list[RankReport] = []
    if resume and save and os.path.exists(save):
        with open(save, "rb") as f:
            done, reports = pickle.load(f)
    for i, cell in enumerate(cells, 1):
        if cell in done:
            continue
        start = time.perf_counter()
        try:
            (rep,) = dry_run_isolated([cell.job()])
        except Exception as e:  # a failed cell is reported, the grid goes on
            print(f"[{i}/{len(cells)}] {cell.label}: FAILED ({type(e).__name__}: {e})", flush=True)
            continue
        done.append(cell)
        reports.append(rep)
        print(f"[{i}/{len(cells)}] {cell.label}: {rep.peak.total / GIB:.3f} GiB "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        if save:
            with open(save, "wb") as f:
                pickle.dump((done, reports), f)
    return done, reports


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line(head), *(line(r) for r in rows)])


def report(rows: Sequence[Row], profile_name: str = TORCH_EAGER_CPU.name) -> str:
    """The table, as printed: GiB per cell (dry run: state, activations with the K/V cache
    and receives, temporaries; planner: state, activations, transient) and the ratio."""
    head = ["cell", "dry GiB", "planner GiB", "planner/dry", "dry state", "dry act",
            "dry temp", "plan state", "plan act", "plan transient", "dry run s"]  # fmt: skip
    body = []
    for r in rows:
        p = r.dry.peak
        act = (p.activations + p.kv_cache + p.receives) / GIB
        plan_act = r.planned - r.planned_state - r.planned_transient
        body.append([r.cell.label, f"{p.total / GIB:.3f}", f"{r.planned:.3f}", f"{r.ratio:.3f}",
                     f"{(p.parameters + p.gradients + p.optimizer) / GIB:.3f}", f"{act:.3f}",
                     f"{p.temporaries / GIB:.3f}", f"{r.planned_state:.3f}", f"{plan_act:.3f}",
                     f"{r.planned_transient:.3f}", f"{r.dry.host_s:.0f}"])  # fmt: skip
    worst = max(rows, key=lambda r: abs(r.ratio - 1.0))
    return "\n".join([
        f"Peak memory, pipeline rank 0 (TP rank 0), GiB; {GRID_CFG}; planner profile "
        f"{profile_name!r}",
        _table(head, body),
        f"worst: {worst.cell.label}, planner / dry run = {worst.ratio:.3f}",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dry_run.planner_check",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="five cells across the axes")
    ap.add_argument("--only", default=None, help="cells whose label contains this text")
    ap.add_argument("--profile", default=TORCH_EAGER_CPU.name, choices=sorted(PROFILES),
                    help="the planner's saved-tensor profile (seq1f1b/planning/saved.py); "
                    "'fused' is the formula before the recalibration")  # fmt: skip
    ap.add_argument("--save", default=None, help="pickle the cells' dry runs to this file")
    ap.add_argument("--load", default=None, help="price the dry runs of a --save file, no run")
    ap.add_argument("--resume", action="store_true", help="skip the cells the --save file holds")
    args = ap.parse_args(argv)
    saved = PROFILES[args.profile]
    if args.load:
        with open(args.load, "rb") as f:
            cells, reports = pickle.load(f)
        print(report(priced(cells, reports, saved), args.profile))
        return 0
    cells = grid(args.quick)
    if args.only:
        cells = [c for c in cells if args.only in c.label]
    start = time.perf_counter()
    done, reports = _dry_runs(cells, args.save, args.resume)
    print(report(priced(done, reports, saved), args.profile))
    print(f"({len(cells)} cells dry-run in {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
