"""``run_train.sh`` across nodes: two launchers on this machine play two nodes that meet at one
c10d rendezvous and train one PP=2 pipeline together, stage 0 on one "node" and stage 1 on the
other, as NNODES / NODE_RANK / RDZV_ENDPOINT / RDZV_ID describe on a real cluster; the Slurm
example derives those variables from the job."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("torchtitan") is None:  # not imported: that would fix its device
    pytest.skip("torchtitan (extra 'titan') not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
RUN_TRAIN = ROOT / "run_train.sh"
CONFIG = "train_configs/llama3_debug_seq1f1b.toml"
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)")
PP_RANK = re.compile(r"PP rank (\d+) is building stage")
NO_RENDEZVOUS = "RDZV_ENDPOINT=host:port reachable from every node"
TIMEOUT = 300.0
#: run_train.sh's variables besides CONFIG_FILE; a caller's own must not leak into these runs
LAUNCHER_VARIABLES = (
    "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_BACKEND", "NGPU", "LOG_RANK",
    "TRAIN_FILE", "MODULE", "CONFIG",
)  # fmt: skip


def _launcher_env(**extra: str) -> dict[str, str]:
    """The environment of one launcher: the venv this test runs in, at the versions installed
    in it (so the launcher's set-up step keeps them), CPU threads and datasets as the suite's
    other torchtitan runs set them, and no multi-node variable of the caller's shell."""
    env = dict(os.environ)
    for key in (*LAUNCHER_VARIABLES, "CONFIG_FILE"):
        env.pop(key, None)
    env.update(
        SEQ1F1B_VENV=sys.prefix,
        TORCH_VERSION=importlib.metadata.version("torch").split("+")[0],
        TORCHTITAN_VERSION=importlib.metadata.version("torchtitan"),
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        CONFIG_FILE=CONFIG,
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv_ready() -> None:
    """The launcher sets up its venv on first use; do that once here, so that the two
    "nodes" below never run pip in the same venv at the same time (a no-op once stamped)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not running in a venv: SEQ1F1B_VENV has nothing to point at")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_env.sh"), sys.prefix],
        cwd=ROOT,
        env=_launcher_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_nodes(envs: list[dict[str, str]], args: list[str], logs: Path) -> list[tuple[int, str]]:
    """Start one launcher per environment, wait for all; (exit code, output) of each.

    A node that fails makes the others wait at the rendezvous, so the first failure (or the
    time limit) ends every launcher still running, each with its whole process group.
    """
    procs: list[subprocess.Popen[bytes]] = []
    files = [logs / f"node{i}.log" for i in range(len(envs))]
    try:
        for env, path in zip(envs, files, strict=True):
            with path.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        ["bash", str(RUN_TRAIN), *args],
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group: torchrun and its workers
                    )
                )
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = [f.read_text(errors="replace") for f in files]
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


def test_two_nodes_train_one_pipeline(venv_ready: None, tmp_path: Path) -> None:
    """NNODES=2, one process per node, PP=2: each node holds one stage; both launchers exit 0
    and each logs the real loss (every PP rank gets the last stage's) for steps 1-3."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = {"NNODES": "2", "NGPU": "1", "RDZV_ENDPOINT": endpoint, "RDZV_ID": "launcher-test"}
    envs = [_launcher_env(**nodes, NODE_RANK=str(rank)) for rank in (0, 1)]
    args = [
        "--training.steps", "3",
        "--training.seq_len", "256",
        "--training.local_batch_size", "4",
        "--job.dump_folder", str(tmp_path / "outputs"),
        "--metrics.disable_color_printing",
    ]  # fmt: skip
    results = _run_nodes(envs, args, tmp_path)
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"node {rank} exited {code}:\n{out[-6000:]}"
        assert "+ " in out and "--nnodes=2" in out and f"--rdzv-endpoint={endpoint}" in out
        assert f"--node-rank={rank}" in out and "--rdzv-id=launcher-test" in out
        losses = {int(step): float(loss) for step, loss in STEP.findall(out)}
        assert sorted(losses) == [1, 2, 3], f"node {rank}:\n{out[-4000:]}"
        assert all(math.isfinite(v) and v > 0 for v in losses.values()), (rank, losses)
    # one pipeline over both nodes: each node's rank built a different stage
    stages = [set(PP_RANK.findall(out)) for _, out in results]
    assert set().union(*stages) == {"0", "1"} and not stages[0] & stages[1], stages


@pytest.mark.parametrize("endpoint", [None, "localhost:0"])
def test_multi_node_without_rendezvous_fails_at_once(endpoint: str | None) -> None:
    """NNODES > 1 with the single-node rendezvous is refused with what to set, before any
    set-up or training."""
    extra = {"NNODES": "2"} if endpoint is None else {"NNODES": "2", "RDZV_ENDPOINT": endpoint}
    proc = subprocess.run(
        ["bash", str(RUN_TRAIN), "--training.steps", "1"],
        cwd=ROOT,
        env=_launcher_env(**extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert NO_RENDEZVOUS in proc.stderr, proc.stderr
    assert "+ " not in proc.stderr and "setting up" not in proc.stderr  # nothing ran


FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a17\\ngpu-a18\\n'
"""
# srun: report what it was given, then run its command as node 1 would, with a stub in place
# of run_train.sh (a real one would wait for node 0 at gpu-a17)
FAKE_SRUN = """#!/usr/bin/env bash
echo "SRUN $*"
echo "ENV NNODES=$NNODES RDZV_ENDPOINT=$RDZV_ENDPOINT RDZV_ID=$RDZV_ID NGPU=$NGPU"
while [[ "$1" == --* ]]; do shift; done
cmd=("$@")
cmd[3]="$STUB"
SLURM_NODEID=1 "${cmd[@]}"
"""
STUB = """#!/usr/bin/env bash
echo "STUB NODE_RANK=$NODE_RANK ARGS=$*"
"""


def test_slurm_script_sets_the_rendezvous_from_the_job(venv_ready: None, tmp_path: Path) -> None:
    """examples/slurm_run_train.sh with stand-ins for scontrol and srun: NNODES from the job,
    RDZV_ENDPOINT on its first host, RDZV_ID the job id, NGPU from --gpus-per-node, and on
    each node NODE_RANK from SLURM_NODEID with the arguments passed through."""
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("stub", STUB)):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    env = _launcher_env(
        PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        STUB=str(tmp_path / "stub"),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-a[17-18]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_PER_NODE="h100:8",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "slurm_run_train.sh"), "--training.steps", "7"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "ENV NNODES=2 RDZV_ENDPOINT=gpu-a17:29500 RDZV_ID=4242 NGPU=8" in out, out
    assert "SRUN --ntasks=2 --ntasks-per-node=1" in out, out
    assert "STUB NODE_RANK=1 ARGS=--training.steps 7" in out, out
