"""Chrome-trace / Perfetto JSON of measured runs (open in https://ui.perfetto.dev).

Why: the PNG shows one step at a glance; the trace lets you zoom into every action's measured
start and end. Each schedule's ranks are separate processes in the trace ("<schedule> / rank
r"), each local stage a thread; times are microseconds from that schedule's first action.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Trace events for measured results (each with ``label`` and ``trace``)."""
    events: list[dict[str, Any]] = []
    pid = 0
    for run in runs:
        trace = run.get("trace") or []
        if not trace:
            continue
        t0 = min(ev["start"] for ev in trace)
        ranks = sorted({ev["rank"] for ev in trace})
        pids = {}
        for r in ranks:
            pids[r] = pid
            events.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": pid,
                    "args": {"name": f"{run['label']} / rank {r}"},
                }
            )
            events.append(
                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
            )
            pid += 1
        for ev in trace:
            events.append(
                {
                    "name": f"{ev['kind']}{ev['unit']}",
                    "cat": ev["kind"],
                    "ph": "X",
                    "pid": pids[ev["rank"]],
                    "tid": ev["stage"],
                    "ts": (ev["start"] - t0) * 1e6,
                    "dur": (ev["end"] - ev["start"]) * 1e6,
                    "args": {"stage": ev["stage"], "unit": ev["unit"]},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, runs: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(runs), f)
