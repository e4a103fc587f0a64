"""Simulated bubble and activation memory at the paper's sizes, next to the closed forms.

Why: the paper's claims are about 7B models at 32k-64k tokens on 4-8 stages; this machine cannot
run that, but the cost model can run the exact orders at that size in seconds. Each row runs one
schedule's real order twice: with equal-cost units (to check against the closed-form bubble)
and with causal-attention FLOPs per segment (to see the uniform split's imbalance and what the
compute-balanced split recovers).
"""

from __future__ import annotations

from typing import Any

from seq1f1b._runtime import Action, ComputationType
from seq1f1b.planning.costmodel import PRESETS as PLANNER_PRESETS
from seq1f1b.planning.simulate import FlopsCosts, SimResult, simulate
from seq1f1b.registry import is_baseline, lookup
from seq1f1b.schedules.partition import ModelShape, resolve_split

from ..harness.pipeline_orders import ScheduleSpec, pipeline_order

__all__ = [
    "PAPER_SHAPE",
    "ZB_8B",
    "formula_bubble",
    "formula_memory",
    "paper_specs",
    "simulate_spec",
    "simulation_table",
    "zero_bubble_8b_ratios",
]

# 7B-like: Llama-7B widths with the paper's vocabulary and FFN = 4H (REFERENCE section 1).
PAPER_SHAPE = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=50304)


def formula_bubble(spec: ScheduleSpec) -> float | None:
    """Closed-form idle fraction with equal costs; None where there is no simple form."""
    f = spec.entry.bubble_formula
    return (
        None if f is None else f(spec.pp, spec.microbatches, spec.seq_chunks, spec.stages_per_rank)
    )


def formula_memory(spec: ScheduleSpec) -> float | None:
    """Closed-form peak activations on rank 0 (= stage 0), in units of one sample's (A)."""
    f = spec.entry.memory_formula
    return (
        None if f is None else f(spec.pp, spec.microbatches, spec.seq_chunks, spec.stages_per_rank)
    )


def _equal_cost(spec: ScheduleSpec):
    """Equal-cost units with the backward cost the schedule's published formula assumes."""
    unit = 1.0 / (spec.stages_per_rank * spec.seq_chunks)
    backward = spec.entry.formula_backward_cost

    def cost(a: Action) -> float:
        if a.computation_type == ComputationType.FULL_BACKWARD:
            return backward * unit
        return unit

    return cost


def simulate_spec(
    spec: ScheduleSpec, shape: ModelShape, seq_len: int, split: str = "compute"
) -> tuple[SimResult, FlopsCosts]:
    """Simulate ``spec`` with FLOPs costs of ``shape`` at ``seq_len`` (split for Seq1F1B)."""
    k = spec.seq_chunks if spec.entry.seq_chunked else 1
    lengths = resolve_split(split, seq_len, k, shape=shape) if k > 1 else [seq_len]
    costs = FlopsCosts(shape, tuple(lengths), spec.model_stages, spec.pp)
    order = pipeline_order(spec)
    res = simulate(order, costs.cost, activation=costs.activation, replicas=spec.replicas)
    return res, costs


def paper_specs(pp: int, m: int) -> list[tuple[ScheduleSpec, str]]:
    """The compared schedules at one (pp, M): torch's five, BitPipe, Seq1F1B K=2/4/8 both
    splits, interleaved Seq1F1B."""
    out: list[tuple[ScheduleSpec, str]] = [
        (ScheduleSpec(name, pp, m), "-")
        for name in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "BitPipe")
    ]
    for k in (2, 4, 8):
        for split in ("uniform", "compute"):
            out.append((ScheduleSpec("Seq1F1B", pp, m, k), split))
    out.append((ScheduleSpec("InterleavedSeq1F1B", pp, m, 4), "compute"))
    out += [(ScheduleSpec("ZBSeq1F1B", pp, m, k), "compute") for k in (4, 8)]
    return out


def simulation_table(
    pps: tuple[int, ...] = (4, 8),
    microbatches: tuple[int, ...] = (8, 16),
    seq_lens: tuple[int, ...] = (32768, 65536),
    shape: ModelShape = PAPER_SHAPE,
) -> list[dict[str, Any]]:
    """One row per (pp, M, seq_len, schedule, split); see the module docstring."""
    rows: list[dict[str, Any]] = []
    for pp in pps:
        for m in microbatches:
            for seq_len in seq_lens:
                group: list[dict[str, Any]] = []
                for spec, split in paper_specs(pp, m):
                    row: dict[str, Any] = {
                        "schedule": spec.name,
                        "label": spec.label + (f" {split}" if split != "-" else ""),
                        "pp": pp,
                        "microbatches": m,
                        "seq_chunks": spec.seq_chunks,
                        "split": None if split == "-" else split,
                        "seq_len": seq_len,
                        "formula_bubble_ratio": formula_bubble(spec),
                        "formula_peak_activation_rank0": formula_memory(spec),
                    }
                    try:
                        res, costs = simulate_spec(spec, shape, seq_len, split)
                        equal = simulate(
                            pipeline_order(spec), _equal_cost(spec), replicas=spec.replicas
                        )
                    except ValueError as exc:  # torch refuses this size (e.g. DualPipeV M < 2pp)
                        row["error"] = str(exc).splitlines()[0]
                        group.append(row)
                        continue
                    row.update(
                        segment_lengths=list(costs.lengths),
                        bubble_ratio=res.bubble_ratio,
                        bubble_ratio_equal_cost=equal.bubble_ratio,
                        makespan_flops=res.makespan,
                        peak_activation_rank0=res.peak_activation_rank[0],
                        peak_activation_ranks=[
                            res.peak_activation_rank[r] for r in sorted(res.peak_activation_rank)
                        ],
                    )
                    group.append(row)
                base = next(r["makespan_flops"] for r in group if is_baseline(r["schedule"]))
                for r in group:
                    if "makespan_flops" in r:
                        r["time_vs_1f1b"] = r["makespan_flops"] / base
                rows.extend(group)
    return rows


#: the 8B setting of the zero-bubble comparison: pp, microbatches, tokens per sample
ZB_8B = (8, 8, 32768)


def zero_bubble_8b_ratios() -> dict[str, float]:
    """Simulated step time vs 1F1B at the Llama-3 8B shape (pp=8, M=8, 32k tokens, compute
    split) of the zero-bubble schedules next to Seq1F1B and torch's ZBV."""
    pp, m, seq = ZB_8B
    shape = PLANNER_PRESETS["llama3-8b"]
    runs = (
        ("1F1B", 1),
        ("ZBVZeroBubble", 1),
        ("Seq1F1B", 8),
        ("ZBSeq1F1B", 8),
        ("ZBVSeq1F1B", 8),
        ("ZBVSeq1F1B", 16),
    )
    times = {}
    for name, k in runs:
        res, _ = simulate_spec(ScheduleSpec(name, pp, m, k), shape, seq)
        times[f"{name} K={k}" if lookup(name).seq_chunked else name] = res.makespan
    return {label: t / times["1F1B"] for label, t in times.items()}
