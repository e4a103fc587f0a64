"""A failure during a step, reported by every rank of the pipeline group, by name.

When one rank raises in the middle of a step, its peers are waiting on it in a receive or a
collective. Left alone, they wait until the group's timeout, or (when the failing process
exits) print only gloo's "Connection closed by peer". :class:`StepFailures` turns that into
one error on every rank that names the failing rank and its message:

* the failing rank writes "pipeline rank r ... failed: <error>" into the default process
  group's c10d store (first writer wins: ``compare_set``), then closes its side of the
  pipeline group (gloo: one receive that times out at once, after which gloo closes every
  connection of that group), so that no peer waits, and re-raises its own error with a note
  naming itself;
* a rank whose step fails because a peer's connection closed (or any later error) reads that
  report and raises ``RuntimeError`` naming the failing rank and its message, its own error
  chained; it closes its side too, so a pipeline of more than two ranks hears in turn.

Nothing runs on the happy path (a ``try`` per step). Errors that every rank raises together
before any traffic (the step's pre-flight, :mod:`seq1f1b.schedules.preflight`) are not
reported: each rank already raises one that names the rank at fault. The pipeline group is not
usable after a failed step (its traffic stopped midway): build a new one, or exit.

NCCL: the report is written the same way, but a peer's GPU receive cannot be woken from the CPU;
torchrun stops the peers when the failing rank exits, and its summary names that rank.

| torch internal                               | why                                          |
|----------------------------------------------|----------------------------------------------|
| distributed_c10d._get_default_store          | where the failing rank leaves its report     |

Checked on 2.13.0, 2.14.1 and 2.15.0. Upstream hook that would retire this: a public
``dist.get_default_store()`` (or an error propagation hook on the pipelining runtime).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

__all__ = ["StepFailures", "raised_on_every_rank"]

#: the store key prefix of a pipeline group's failure report (one per group: a failed step
#: leaves the group unusable, so a report is never stale)
REPORT_KEY = "seq1f1b/step_failure/"
#: seconds a rank whose communication failed waits for the report of the rank that failed
REPORT_WAIT_S = 5.0
#: a tag no pipeline message uses: the receive that closes a gloo group's connections
_CLOSING_TAG = 0x5EF1F1B


def raised_on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as one every rank raises the same (agreed on, e.g. the first-step check's
    collective verdict): a failure scope lets it through as it is, with no report to send."""
    exc.__dict__["seq1f1b_on_every_rank"] = True
    return exc


def _is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer stopped talking (not an error of this rank's own)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return ("gloo" in text or "NCCL" in text) and (
        "Connection closed" in text or "Connection reset" in text or "Timed out" in text
    )


class StepFailures:
    """Names a failure during a step on every rank of one pipeline group (module docstring).

    ``group`` is the stages' group (None: the default group); ``what`` names the step in
    messages, e.g. "ScheduleSeq1F1B.step()".
    """

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.group = group
        self.what = what

    @staticmethod
    def note(exc: BaseException, note: str) -> None:
        """``exc.add_note(note)`` (shown with the error); on Python 3.10, appended to a
        one-string message."""
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        elif len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}\n{note}",)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _who(self) -> str:
        rank, size, global_rank = dist.get_rank(self.group), self.size, dist.get_rank()
        also = f" (global rank {global_rank})" if global_rank != rank else ""
        return f"pipeline rank {rank} of {size}{also}"

    def _key(self) -> str:
        group = self.group if self.group is not None else dist.group.WORLD
        return REPORT_KEY + str(group.group_name)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Run a step's traffic: an exception in it is reported to every rank (see :meth:`fail`)."""
        if self.size < 2:
            yield
            return
        try:
            yield
        except Exception as exc:
            if exc.__dict__.get("seq1f1b_on_every_rank"):  # already raised on every rank
                raise
            self.fail(exc)

    def fail(self, exc: Exception) -> NoReturn:
        """Report ``exc`` (or a peer's earlier report), close this rank's side, and raise."""
        store = dist.distributed_c10d._get_default_store()
        key = self._key()
        mine = f"{self._who()} failed in {self.what}: {type(exc).__name__}: {exc}"
        report, lost = None, _is_communication_error(exc)
        if lost:  # a peer stopped: a peer that failed in its step reported before it closed
            with contextlib.suppress(Exception):
                store.wait([key], datetime.timedelta(seconds=REPORT_WAIT_S))
                report = store.get(key).decode()
        if report is None:
            try:
                report = store.compare_set(key, "", mine).decode()
            except (NotImplementedError, RuntimeError):  # a store without it (the dry run's
                report = None  # fake one): there are no peers to tell
            if report is None:
                raise exc  # as it is, its cause chain kept
        self._close()
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        if report == mine and lost:  # nobody reported: a peer died or failed elsewhere
            raise RuntimeError(
                f"{self._who()} lost its connection to a peer in {self.what}, and no pipeline "
                f"rank reported an error within {REPORT_WAIT_S:.0f} s: a peer process exited "
                f"or failed outside the step (see its log). {type(exc).__name__}: {first_line}"
            ) from exc
        if report == mine:  # this rank failed first
            self.note(exc, f"{self.what} failed on {self._who()}; every other pipeline rank "
                            "raises an error naming this rank and this error")  # fmt: skip
            raise exc
        raise RuntimeError(
            f"{report}\n({self._who()} stopped because of it: {type(exc).__name__}: "
            f"{first_line}). The pipeline group is unusable after a failed step; fix the "
            "error the failing rank names"
        ) from exc

    def _close(self) -> None:
        """Close this rank's connections of a gloo group, so that no peer waits on them (gloo
        closes every connection of a group when one of its receives times out)."""
        group = self.group if self.group is not None else dist.group.WORLD
        if "gloo" not in str(dist.get_backend(group)):
            return
        me = dist.get_rank(group)
        for peer in range(self.size):
            if peer == me:
                continue
            with contextlib.suppress(Exception):
                work = group.recv([torch.empty(1)], peer, _CLOSING_TAG)
                work.wait(datetime.timedelta(milliseconds=1))
