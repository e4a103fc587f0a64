"""How long the planner's search takes, in-process (importing torch and seq1f1b excluded).

    python -m benchmarks.planner_speed [--repeat N] [planner arguments]

Default: the paper's 7B at 64k tokens on 32 A100s, as ``scripts/plan.sh --model paper-7b
--seq-len 65536 --gpus 32 --gpu a100-80gb`` searches it (torchtitan 0.3's trainer): 1794
settings, each priced by replaying its schedule's real order (seq1f1b/planning/batch_simulate.py
replays them all in one batch). Any planner arguments replace the default problem.

Why: the search is what a user waits for (the command above adds about 3.5 s of imports);
this is the number to watch when the search, the orders or the replay change. Prints the
seconds of each run, the best, and how many settings were priced. What the search finds is
held by tests/test_planner.py (its paper-7B ranking), not timed there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from seq1f1b.planning.planner import build_parser, collection_paused, problem_from_args
from torchtitan_integration.planner import TRAINERS

__all__ = ["DEFAULT", "main", "time_search"]

#: the planner arguments timed by default
DEFAULT = ("--model", "paper-7b", "--seq-len", "65536", "--gpus", "32", "--gpu", "a100-80gb")


def time_search(argv: Sequence[str], repeat: int = 1) -> tuple[list[float], int]:
    """Seconds of each of ``repeat`` searches for the planner arguments ``argv``, and the
    settings one priced."""
    args = build_parser(trainers=TRAINERS).parse_args(list(argv))
    seconds, settings = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        with collection_paused():  # as the command runs it
            _, plan = problem_from_args(args, TRAINERS)
        seconds.append(time.perf_counter() - start)
        settings = len(plan.candidates)
    return seconds, settings


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_speed", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--repeat", type=int, default=3, help="searches to time (default 3)")
    a, planner_args = ap.parse_known_args(argv)
    planner_args = planner_args or list(DEFAULT)
    seconds, settings = time_search(planner_args, max(1, a.repeat))
    print(f"planner search: {' '.join(planner_args)}")
    print(
        f"{settings} settings priced; seconds per search: {', '.join(f'{s:.2f}' for s in seconds)}"
    )
    print(f"best: {min(seconds):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
