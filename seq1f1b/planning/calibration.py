"""Fit the time model's constants to measured per-action times.

Why: the hardware figures (FLOPs over an achieved throughput) price neither what short
segments cost real kernels nor the fixed cost of every action (launches, Python, hooks), so
they overrate many small units. Measuring the actions of a real run and fitting, per kind of
action (F, B, I, W), seconds per linear FLOP, per attention FLOP, per element of elementwise
work, per module run and a fixed overhead (:class:`seq1f1b.planning.costmodel.Coefficients`) gives a
time model whose predictions can be checked against measured step times
(``python -m benchmarks.planner_models.time_costs``).

The fit is non-negative least squares on relative errors (every action counts alike, short or
long): with five constants, every subset of them is solved exactly and the best one whose
constants are all >= 0 is kept.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from .._runtime import ir as rt
from .costmodel import ActionCosts, Coefficients, Work

__all__ = [
    "KINDS",
    "Sample",
    "fit_action_costs",
    "fit_coefficients",
    "load_action_costs",
    "load_calibration",
    "save_action_costs",
]

#: the kinds of action a calibration measures, by the letter a trace names them with
KINDS = {"F": rt.FORWARD, "B": rt.FULL_BACKWARD, "I": rt.BACKWARD_INPUT, "W": rt.BACKWARD_WEIGHT}


@dataclass(frozen=True)
class Sample:
    """One measured action: its kind (``"F"``, ``"B"``, ``"I"``, ``"W"``), its forward work,
    the seconds it took and the run it belongs to (for fits that leave a run out)."""

    kind: str
    work: Work
    seconds: float
    run: str = ""


_N = 5  # linear, attention, elements, overhead, per module (Coefficients' order)


def _features(w: Work) -> tuple[float, ...]:
    return (w.linear, w.attention, w.elements, 1.0, w.modules)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_coefficients(samples: Sequence[Sample]) -> Coefficients:
    """Non-negative least-squares constants of one kind of action (relative errors)."""
    if not samples:
        raise ValueError("no samples to fit")
    rows = [_features(s.work) for s in samples]
    ys = [s.seconds for s in samples]
    if any(y <= 0 for y in ys):
        raise ValueError("every measured time must be > 0")
    # scale each feature to unit magnitude so the normal equations are well conditioned
    scale = [max((abs(r[j]) for r in rows), default=0.0) or 1.0 for j in range(_N)]
    x = [[r[j] / scale[j] / y for j in range(_N)] for r, y in zip(rows, ys, strict=True)]
    best: tuple[float, list[float]] | None = None
    for size in range(1, _N + 1):
        for cols in itertools.combinations(range(_N), size):
            if all(max(abs(row[j]) for row in x) == 0 for j in cols):
                continue
            ata = [[math.fsum(row[i] * row[j] for row in x) for j in cols] for i in cols]
            atb = [math.fsum(row[i] for row in x) for i in cols]
            sol = _solve(ata, atb)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * _N
            for j, v in zip(cols, sol, strict=True):
                coef[j] = v
            err = math.fsum(
                (sum(c * v for c, v in zip(coef, row, strict=True)) - 1) ** 2 for row in x
            )
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    if best is None:
        raise ValueError("no non-negative fit: the samples carry no work")
    c = [v / scale[j] for j, v in enumerate(best[1])]
    return Coefficients(*c)


def fit_action_costs(
    samples: Iterable[Sample], source: str = "calibrated", precision: str | None = None
) -> ActionCosts:
    """Constants for every kind measured; I and W fall back to half of B when not measured.
    ``precision``: the dtype the samples ran in (:attr:`ActionCosts.precision`)."""
    by_kind: dict[str, list[Sample]] = {}
    for s in samples:
        if s.kind not in KINDS:
            raise ValueError(f"unknown action kind {s.kind!r}: use one of {sorted(KINDS)}")
        by_kind.setdefault(s.kind, []).append(s)
    if "F" not in by_kind or ("B" not in by_kind and not {"I", "W"} <= by_kind.keys()):
        raise ValueError("need forward and backward samples (B, or both I and W)")
    fits = {k: fit_coefficients(v) for k, v in by_kind.items()}
    backward = fits.get("B") or fits["I"].plus(fits["W"])
    return ActionCosts(fits["F"], backward, fits.get("I"), fits.get("W"), source, precision)


def save_action_costs(
    costs: ActionCosts, path: str, samples: Sequence[Sample] | None = None
) -> None:
    """Write ``costs`` as JSON, with the measured ``samples`` they were fitted on (what a
    profile's efficiencies are fitted on: :func:`seq1f1b.planning.fitting.cpu_profile`)."""
    doc = asdict(costs)
    if samples is not None:
        doc["samples"] = [asdict(s) for s in samples]
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def load_action_costs(path: str) -> ActionCosts:
    """Read what :func:`save_action_costs` wrote."""
    return load_calibration(path)[0]


def load_calibration(path: str) -> tuple[ActionCosts, list[Sample]]:
    """The constants and the measured actions :func:`save_action_costs` wrote, from one read
    of the file (samples empty if it wrote none)."""
    with open(path) as f:
        doc = json.load(f)

    def coef(d: dict | None) -> Coefficients | None:
        return None if d is None else Coefficients(**d)

    forward, backward = coef(doc["forward"]), coef(doc["backward"])
    if forward is None or backward is None:
        raise ValueError(f"{path}: needs forward and backward constants")
    costs = ActionCosts(
        forward,
        backward,
        coef(doc.get("backward_input")),
        coef(doc.get("backward_weight")),
        doc.get("source", path),
        doc.get("precision"),
    )
    samples = [
        Sample(d["kind"], Work(**d["work"]), d["seconds"], d.get("run", ""))
        for d in doc.get("samples", ())
    ]
    return costs, samples
