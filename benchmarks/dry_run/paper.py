"""``python -m benchmarks.dry_run.paper [--quick]``: the Seq1F1B paper's memory headline at its
scale, dry-run.

The paper's 7B on 32 A100s (pp 4 x tp 8 with sequence parallelism, 8 microbatches of one
sequence, K = 4 with the compute split, two stages per rank for the interleaved schedules, no
recomputation) at 32k, 64k and 128k tokens under 1F1B, Interleaved1F1B, Seq1F1B and
InterleavedSeq1F1B; and its 30B at 64k on 64 A100s (tp 8 x pp 8, 16 microbatches, K = 4),
which Seq1F1B fits and 1F1B does not. Each cell is the direct API's Llama-style model
(:mod:`seq1f1b.testing`, SwiGLU) at the paper's width, with torch's tensor and sequence
parallelism over a fake ``(pp, tp)`` device mesh (:func:`~benchmarks.dry_run.model_ranks.
tensor_parallel`), pipeline rank 0's TP rank 0 dry-run (TP ranks are symmetric; rank 0 holds
the most activations and the embedding) in a process of its own.

Printed per cell: the dry run's peak by kind, the same plus what Megatron-LM (the paper's fork)
holds differently, item by item (:func:`megatron_items`), the published figure (64k) and the
planner's prediction of it (:mod:`benchmarks.planner_models.published`).
"""

from __future__ import annotations

import argparse
import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from seq1f1b.planning.costmodel import GB, MemoryModel
from seq1f1b.planning.dryrun import RankReport
from seq1f1b.planning.planner import Setting, price
from seq1f1b.planning.profiles import GpuProfile, profile
from seq1f1b.planning.saved import TORCH_EAGER_CPU, SavedTensors
from seq1f1b.registry import is_baseline, lookup
from seq1f1b.schedules.partition import ModelShape
from seq1f1b.testing import TinyConfig

from ..planner_models.published import (
    MEGATRON_STATE_BYTES,
    PAPER_30B,
    PAPER_SHAPE,
    PUBLISHED_MEMORY_64K,
    SCHEDULES,
    megatron_layer_items,
    sp_backward_transient_bytes,
    sp_gather_bytes,
)
from ..planner_models.published_titan import allocator_slack
from .model_ranks import SHAPES, dry_run_isolated, model_shape

GIB = 2.0**30
GPU = "a100-80gb"
#: the dry run keeps bf16 weights, bf16 gradients and bf16 AdamW moments: 8 bytes a parameter
DRY_STATE_BYTES = 8.0


@dataclass(frozen=True)
class Cell:
    """One dry-run cell: a paper schedule (a key of :data:`SCHEDULES`) at one setting."""

    model: str  # "7B", "30B" or "tiny"
    cfg: TinyConfig  # what the dry run builds (SwiGLU)
    megatron: ModelShape  # what the paper ran (GELU, 4H), for the planner
    schedule: str
    seq_len: int
    pp: int
    tp: int
    microbatches: int

    @property
    def registry(self) -> tuple[str, int, int]:
        """(registry name, stages per rank, K)."""
        return SCHEDULES[self.schedule]

    def job(self) -> tuple[tuple, dict, int, int, str]:
        name, v, k = self.registry
        args = (self.cfg, name, self.pp, v, self.microbatches, k, self.seq_len,
                self.microbatches, 16, self.tp, "compute")  # fmt: skip
        return args, {}, 0, self.pp * self.tp, GPU


def paper_cells(quick: bool = False) -> list[Cell]:
    """The paper's cells; ``quick``: the same four schedules on a tiny model (pp 2 x tp 2)."""
    if quick:
        tiny = TinyConfig(vocab=512, dim=128, n_heads=4, n_kv_heads=4, n_layers=4, ffn=352)
        shape = ModelShape(128, 4, 4, 512)
        return [Cell("tiny", tiny, shape, s, 1024, 2, 2, 4) for s in SCHEDULES]
    cells = [Cell("7B", SHAPES["paper-7b"], PAPER_SHAPE, s, n, 4, 8, 8)
             for n in (32768, 65536, 131072) for s in SCHEDULES]  # fmt: skip
    cells += [Cell("30B", SHAPES["paper-30b"], PAPER_30B, s, 65536, 8, 8, 16)
              for s in ("1F1B", "Seq1F1B")]  # fmt: skip
    return cells


