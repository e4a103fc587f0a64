"""The longest sequence each schedule fits under a fixed activation-memory budget.

Why: memory, not time, is what stops long-sequence training; "how long a sequence fits" is the
user-facing form of a peak-memory ratio.

Method: saved activations are nearly linear in the sequence length here (flash-style attention
keeps O(S) state, no S x S matrices), so each schedule's peak (max over stages) is measured at a
few lengths, fitted by least squares ``peak(S) = a + b*S``, and solved for the budget. Not
exactly linear for the compute-balanced split (its first, longest segment grows faster than S),
so the answer is run again at that length and, if it is over the budget, stepped down by the
overshoot and run again (at most twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["budget_rows", "fit_line", "longest_fit", "verify_rows"]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b*x``; returns (a, b, worst relative residual)."""
    n = len(points)
    if n < 2:
        raise ValueError("fit_line needs at least two points")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("fit_line needs two different x values")
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in points if y)
    return a, b, worst


def longest_fit(a: float, b: float, budget: float, granule: int) -> int:
    """Largest multiple of ``granule`` with ``a + b*S <= budget`` (0 if none)."""
    if b <= 0:
        raise ValueError("peak memory must grow with the sequence length")
    return max(0, int((budget - a) / b) // granule * granule)


def budget_rows(
    fits: dict[str, list[dict[str, Any]]], budget: float, granule: int
) -> list[dict[str, Any]]:
    """Per schedule: fit, predicted longest length (verification filled in later)."""
    rows = []
    for label, runs in fits.items():
        pts = [(r["seq_len"], max(r["peak_activation_rank_bytes"])) for r in runs]
        a, b, worst = fit_line(pts)
        rows.append(
            {
                "label": label,
                "fit_points": pts,
                "bytes_per_token": b,
                "fixed_bytes": a,
                "fit_worst_residual": worst,
                "longest_seq_len": longest_fit(a, b, budget, granule),
                "budget_bytes": budget,
            }
        )
    return rows


def verify_rows(
    rows: list[dict[str, Any]],
    measure_peaks: Callable[[dict[str, int]], dict[str, float]],
    budget: float,
    granule: int,
    corrections: int = 2,
) -> None:
    """Measure each row's answer; step down over-budget answers by their overshoot."""
    pending = {row["label"]: row for row in rows}
    for attempt in range(corrections + 1):
        peaks = measure_peaks({label: row["longest_seq_len"] for label, row in pending.items()})
        nxt = {}
        for label, row in pending.items():
            row["verified_peak_bytes"] = peaks[label]
            row["verified_within_budget"] = peaks[label] <= budget
            row["verify_runs"] = attempt + 1
            if peaks[label] > budget and attempt < corrections:
                steps = math.ceil((peaks[label] - budget) / row["bytes_per_token"] / granule)
                row["longest_seq_len"] -= max(1, steps) * granule
                nxt[label] = row
        pending = nxt
        if not pending:
            return
