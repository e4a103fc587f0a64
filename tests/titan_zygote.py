"""The tests' training launcher: imports torch, torchtitan and the integration once, then
forks the ranks of each run from this warm process (what ``torchrun`` does, without each
rank's ~8 s of imports: tests/titan_utils.py sends the runs, one JSON line each on stdin, and
reads a JSON line back when every rank has exited).

Each rank is a fresh fork: nothing one run sets reaches the next. The ranks meet over
``env://`` (rank 0 hosts the store on a socket this process bound, so no other run on the
machine can take its port first), write to one log (line-buffered, appended), and when one
rank fails the others are stopped, as torchrun's agent does. Run as ``python
tests/titan_zygote.py`` from the repository root.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback

import torch  # the imports every rank shares

from torchtitan_integration.versions import TITAN_0_3, titan_generation

if titan_generation() == TITAN_0_3:
    from torchtitan_integration.v03.train import run as train
else:
    from torchtitan_integration.v022.train import run as train


def _listening_socket() -> socket.socket:
    """A socket bound to a port of the OS's choosing and listening: the run's store takes it
    over, so no other process can take the port between its choice and its use."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _rank(rank: int, world: int, listener: socket.socket, argv: list[str], log: int) -> None:
    """The body of one forked rank; never returns. Rank 0 hosts the run's store on the
    inherited listening socket; every rank's ``env://`` rendezvous connects to it as a client
    (torchrun's agent store: ``TORCHELASTIC_USE_AGENT_STORE``)."""
    code = 1
    store = None
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        port = listener.getsockname()[1]
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
            WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
        )  # fmt: skip
        if rank == 0:
            store = torch.distributed.TCPStore(
                "127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                master_listen_fd=listener.fileno(), use_libuv=False,
            )  # fmt: skip
        else:
            listener.close()
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
        del store
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
    listener = _listening_socket()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    sys.stdout.flush()
    pids = set()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, listener, argv, log)
        pids.add(pid)
    os.close(log)
    listener.close()
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
