"""The multi-rank helper: its long-lived ranks behave as fresh ones, and a failure, a hang or
leaked state never reaches the next test."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import RanksFailed, run_ranks

pytestmark = pytest.mark.fast


def _record(rank: int, world: int, out: str) -> None:
    """Write this rank's pid and its first global random number; check the group works."""
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world
    Path(out, f"{rank}").write_text(f"{os.getpid()} {torch.rand(1).item()!r}")


def _seen(out: Path, world: int) -> list[tuple[str, str]]:
    return [tuple((out / f"{rank}").read_text().split()) for rank in range(world)]


def _fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")


def _hang(rank: int, world: int) -> None:
    time.sleep(120)


def _leak_env(rank: int, world: int) -> None:
    os.environ["SEQ1F1B_TEST_LEAK"] = "1"


def test_calls_reuse_the_ranks_and_start_from_the_same_random_state(tmp_path: Path) -> None:
    run_ranks(_record, 2, str(tmp_path))
    first = _seen(tmp_path, 2)
    run_ranks(_record, 2, str(tmp_path))
    second = _seen(tmp_path, 2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes
    assert str(os.getpid()) not in {pid for pid, _ in first}
    # every call starts from the global random state the process started with
    assert [r for _, r in first] == [r for _, r in second]


def test_a_failing_rank_fails_the_call_and_the_next_call_gets_new_ranks(tmp_path: Path) -> None:
    run_ranks(_record, 2, str(tmp_path))
    before = _seen(tmp_path, 2)
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 raised.*ValueError: rank 1 refuses"):
        run_ranks(_fail_on_rank_1, 2)
    run_ranks(_record, 2, str(tmp_path))
    assert {pid for pid, _ in before}.isdisjoint(pid for pid, _ in _seen(tmp_path, 2))


def test_a_hung_rank_fails_at_the_call_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"did not finish within 1 s"):
        run_ranks(_hang, 1, timeout=1.0)
    assert time.monotonic() - start < 30
    run_ranks(_record, 1, str(tmp_path))  # and the next call is served


#: unit scopes entered and never left (held, so that collecting them does not leave them)
_OPEN_SCOPES: list[Any] = []


def _leak_unit(rank: int, world: int) -> None:
    from seq1f1b.attention import kv

    info = kv.SegmentInfo(0, 0, 1, 0, 4, 4, (0, 4))
    scope = kv.activate(kv.UnitContext(kv.StageKVState(0, 1), info, "forward", False))
    scope.__enter__()
    _OPEN_SCOPES.append(scope)


@pytest.mark.parametrize(
    ("leak", "message"),
    [
        (_leak_env, "environment variable SEQ1F1B_TEST_LEAK"),
        (_leak_unit, r"seq1f1b\.attention\.kv\._ACTIVE grew from 0 to 1"),
    ],
)
def test_leaked_state_replaces_the_ranks(tmp_path: Path, leak: Callable, message: str) -> None:
    run_ranks(_record, 1, str(tmp_path))
    before = _seen(tmp_path, 1)
    with pytest.warns(UserWarning, match=message):
        run_ranks(leak, 1)
    run_ranks(_record, 1, str(tmp_path))
    assert before[0][0] != _seen(tmp_path, 1)[0][0]
    assert "SEQ1F1B_TEST_LEAK" not in os.environ
