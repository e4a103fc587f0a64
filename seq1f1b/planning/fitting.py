"""Fit a profile's efficiencies to measurements: one fit for every profile.

Why: a profile's specifications come from datasheets, its efficiencies (what fraction of the
peak its kernels and links reach, a fixed cost per action) from measurements. The GPU profiles
are fitted to published TFLOPS cells (:func:`benchmarks.planner_models.published.fit`), the
CPU profile to the actions measured on this machine (:func:`cpu_profile`); both go through
:func:`fit_efficiency`, so both are priced by the same model
(:meth:`~seq1f1b.planning.profiles.GpuProfile.action_costs`) and fitted the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from .calibration import KINDS, Sample, fit_action_costs
from .costmodel import ActionCosts
from .profiles import Efficiency, GpuProfile

__all__ = [
    "BOUNDS",
    "PARAMETERS",
    "Observation",
    "action_observations",
    "cpu_profile",
    "fit_efficiency",
    "held_out_errors",
    "largest_error",
    "pattern_search",
    "relative_errors",
]

#: the fitted fields of :class:`~seq1f1b.planning.profiles.Efficiency`, in the search's order
PARAMETERS = ("linear", "attention", "overhead_s", "collectives", "p2p")
#: each parameter's physical range: fractions of a peak in (0, 1], seconds per action
BOUNDS: dict[str, tuple[float, float]] = {
    "linear": (0.05, 1.0),
    "attention": (0.05, 1.0),
    "overhead_s": (1e-4, 0.2),
    "collectives": (0.05, 1.0),
    "p2p": (0.01, 1.0),
}
#: where the search starts, whatever the profile holds: neutral, not a guess of the answer
START: dict[str, float] = {
    "linear": 0.5,
    "attention": 0.5,
    "overhead_s": 0.01,
    "collectives": 0.8,
    "p2p": 0.8,
}


@dataclass(frozen=True)
class Observation:
    """One measured value and how a profile predicts it (``predict``), named by ``label``."""

    label: str
    predict: Callable[[GpuProfile], float]
    measured: float


def relative_errors(prof: GpuProfile, observations: Sequence[Observation]) -> list[float]:
    """``predicted / measured - 1`` of every observation on ``prof``."""
    return [o.predict(prof) / o.measured - 1 for o in observations]


def fit_efficiency(
    prof: GpuProfile,
    observations: Sequence[Observation],
    *,
    fixed: Mapping[str, float] | None = None,
    rounds: int = 8,
    source: str | None = None,
) -> Efficiency:
    """Efficiencies of ``prof`` that minimise the squared relative errors of ``observations``:
    a pattern search in log space over :data:`PARAMETERS` (halving its step ``rounds`` times
    from a factor e**0.5), each within :data:`BOUNDS`; ``fixed`` parameters keep the given
    value (what no observation can see, e.g. links on one machine). The result keeps
    ``prof``'s stated ``error`` / ``error_source``."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(PARAMETERS)
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)}: use {', '.join(PARAMETERS)}")
    if not observations:
        raise ValueError("no observations to fit")
    if any(o.measured <= 0 for o in observations):
        raise ValueError("every measured value must be > 0")
    free = [i for i, p in enumerate(PARAMETERS) if p not in fixed]
    start = [fixed.get(p, START[p]) for p in PARAMETERS]

    def loss(v: list[float]) -> float:
        trial = prof.with_efficiency(Efficiency(*v, "fit"))
        return math.fsum(e * e for e in relative_errors(trial, observations))

    x = pattern_search(loss, start, [BOUNDS[p] for p in PARAMETERS], free, rounds=rounds)
    e0 = prof.efficiency
    labels = [o.label for o in observations]
    text = source or (
        "fitted on " + ", ".join(labels) if len(labels) <= 8 else f"fitted on {len(labels)} values"
    )
    return Efficiency(*x, text, e0.error, e0.error_source)