def dry_layer_items(cfg: TinyConfig, tp: int) -> dict[str, float]:
    """What a layer of the dry-run model saves per token of a unit in flight, on one TP rank,
    bf16, by item (torch's TP and SP as :func:`~benchmarks.dry_run.model_ranks.tensor_parallel`
    applies them). The column-parallel matmuls save their input, which torch's
    ``PrepareModuleOutput`` all-gathered: the whole sequence (Megatron saves the shard and
    gathers it again in the backward)."""
    h, f, d = cfg.dim, cfg.ffn, cfg.dim // cfg.n_heads
    return {
        # eager RMSNorm (torch's composite): its fp32 upcast input and the normalized output
        "norms: fp32 input + normalized (shards)": 2 * (4.0 + 2.0) * h / tp,
        "gathered norm outputs (whole sequence)": 2 * 2.0 * h,
        "Q, K, V, attention output": 4 * 2.0 * h / tp + 4.0 * cfg.n_heads / tp,
        "attention output reshaped for wo": 2.0 * h / tp,
        "RoPE cos/sin": 2 * 2 * 2.0 * d / 2,
        "SwiGLU: w1, w3, silu, product": 4 * 2.0 * f / tp,
    }


def megatron_layer_bytes(shape: ModelShape, tp: int) -> dict[str, float]:
    """The same for the paper's fork, per TP rank: the planner's formula (norm inputs and
    outputs as shards, Q/K/V/O, the GELU FFN's two ``4H`` tensors) plus its Megatron items
    (:func:`~benchmarks.planner_models.published.megatron_layer_items`)."""
    h, f = shape.hidden, shape.ffn_hidden
    assert f is not None
    items = {
        "norm inputs and outputs (shards)": 4 * 2.0 * h / tp,
        "Q, K, V, attention output": 4 * 2.0 * h / tp + 4.0 * shape.n_heads / tp,
        "GELU FFN: fc1 output, GELU output": 2 * 2.0 * f / tp,
    }
    items.update({k: v / tp for k, v in megatron_layer_items(shape, tp).items()})
    return items


def _megatron_price(cell: Cell, prof: GpuProfile, extra: float, kv_copy: bool) -> Any:
    sched, v, k = cell.registry
    setting = Setting(cell.pp, cell.tp, 1, k, cell.microbatches, "compute", False, True, sched, v)
    hw = prof.hardware(cell.pp * cell.tp, 0.0)
    return price(setting, cell.megatron, cell.seq_len, hw, actions=prof.action_costs(),
                 state_bytes_per_param=MEGATRON_STATE_BYTES, extra_layer_bytes=extra,
                 blocking_p2p=True, kv_prefix_copy=kv_copy)  # fmt: skip


@dataclass(frozen=True)
class PlannerCell:
    """The planner's prediction of a cell as Megatron ran it (GiB): the allocated peak, the
    fork's K/V prefix copy in it, the SP gather buffer, the backward's transient, the
    allocator's slack, and their total (what ``max_memory_reserved`` reports)."""

    allocated: float
    kv_copy: float
    gather: float
    transient: float
    allocator: float
    fits: bool

    @property
    def total(self) -> float:
        return self.allocated + self.gather + self.transient + self.allocator


