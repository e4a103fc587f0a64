"""Run a function on N gloo ranks; a failing rank fails the test, and nothing hangs.

Starting a rank (a Python process that imports torch and this package) costs seconds on a
loaded CPU, more than most multi-rank tests take. So, as in torch's ``MultiProcContinuousTest``,
``run_ranks`` keeps ``world`` long-lived worker processes per world size for the pytest session
and sends them each call. Each call still gets what a fresh spawn gave it: a new gloo process
group (initialised before, destroyed after, so no message or subgroup outlives the call), one
CPU thread, the warnings filters restored and the package's ``lru_cache`` caches emptied; and
torch's global RNG is reset to the seed its process started with, so a result does not depend
on which tests ran before. After a call the workers are checked for state a fresh process would
not have (environment variables, the garbage collector, grad mode, the default dtype, the
package's module-level stacks and context variables); such a leak, a failing rank or a timeout
tears the pool down (its processes killed) and the next call starts a new one. ``fresh=True``
spawns processes for one call only, for tests whose state cannot be shared (``torch.compile``,
CUDA, ranks that end themselves).
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seq1f1b._runtime import AutogradContextVar

#: gloo's collective timeout: a rank that waits longer on its peers raises (generous: CI runs
#: two tiers at once on two cores, and a peer may be compiling)
TIMEOUT = timedelta(seconds=300)
#: wall seconds one call may take on all ranks before the pool is killed and the test fails
CALL_TIMEOUT = 900.0
#: after one rank fails, seconds the others get to report before the pool is killed
GRACE = 1.0
#: idle ranks kept at most (about 0.5 GiB each): the least recently used pools go first
MAX_RANKS = 8
_CTX = mp.get_context("spawn")


class RanksFailed(AssertionError):
    """One or more ranks raised, died, or did not finish in time (each rank's report inside)."""


@dataclass(frozen=True)
class _Report:
    """One rank's outcome of one call: ``error`` is a traceback, ``leaks`` name leaked state."""

    error: str | None = None
    leaks: tuple[str, ...] = ()


def _entry(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple) -> None:
    """One call on one rank: its own process group around ``fn`` and a closing barrier."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


def _spawn_entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple) -> None:
    """``fresh=True``: a process of its own for one call (torch.multiprocessing.spawn target)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    _entry(rank, world, store_path, fn, args)


def _package_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "seq1f1b"]


def _clear_caches() -> None:
    """Empty the package's ``lru_cache`` caches, so a call counts its own cache misses."""
    for module in _package_modules():
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def _depth(value: object) -> int | None:
    """How much a module-level list, or a context variable's stack (the unit context's), holds
    in this thread's context; None for anything else."""
    if type(value) is list:
        return len(value)
    if isinstance(value, AutogradContextVar):
        held = value.get()
        return len(held) if isinstance(held, tuple) else int(bool(held))
    return None


def _stacks() -> dict[str, int]:
    """Depths of the package's module-level lists and context variables (e.g. the unit's)."""
    depths = {
        f"{module.__name__}.{name}": _depth(value)
        for module in _package_modules()
        for name, value in list(vars(module).items())
    }
    return {name: d for name, d in depths.items() if d is not None}


@dataclass
class _Baseline:
    """What a fresh worker looks like; a call that leaves the worker otherwise leaked state."""

    seed: int = field(default_factory=torch.initial_seed)
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def leaks(self, stacks_before: dict[str, int]) -> tuple[str, ...]:
        found = [f"environment variable {k}" for k in _changed(self.environ, dict(os.environ))]
        found += [
            f"{name} grew from {stacks_before.get(name, 0)} to {n}"
            for name, n in _stacks().items()
            if n > stacks_before.get(name, 0)
        ]
        if not gc.isenabled():
            found.append("the garbage collector left disabled")
        if not torch.is_grad_enabled():
            found.append("grad mode left disabled")
        if torch.get_default_dtype() != torch.float32:
            found.append(f"default dtype left at {torch.get_default_dtype()}")
        if torch.are_deterministic_algorithms_enabled():
            found.append("deterministic algorithms left enabled")
        if dist.is_initialized():
            found.append("a default process group left initialised")
        return tuple(found)


