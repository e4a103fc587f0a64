"""``pip install seq1f1b[titan]`` on a machine that has torch and torchtitan replaces neither:
pyproject asks for minimums only (torch>=2.13, torchtitan>=0.2.2). Checked with pip's own
resolver (``--dry-run --report``) against the venv running the suite, whatever its versions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_installing_the_titan_extra_keeps_torch_and_torchtitan(tmp_path: Path) -> None:
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan not installed in this venv")
    report = tmp_path / "report.json"
    # no machine-wide cap (this machine's pip caps torch): a user's pip has none
    env = dict(os.environ, PIP_CONSTRAINT="/dev/null", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
         str(report), "-e", f"{ROOT}[titan]"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    would = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "seq1f1b" in would
    assert not would & {"torch", "torchtitan", "triton"}, sorted(would)
