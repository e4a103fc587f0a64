"""The longest sequence each schedule fits under a fixed activation-memory budget.

Why: memory, not time, is what stops long-sequence training; "how long a sequence fits" is the
user-facing form of a peak-memory ratio.

Method: saved activations are linear in the sequence length here (flash-style attention keeps
O(S) state, no S x S matrices), so each schedule's peak (max over stages) is measured at a few
lengths, fitted by least squares ``peak(S) = a + b*S``, and solved for the budget; the answer
is then run once more at that length to check that the measured peak stays within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["fit_line", "longest_fit"]


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
        pts = [(r["seq_len"], max(r["peak_activation_bytes"])) for r in runs]
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
