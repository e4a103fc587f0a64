"""An independent check of the benchmarks' replayed step time: each rank's measured actions
(their CPU times) run again in the order the rank ran them, on a plain dependency walk written
here, not through the planner's simulator (``benchmarks.harness.cpu_replay``) that the
benchmarks use, with the bounds any schedule's step obeys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Event = Mapping[str, Any]  # a measured action: rank, stage, kind (F/B/I/W), mb, start, end, cpu


def critical_path(events: Iterable[Event]) -> float:
    """Makespan of the measured step: a rank runs its actions one at a time in the order it
    ran them; ``F(s, u)`` waits for ``F(s-1, u)``; ``B``/``I(s, u)`` for ``F(s, u)`` and the
    input gradient of stage ``s+1`` (its ``B`` or ``I``); ``W(s, u)`` for ``I(s, u)``;
    communication is free. Raises on a deadlock (an order its dependencies cannot run)."""
    ranks: dict[int, list[Event]] = {}
    for ev in events:
        ranks.setdefault(ev["rank"], []).append(ev)
    queues = {r: sorted(evs, key=lambda ev: ev["start"]) for r, evs in ranks.items()}
    last = max(ev["stage"] for evs in queues.values() for ev in evs)
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(queues, 0.0)
    at = dict.fromkeys(queues, 0)

    def needs(ev: Event) -> list[tuple[int, str, int]] | None:
        s, kind, u = ev["stage"], ev["kind"], ev["mb"]
        if kind == "F":
            want = [(s - 1, "F", u)] if s > 0 else []
        elif kind in ("B", "I"):
            want = [(s, "F", u)]
            if s < last:
                grad = (s + 1, "B", u) if (s + 1, "B", u) in done else (s + 1, "I", u)
                want.append(grad)
        else:  # W
            want = [(s, "I", u)]
        return want if all(w in done for w in want) else None

    moved = True
    while moved:
        moved = False
        for r, queue in queues.items():
            while at[r] < len(queue):
                ev = queue[at[r]]
                want = needs(ev)
                if want is None:
                    break
                start = max([free[r], *(done[w] for w in want)])
                free[r] = done[(ev["stage"], ev["kind"], ev["mb"])] = start + ev["cpu"]
                at[r] += 1
                moved = True
    stuck = {r: queue[at[r]] for r, queue in queues.items() if at[r] < len(queue)}
    if stuck:
        raise AssertionError(f"the measured order deadlocks: next actions {stuck}")
    return max(free.values())


def check_step(run: Mapping[str, Any]) -> float:
    """Check one measured schedule (a ``benchmarks.harness.measured.measure`` run with its last
    step's ``trace``) against the trace itself; returns the independent replay. The replayed
    step equals the walk above, lies between the busiest rank's CPU time and all ranks' CPU
    time together, and every rank's actions fit in the step's wall time."""
    trace = run["trace"]
    replay = critical_path(trace)
    cpu: dict[int, float] = {}
    span: dict[int, tuple[float, float]] = {}
    for ev in trace:
        cpu[ev["rank"]] = cpu.get(ev["rank"], 0.0) + ev["cpu"]
        lo, hi = span.get(ev["rank"], (ev["start"], ev["end"]))
        span[ev["rank"]] = (min(lo, ev["start"]), max(hi, ev["end"]))
    assert max(cpu.values()) <= replay * (1 + 1e-9) <= sum(cpu.values()) * (1 + 1e-9), run["label"]
    assert abs(run["replay_step_times_s"][-1] - replay) <= 1e-9 * replay, run["label"]
    wall = max(hi - lo for lo, hi in span.values())
    assert 0 < wall <= run["step_times_s"][-1], run["label"]  # actions inside the timed step
    return replay


def keeping_traces(module: Any, monkeypatch: Any) -> list[dict]:
    """Spy on ``module.measure`` (the harness's, as a benchmark imported it): the same runs,
    each with its traces kept, copied into the list returned (the caller drops its own)."""
    import dataclasses

    kept: list[dict] = []
    real = module.measure

    def measure_keeping_traces(setting: Any, *args: Any, **kwargs: Any) -> Any:
        runs = real(dataclasses.replace(setting, keep_trace=True), *args, **kwargs)
        kept.extend(dict(r) for r in runs)
        return runs

    monkeypatch.setattr(module, "measure", measure_keeping_traces)
    return kept