def pattern_search(
    loss: Callable[[list[float]], float],
    start: Sequence[float],
    bounds: Sequence[tuple[float, float]],
    free: Sequence[int],
    *,
    rounds: int = 8,
    tolerance: float = 1e-12,
) -> list[float]:
    """The point near ``start`` where ``loss`` is least: for each index in ``free``, multiply or
    divide it by e**step while that lowers ``loss`` by more than ``tolerance``, within its
    ``bounds``; then halve the step (from 0.5), ``rounds`` times. Log-space, so fractions
    and seconds alike move by ratios."""
    x = list(start)
    best = loss(x)
    step = 0.5
    for _ in range(rounds):
        improved = True
        while improved:
            improved = False
            for i in free:
                lo, hi = bounds[i]
                for sign in (1.0, -1.0):
                    y = list(x)
                    y[i] = min(hi, max(lo, x[i] * math.exp(sign * step)))
                    if y[i] != x[i] and (val := loss(y)) < best - tolerance:
                        x, best, improved = y, val, True
        step /= 2
    return x


def action_observations(samples: Sequence[Sample]) -> list[Observation]:
    """Each measured action as an observation: its seconds against the profile's price of
    the action (:meth:`~seq1f1b.planning.profiles.GpuProfile.action_costs`); the
    observations of one profile share its priced constants."""
    last: list[tuple[GpuProfile, ActionCosts]] = []  # the profile priced last, held

    def predictor(s: Sample) -> Callable[[GpuProfile], float]:
        kind = KINDS[s.kind]

        def predict(prof: GpuProfile) -> float:
            if not last or last[0][0] is not prof:
                last[:] = [(prof, prof.action_costs())]
            return last[0][1].of(kind).seconds(s.work)

        return predict

    return [Observation(f"{s.run} {s.kind}", predictor(s), s.seconds) for s in samples]


def _run_total(costs: ActionCosts, samples: Sequence[Sample]) -> float:
    return math.fsum(costs.of(KINDS[s.kind]).seconds(s.work) for s in samples)


def held_out_errors(
    prof: GpuProfile, samples: Sequence[Sample], *, per_action: bool = False
) -> dict[str, float]:
    """Per measured run, the relative error of its total action time predicted by a fit that
    never saw that run's actions: the efficiencies (:func:`fit_efficiency`, links fixed), or
    with ``per_action`` the per-kind least-squares constants
    (:func:`~seq1f1b.planning.calibration.fit_action_costs`). Empty with fewer than two
    runs: nothing to hold out."""
    runs = sorted({s.run for s in samples})
    if len(runs) < 2:
        return {}
    out = {}
    for run in runs:
        seen = [s for s in samples if s.run != run]
        held = [s for s in samples if s.run == run]
        if per_action:
            costs = fit_action_costs(seen, f"without {run}")
        else:
            eff = fit_efficiency(prof, action_observations(seen), fixed=_LINKS_FIXED)
            costs = prof.with_efficiency(eff).action_costs()
        out[run] = _run_total(costs, held) / math.fsum(s.seconds for s in held) - 1
    return out


#: one machine has no links between its ranks worth a parameter: the CPU profile does not
#: price them (no inter-node link, gloo's copies are in the measured actions)
_LINKS_FIXED = {"collectives": 1.0, "p2p": 1.0}


def cpu_profile(
    samples: Sequence[Sample], spec: GpuProfile, *, held_out: bool = True
) -> GpuProfile:
    """The measured machine ``spec`` (:func:`~seq1f1b.planning.profiles.machine_spec`), its
    efficiencies (linear, attention, per-action overhead) fitted by :func:`fit_efficiency` to
    its measured actions (``python -m benchmarks.planner_models.time_costs`` saves them),
    links fixed; its error is the largest held-out run's (:func:`held_out_errors`), or "not
    demonstrated" with fewer than two runs. ``held_out=False`` skips those refits (one per
    run) and leaves the error "not demonstrated"."""
    runs = len({s.run for s in samples})
    eff = fit_efficiency(
        spec,
        action_observations(samples),
        fixed=_LINKS_FIXED,
        source=f"fitted on {len(samples)} measured actions of {runs} runs; {spec.source}",
    )
    error, error_source = largest_error(held_out_errors(spec, samples) if held_out else {})
    return spec.with_efficiency(replace(eff, error=error, error_source=error_source))


def largest_error(held: Mapping[str, float]) -> tuple[float, str]:
    """The error a profile states from :func:`held_out_errors`: the largest, and where it
    comes from; "not demonstrated" (and the default 7%) without held-out runs."""
    if not held:
        return 0.07, "not demonstrated (fewer than two measured runs)"
    worst = max(held, key=lambda r: abs(held[r]))
    error = abs(held[worst])
    return error, (
        f"the largest error of a held-out run's total action time, {error:.1%} ({worst}; "
        f"fitted without its actions, {len(held)} runs)"
    )
