"""Units in flight per stage: the closed form against what a measured run held.

Why: the formulas (``min(MK, p-s+K-1)`` with one stage per rank, ``min(MK, 2p-1-s+K)`` in the
V) are what the planner and the docs promise about memory; the measured count checks them on
the real runs. Measured: a stage's peak saved bytes over the bytes one forward left saved.
"""

from __future__ import annotations

from typing import Any

from seq1f1b.orders.order import looped_stage_peak_units as looped_peak_units
from seq1f1b.orders.order_v import v_stage_peak_units as v_peak_units
from seq1f1b.registry import lookup

__all__ = ["memory_bound_rows"]


def memory_bound_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage of each Seq1F1B-family run with a closed form: units in flight by the formula
    and as measured (the stage's peak saved bytes over the bytes one forward left saved)."""
    rows = []
    for r in runs:
        entry = lookup(r["schedule"])
        if not entry.seq_chunked or entry.replicas != 1:
            continue
        pp, m, k = r["pp"], r["microbatches"], r["seq_chunks"]
        if entry.placement == "v":
            formula = v_peak_units
        elif entry.stages_per_rank == 1:
            formula = looped_peak_units
        else:
            continue
        for s, measured in enumerate(r.get("units_in_flight") or []):
            rows.append(
                {
                    "label": r["label"],
                    "stage": s,
                    "formula_units": formula(pp, m, k, s),
                    "measured_units": measured,
                    "peak_bytes": r["peak_activation_bytes"][s],
                }
            )
    return rows