def _changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone (killed with no chance to close the pool): no orphans."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker(rank: int, world: int, conn: connection.Connection, parent: int) -> None:
    """A long-lived rank: runs the calls it receives until told to stop or its parent is gone."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    baseline = _Baseline()
    try:
        while (task := conn.recv()) is not None:
            fn, args, store_path = task
            torch.manual_seed(baseline.seed)
            torch.set_num_threads(1)
            _clear_caches()
            stacks = _stacks()
            try:
                with warnings.catch_warnings():
                    _entry(rank, world, store_path, fn, args)
            except BaseException:
                # Report before anything else: the process group may be stuck in a collective,
                # so it is not destroyed; the parent kills this process.
                conn.send(_Report(error=traceback.format_exc()))
                break
            conn.send(_Report(leaks=baseline.leaks(stacks)))
    except (EOFError, KeyboardInterrupt):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Pool:
    """``world`` worker processes and the pipes to them; killed as a whole on any failure."""

    def __init__(self, world: int) -> None:
        self.world, self.calls = world, 0
        self.tmp = tempfile.mkdtemp(prefix=f"seq1f1b-ranks{world}-")
        self.conns: list[connection.Connection] = []
        self.procs: list[Any] = []
        for rank in range(world):
            here, there = _CTX.Pipe()
            proc = _CTX.Process(target=_worker, args=(rank, world, there, os.getpid()), daemon=True)
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    def call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> tuple[str, ...]:
        """Run ``fn`` on every rank; the leaks the ranks report, or raise ``RanksFailed``."""
        self.calls += 1
        task = (fn, args, os.path.join(self.tmp, f"store{self.calls}"))
        for conn in self.conns:
            conn.send(task)
        reports: dict[int, _Report] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < self.world:
            if any(r.error for r in reports.values()):
                deadline = min(deadline, time.monotonic() + GRACE)
            waiting = {
                obj: rank
                for rank in range(self.world)
                if rank not in reports
                for obj in (self.conns[rank], self.procs[rank].sentinel)
            }
            ready = connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in sorted({waiting[obj] for obj in ready}):
                reports[rank] = self._receive(rank)
        failed = {rank: r.error for rank, r in reports.items() if r.error}
        missing = [rank for rank in range(self.world) if rank not in reports]
        if failed or missing:
            lines = [f"rank {rank} raised:\n{error}" for rank, error in sorted(failed.items())]
            if missing:
                why = "after another rank failed" if failed else f"within {timeout:.0f} s"
                lines.append(f"ranks {missing} did not finish {why}")
            raise RanksFailed(f"{fn.__name__} on {self.world} ranks:\n" + "\n".join(lines))
        return tuple(sorted({leak for r in reports.values() for leak in r.leaks}))

    def _receive(self, rank: int) -> _Report:
        conn = self.conns[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        self.procs[rank].join(timeout=1.0)
        return _Report(error=f"the process exited (code {self.procs[rank].exitcode})")

    def close(self, graceful: bool) -> None:
        """Stop the workers (asked to exit when ``graceful``, killed otherwise or if slow)."""
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout=5.0 if graceful else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _Pools:
    """The session's pools, one per world size (a test helper's state, closed at exit)."""

    def __init__(self) -> None:
        self.by_world: dict[int, _Pool] = {}

    def run(self, fn: Callable[..., Any], world: int, args: tuple, timeout: float) -> None:
        pool = self.by_world.pop(world, None)  # re-inserted below: the dict is in order of use
        if pool is None:
            while self.by_world and sum(self.by_world) + world > MAX_RANKS:
                self.by_world.pop(next(iter(self.by_world))).close(graceful=True)
            pool = _Pool(world)
        try:
            leaks = pool.call(fn, args, timeout)
        except BaseException:  # a failure, a timeout, or ctrl-C: no process outlives it
            pool.close(graceful=False)
            raise
        if leaks:
            pool.close(graceful=False)
            warnings.warn(
                f"{fn.__name__} left state a fresh process would not have ({'; '.join(leaks)}); "
                "its worker processes were replaced",
                stacklevel=3,
            )
            return
        self.by_world[world] = pool

    def close(self) -> None:
        while self.by_world:
            self.by_world.popitem()[1].close(graceful=True)


_POOLS = _Pools()
atexit.register(_POOLS.close)


def close_pools() -> None:
    """Stop every pool's workers (the pytest session's end; ``atexit`` as a fallback)."""
    _POOLS.close()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    fresh: bool = False,
    timeout: float = CALL_TIMEOUT,
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any rank fails.

    ``fn`` and ``args`` must pickle (a module-level function). The ranks are the session's
    long-lived workers unless ``fresh``: then ``world`` new processes run this call only.
    """
    if world < 1:
        raise ValueError(f"run_ranks needs world >= 1 ranks, got {world}")
    if not fresh:
        _POOLS.run(fn, world, args, timeout)
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_spawn_entry, args=(world, store, fn, args), nprocs=world)
