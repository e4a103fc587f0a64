"""The tests' training launcher: imports torch, torchtitan and the integration once, then
forks the ranks of each run from this warm process (what ``torchrun`` does, without each
rank's ~8 s of imports: tests/titan_utils.py sends the runs, one JSON line each on stdin, and
reads a JSON line back when every rank has exited).

Each rank is a fresh fork: nothing one run sets reaches the next. The ranks meet over
``env://`` (rank 0 hosts the store on a free port, as torchrun's ``MASTER_ADDR``/``PORT``), write
to one log (line-buffered, appended), and when one rank fails the others are stopped, as
torchrun's agent does. Run as ``python tests/titan_zygote.py`` from the repository root.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback

import torch  # noqa: F401  (the imports every rank shares)

from torchtitan_integration.versions import TITAN_0_3, titan_generation

if titan_generation() == TITAN_0_3:
    from torchtitan_integration.v03.train import run as train
else:
    from torchtitan_integration.v022.train import run as train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, argv: list[str], log: int) -> None:
    """The body of one forked rank; never returns."""
    code = 1
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
            WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        sys.argv = ["torchtitan_integration.train", *argv]
        train()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(pids: set[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while pids and time.monotonic() < end:
            for pid in list(pids):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    pids.discard(pid)
            time.sleep(0.1)


def launch(world: int, argv: list[str], log_path: str, timeout: float) -> int:
    """Fork ``world`` ranks of one run; the first failing rank's exit code (124: timed out)."""
    port = _free_port()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    sys.stdout.flush()
    pids = set()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, argv, log)
        pids.add(pid)
    os.close(log)
    deadline = time.monotonic() + timeout
    result = 0
    while pids:
        exited = False
        for pid in list(pids):
            if pid not in pids:  # reaped by _stop
                continue
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                exited = True
                pids.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                if code and not result:
                    result = code if code > 0 else 128 - code
                    _stop(pids)
        if pids and time.monotonic() > deadline:
            with open(log_path, "a") as f:
                f.write(f"titan_zygote: timed out after {timeout:.0f} s; stopping the ranks\n")
            _stop(pids)
            return 124
        if not exited:
            time.sleep(0.1)
    return result


def main() -> None:
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        rc = launch(job["nproc"], job["argv"], job["log"], job["timeout"])
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    main()
