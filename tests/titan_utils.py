"""Run torchtitan_integration.train in subprocesses (CPU, gloo) and read back its metrics."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import select
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchtitan_integration.versions import titan_generation

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_seq1f1b.toml"
#: the seed checkpoints' RNG seed (every run of a test starts from the same weights)
SEED = 0
# small and fast: 256 tokens, 4 samples (M = 2 microbatches of 2), K = 4 segments
FAST = [
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "4",
    "--training.steps",
    "5",
    "--optimizer.lr",  # the equivalence runs keep the small learning rate they were tuned at
    "8e-4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.disable_color_printing",
]
#: a step's line; torchtitan prints a non-finite value as ``inf`` or ``nan``
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\w.]+)\s+grad_norm:\s*([-\w.]+)")


@dataclass
class Run:
    losses: dict[int, float]
    grad_norms: dict[int, float]
    output: str


def titan_available(generation: str | None = None) -> None:
    """Skip unless torchtitan is installed (without importing it: that fixes its device), and
    of ``generation`` ("0.2" or "0.3") when given."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan (extra 'titan') not installed", allow_module_level=True)
    if generation is not None and TITAN != generation:
        pytest.skip(f"for torchtitan {generation}; this venv has {TITAN}", allow_module_level=True)


TITAN = titan_generation()


def only_titan(generation: str, why: str) -> pytest.MarkDecorator:
    """A test of one torchtitan generation's glue (the other has no such feature: ``why``)."""
    return pytest.mark.skipif(TITAN != generation, reason=f"torchtitan {generation} only: {why}")


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


#: torchtitan 0.3's FSDP and TP (its spmd_types backend) shard plain-tensor parameters with
#: ``fully_shard(..., dp_mesh_dims=...)``, which torch 2.13's FSDP rejects ("all parameters
#: must be DTensors on the full SPMD mesh"); torch 2.15 has it. Not ours to fix.
needs_sharding = pytest.mark.skipif(
    TITAN == "0.3" and not _torch_at_least(2, 15),
    reason="torchtitan 0.3's FSDP/TP need torch >= 2.15 (2.13's fully_shard lacks dp_mesh_dims "
    "on plain tensors); run on .venv (torch 2.15)",
)


def titan_argv(*args: str, dump: Path) -> list[str]:
    """The trainer's arguments of one training run (the debug TOML, small and fast)."""
    return ["--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *FAST, *args]


def _environment() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1")


class _Launcher:
    """tests/titan_zygote.py, started once a session: it forks each run's ranks from one
    process that has imported torch and torchtitan (torchrun would import them in every rank
    of every run, about a quarter of a short run's time on 2 cores)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "titan_zygote.py")], cwd=ROOT,
            env=_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reply(600)  # ready

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError("the launcher (tests/titan_zygote.py) gave no answer")
        return json.loads(line)

    def run(self, nproc: int, argv: list[str], log: Path, timeout: float) -> int:
        job = {"nproc": nproc, "argv": argv, "log": str(log), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout + 60)["rc"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_launcher: list[_Launcher] = []  # this session's, started at its first run


def close_launcher() -> None:
    """Stop the launcher (conftest.py, when the session ends)."""
    while _launcher:
        _launcher.pop().close()


def run_titan(nproc: int, *args: str, dump: Path, timeout: float = 300, check: bool = True) -> Run:
    """One training run; loss/grad_norm per step from the ranks that hold the last stage.
    ``SEQ1F1B_TEST_TORCHRUN=1`` launches it through torchrun instead, as users do."""
    argv = titan_argv(*args, dump=dump)
    if os.environ.get("SEQ1F1B_TEST_TORCHRUN") == "1":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
               "-m", "torchtitan_integration.train", *argv]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=_environment(), capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
        rc, out = proc.returncode, proc.stdout + proc.stderr
    else:
        if not _launcher or _launcher[0].proc.poll() is not None:
            close_launcher()
            _launcher.append(_Launcher())
        dump.mkdir(parents=True, exist_ok=True)
        log = dump.parent / f"{dump.name}.log"
        rc = _launcher[0].run(nproc, argv, log, timeout)
        out = log.read_text(errors="replace")
    if check and rc != 0:
        raise AssertionError(f"training failed ({rc}):\n{out[-6000:]}")
    return parse_run(out)


def seed_checkpoint(*args: str, dump: Path, save_at: int = 1000) -> list[str]:
    """A seed checkpoint of the job ``args`` (one process, PP=1): every run given the returned
    arguments starts from these weights (and saves its state at step ``save_at``)."""
    # a fixed seed: the debug models' random weights sometimes overflow a grad norm (Qwen3's
    # reached inf at step 2 in 1 run of 6), which the runs' comparison then cannot check
    run_titan(1, "--parallelism.pipeline_parallel_degree", "1", *args, "--checkpoint.enable",
              "--checkpoint.create_seed_checkpoint", "--debug.seed", str(SEED),
              dump=dump)  # fmt: skip
    step0 = dump / "checkpoint" / "step-0"
    assert step0.is_dir()
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(step0),
            "--checkpoint.interval", str(save_at)]  # fmt: skip


def parse_run(out: str) -> Run:
    """loss/grad_norm per step from a run's output (ranks reporting -1 left out)."""
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    for step, loss, norm in _STEP.findall(out):
        if float(loss) >= 0:  # ranks without the last stage report -1
            losses[int(step)] = float(loss)
            norms[int(step)] = float(norm)
    return Run(losses, norms, out)


def assert_same_curve(
    run: Run, ref: Run, steps: int = 5, tol: float = 1e-4, grad_tol: float = 1e-3
) -> None:
    """Losses equal within ``tol`` and grad norms within ``grad_tol`` (relative), every step."""
    assert sorted(run.losses) == list(range(1, steps + 1)), run.output[-3000:]
    for s in range(1, steps + 1):
        a, b = run.losses[s], ref.losses[s]
        values = (a, b, run.grad_norms[s], ref.grad_norms[s])
        assert all(map(math.isfinite, values)), f"step {s}: (loss, ref, norm, ref) {values}"
        assert abs(a - b) <= tol * abs(b), f"step {s}: loss {a} vs reference {b}"
        ga, gb = run.grad_norms[s], ref.grad_norms[s]
        assert abs(ga - gb) <= grad_tol * abs(gb) + 1e-4, f"step {s}: grad_norm {ga} vs {gb}"
