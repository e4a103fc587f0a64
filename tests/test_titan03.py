"""torchtitan 0.3 only, end to end: its native entry (``--module/--config``) runs the same job
as our TOML launcher, step for step. (Everything that both versions share, including the
equivalence grid against unpipelined runs, is in tests/test_titan.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from titan_utils import CONFIG, ROOT, Run, parse_run, titan_available

titan_available("0.3")

STEPS = ["--training.steps", "2", "--seq1f1b.seq_chunks", "2", "--metrics.disable_color_printing"]


def _torchrun(args: list[str], cwd: Path) -> Run:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    run = parse_run(proc.stdout + proc.stderr)
    assert proc.returncode == 0, run.output[-4000:]
    return run


def test_native_module_config_equals_the_toml_launcher(tmp_path: Path) -> None:
    """``python -m torchtitan.train --module torchtitan_integration --config
    seq1f1b_debugmodel`` (0.3's way, tyro parsing ``--seq1f1b.seq_chunks``) and the default
    TOML through our train entry are one job: same segments, same losses and grad norms."""
    native = _torchrun(
        ["-m", "torchtitan.train", "--module", "torchtitan_integration",
         "--config", "seq1f1b_debugmodel", "--dump_folder", "native", *STEPS],
        tmp_path,
    )  # fmt: skip
    toml = _torchrun(
        ["-m", "torchtitan_integration.train", "--job.config_file", str(CONFIG),
         "--job.dump_folder", "toml", *STEPS],
        tmp_path,
    )  # fmt: skip
    assert "M=2 K=2" in native.output and "M=2 K=2" in toml.output
    assert sorted(native.losses) == [1, 2]
    assert native.losses == toml.losses
    assert native.grad_norms == toml.grad_norms
    assert (tmp_path / "native" / "tb").is_dir() and (tmp_path / "toml" / "tb").is_dir()
    # the trainer gives rank 0 the loss: torchtitan's warning to log rank 1 does not apply
    assert "Pipeline Parallel loss is not visible" not in native.output