def planner_same_model(cell: Cell, prof: GpuProfile,
                       saved: SavedTensors = TORCH_EAGER_CPU) -> float | None:  # fmt: skip
    """The planner's rank-0 peak (GiB) for the dry run's own model and trainer: SwiGLU,
    torch's schedules (posted P2P), 8 bytes of state a parameter, the loss in 16 chunks, the
    tensors ``saved`` describes (default: the dry run's, torch's eager ops on the CPU;
    :data:`~seq1f1b.planning.saved.FUSED` is the formula before the recalibration); None
    where it refuses."""
    sched, v, k = cell.registry
    setting = Setting(cell.pp, cell.tp, 1, k, cell.microbatches, "compute", False, True, sched, v)
    try:
        cand = price(setting, model_shape(cell.cfg), cell.seq_len,
                     prof.hardware(cell.pp * cell.tp, 0.0), actions=prof.action_costs(),
                     state_bytes_per_param=DRY_STATE_BYTES, saved=saved,
                     loss_chunks=16)  # fmt: skip
    except ValueError:
        return None
    return cand.peak_bytes[0] / GIB


_NO_PLAN = PlannerCell(0.0, 0.0, 0.0, 0.0, 0.0, False)


def planner_cell(cell: Cell, prof: GpuProfile) -> PlannerCell | None:
    """:func:`~benchmarks.planner_models.published.memory_rows`' total, at any cell; None
    where the planner's simulator refuses the order (blocking P2P deadlocks at pp 2)."""
    layer_extra = sum(megatron_layer_items(cell.megatron, cell.tp).values())
    try:
        cand = _megatron_price(cell, prof, layer_extra, True)
        no_copy = _megatron_price(cell, prof, layer_extra, False)
    except ValueError:
        return None
    gather = sp_gather_bytes(cand, cell.megatron) / GIB
    transient = sp_backward_transient_bytes(cand, cell.megatron, cell.tp) / GIB
    state_model = MemoryModel(cell.megatron, cell.tp, state_bytes_per_param=MEGATRON_STATE_BYTES)
    layers = cell.megatron.n_layers // cell.pp
    worst = cand.worst_stage
    state = state_model.state_bytes(layers, worst == 0, worst == cell.pp - 1) / GIB
    allocated = cand.max_bytes / GIB
    allocator = allocator_slack() * (allocated + gather + transient - state)
    budget = prof.memory_gb * GB - prof.reserve_gb * GB
    return PlannerCell(allocated, (cand.max_bytes - no_copy.max_bytes) / GIB, gather, transient,
                       allocator, cand.max_bytes <= budget)  # fmt: skip


def megatron_items(report: RankReport, cell: Cell, planner: PlannerCell) -> dict[str, float]:
    """What Megatron-LM holds beyond the dry run's peak, item by item (GiB; negative: less):

    * model state: 18 bytes a parameter (bf16 weights, fp32 gradient buffer, fp32 master
      weights and Adam moments, distributed optimizer at DP 1) against the dry run's
      parameters, gradients and optimizer state as held at its peak;
    * per layer, what a token in flight saves (:func:`dry_layer_items` against
      :func:`megatron_layer_bytes`): the FFN (GELU of 4H against SwiGLU), the sequence-
      parallel matmul inputs (shards against torch's gathered copies), the norms (fused, bf16,
      against eager RMSNorm's fp32 upcast), the output projection's input copy, RoPE's
      factors, the dropout masks; scaled by the dry run's token-layers in flight at its peak
      (its saved activations over its itemized bytes per token-layer);
    * what the planner prices for the fork beside that: its K/V prefix copy, the SP gather
      buffer, the backward's transient (in place of the dry run's eager temporaries), and the
      caching allocator's slack (a fraction of the activations, read from torchtitan's
      published cell, applied to Megatron's)."""
    peak = report.peak
    params = peak.parameters / 2.0
    state_here = peak.parameters + peak.gradients + peak.optimizer
    ours = dry_layer_items(cell.cfg, cell.tp)
    theirs = megatron_layer_bytes(cell.megatron, cell.tp)
    token_layers = peak.activations / sum(ours.values())
    h = cell.cfg.dim
    per_token = {
        "FFN: GELU 4H vs SwiGLU": theirs["GELU FFN: fc1 output, GELU output"]
        - ours["SwiGLU: w1, w3, silu, product"],
        "SP matmul inputs: shards vs gathered": 2 * 2.0 * h / cell.tp
        - ours["gathered norm outputs (whole sequence)"],
        "norms: fused bf16 vs eager fp32": 2 * 2.0 * h / cell.tp
        - ours["norms: fp32 input + normalized (shards)"],
        "wo input: no copy at b=1": theirs["attention output copy"]
        - ours["attention output reshaped for wo"],
        "RoPE factors": theirs["RoPE factors"] - ours["RoPE cos/sin"],
        "dropout masks": theirs["dropout masks"],
    }
    items = {"model state: 18 B/param vs 8": (MEGATRON_STATE_BYTES * params - state_here) / GIB}
    items.update({k: v * token_layers / GIB for k, v in per_token.items()})
    items["K/V prefix copy (fork)"] = planner.kv_copy
    items["SP gather buffer + bwd transient"] = planner.gather + planner.transient
    # the eager backward's temporaries at the peak (attention and prefix gradients, casts),
    # in the fork's place its fused kernels' transient (the item above)
    items["eager bwd temporaries (dry run)"] = -peak.temporaries / GIB
    megatron_acts = (peak.activations + peak.kv_cache + peak.receives) / GIB + sum(
        items[k] for k in (*per_token, "K/V prefix copy (fork)"))  # fmt: skip
    items["allocator slack (reserved)"] = allocator_slack() * megatron_acts
    return items


