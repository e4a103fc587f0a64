"""Replay a measured step through the simulator with each action's measured CPU time.

Why: on a shared 2-core machine, other processes steal time from the ranks, and wall-clock
step times swing by 2x between identical steps. Each action's *CPU* time (``thread_time``)
is far less affected. Feeding the actions, in the order each rank ran them, with those costs
into :func:`seq1f1b.planning.simulate.simulate` gives the step time the ranks would have had with
their cores to themselves: compute and dependency waits, minus preemption, communication and the
Python work between actions. It is a cross-check next to the wall-clock median, not a
replacement for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seq1f1b._runtime import Action, ComputationType
from seq1f1b.planning.simulate import simulate

__all__ = ["replay_step_time"]


def replay_step_time(rank_traces: Sequence[Sequence[dict[str, Any]]], replicas: int = 1) -> float:
    """Makespan of one step from per-rank action records (``stage, kind, mb, start, cpu``);
    ``replicas``: independent pipelines in the stage ids (BitPipe: 2)."""
    order: dict[int, list[Action | None]] = {}
    cost: dict[tuple[int, str, int], float] = {}
    for rank, trace in enumerate(rank_traces):
        events = sorted(trace, key=lambda ev: ev["start"])
        order[rank] = [Action(ev["stage"], ComputationType(ev["kind"]), ev["mb"]) for ev in events]
        for ev in events:
            cost[(ev["stage"], ev["kind"], ev["mb"])] = ev["cpu"]
    res = simulate(
        order,
        lambda a: cost[(a.stage_index, a.computation_type.value, a.microbatch_index or 0)],
        replicas=replicas,
    )
    return res.makespan