def _fmt_row(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join([_fmt_row(head, widths), *(_fmt_row(r, widths) for r in rows)])


def _segmented(cell: Cell) -> bool:
    """Whether the cell's schedule cuts samples into segments (the Seq1F1B family)."""
    return lookup(SCHEDULES[cell.schedule][0]).seq_chunked


def _plain_looped(cell: Cell) -> bool:
    """Whether the cell's schedule is torch's one-stage-per-rank baseline (1F1B)."""
    name, stages, _ = SCHEDULES[cell.schedule]
    return is_baseline(name) and stages == 1


def _published(cell: Cell) -> tuple[float | None, str]:
    """The published figure of ``cell`` (GiB, 7B at 64k only) and how it prints."""
    if cell.model == "7B" and cell.seq_len == 65536:
        value = PUBLISHED_MEMORY_64K[cell.schedule]
        return value, f"{value:.1f}"
    if cell.model == "7B" and cell.seq_len == 131072:
        return None, "runs" if _segmented(cell) else "OOM"
    if cell.model == "30B":
        return None, "30B: " + ("fits" if _segmented(cell) else "OOM")
    return None, "-"


def report(cells: Sequence[Cell], reports: Sequence[RankReport], seconds: Sequence[float]) -> str:
    """The headline table and the attribution, as printed."""
    prof = profile(GPU)
    budget = (prof.memory_gb - prof.reserve_gb) * GB / GIB
    head = ["model", "tokens", "schedule", "state", "activ.", "K/V", "temp", "dry run GiB",
            "fits", "+ Megatron items", "fits", "published", "planner", "dry+items / pub",
            "planner / pub", "planner, this model", "dry / planner", "dry run s"]  # fmt: skip
    rows, attributions = [], []
    for cell, rep, secs in zip(cells, reports, seconds, strict=True):
        p = rep.peak
        plan = planner_cell(cell, prof)
        items = megatron_items(rep, cell, plan or _NO_PLAN)
        same = planner_same_model(cell, prof)
        adjusted = p.total / GIB + math.fsum(items.values())
        published, pub = _published(cell)
        rows.append([cell.model, f"{cell.seq_len // 1024}k", cell.schedule,
                     f"{(p.parameters + p.gradients + p.optimizer) / GIB:.1f}",
                     f"{p.activations / GIB:.1f}", f"{(p.kv_cache + p.receives) / GIB:.1f}",
                     f"{p.temporaries / GIB:.1f}", f"{p.total / GIB:.1f}",
                     "yes" if p.total / GIB <= budget else "NO", f"{adjusted:.1f}",
                     "yes" if adjusted <= budget else "NO", pub,
                     f"{plan.total:.1f}" if plan else "n/a",
                     f"{adjusted / published:.2f}" if published else "-",
                     f"{plan.total / published:.2f}" if published and plan else "-",
                     f"{same:.1f}" if same else "n/a",
                     f"{p.total / GIB / same:.2f}" if same else "-", f"{secs:.0f}"])  # fmt: skip
        attributions.append([cell.model, f"{cell.seq_len // 1024}k", cell.schedule,
                             f"{p.total / GIB:.1f}", *(f"{v:+.1f}" for v in items.values()),
                             f"{adjusted:.1f}", pub,
                             f"{published - adjusted:+.1f}" if published else "-"])  # fmt: skip
    names = list(megatron_items(reports[0], cells[0], _NO_PLAN))
    cell0 = cells[0]
    ours = dry_layer_items(cell0.cfg, cell0.tp)
    theirs = megatron_layer_bytes(cell0.megatron, cell0.tp)
    per_layer = (
        f"bytes per token-layer on a TP rank ({cell0.model}, tp {cell0.tp}): dry-run model "
        f"{sum(ours.values()):.0f} (" + ", ".join(f"{k} {v:.0f}" for k, v in ours.items())
        + f"); Megatron {sum(theirs.values()):.0f} ("
        + ", ".join(f"{k} {v:.0f}" for k, v in theirs.items()) + ")"
    )  # fmt: skip
    checks = []
    for cell, rep in zip(cells, reports, strict=True):
        if _plain_looped(cell):  # rank 0 holds pp microbatches' forwards at its peak
            layers = cell.cfg.n_layers // cell.pp
            measured = rep.peak.activations / (cell.pp * cell.seq_len * layers)
            formula = sum(dry_layer_items(cell.cfg, cell.tp).values())
            checks.append(f"{cell.model} {cell.seq_len // 1024}k: {measured:.0f} measured "
                          f"against {formula:.0f} itemized")  # fmt: skip
    if checks:
        per_layer += ("\n1F1B rank 0, activations / (pp x tokens x layers), bytes per "
                      "token-layer: " + "; ".join(checks))  # fmt: skip
    attribution_head = ["model", "tokens", "schedule", "dry run", *names, "= dry+items",
                        "published", "left"]  # fmt: skip
    out = [
        f"Peak memory per GPU, GiB, pipeline rank 0 ({GPU}: fits = at most {budget:.1f} GiB, "
        "the planner's budget less its reserve); published: the paper's max_memory_reserved",
        _table(head, rows),
        "",
        "What Megatron-LM holds beyond the dry run, item by item (GiB; left: published less "
        "dry run + items):",
        _table(attribution_head, attributions),
        "",
        per_layer,
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dry_run.paper",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny model, pp 2 x tp 2 (smoke)")
    ap.add_argument(
        "--only", default=None, help="models or lengths to run, comma-separated (7B, 30B, 65536)"
    )
    ap.add_argument("--workers", type=int, default=1, help="cells dry-run at once")
    ap.add_argument("--save", default=None, help="pickle the cells' reports to this file")
    ap.add_argument("--load", default=None, help="print the table of a --save file, no run")
    args = ap.parse_args(argv)
    if args.load:
        with open(args.load, "rb") as f:
            cells, reports = pickle.load(f)
        print(report(cells, reports, [r.host_s for r in reports]))
        return 0
    cells = paper_cells(args.quick)
    if args.only:
        keep = set(args.only.split(","))
        cells = [c for c in cells if c.model in keep or str(c.seq_len) in keep]
    start = time.perf_counter()
    reports = dry_run_isolated([c.job() for c in cells], args.workers)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump((cells, reports), f)
    print(report(cells, reports, [r.host_s for r in reports]))
    print(f"(dry runs: {time.perf_counter() - start:.0f} s in all; 'dry run s': each rank's step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
