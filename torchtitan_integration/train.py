"""Train entry (torchtitan's TRAIN_FILE): ``python -m torchtitan_integration.train``.

On torchtitan 0.3 it hands over to :mod:`.v03.train` (same TOML and overrides, mapped onto
0.3's config, or 0.3's ``--module/--config``); the rest of this module is 0.2.2's.

Same flags as ``python -m torchtitan.train``. Adds the ``[seq1f1b]`` config section, the
Seq1F1B schedules, CPU/gloo support when there is no GPU, the offline ``pycode`` dataset, and a
trainer whose pipeline loss is divided by the global token count *before* backward. Importing
this module changes nothing; :func:`run` installs the patches for the run and undoes them.
"""

from __future__ import annotations

import os
import sys

from . import assets, cpu, spec
from .common import process_groups_destroyed
from .versions import TITAN_0_3, titan_generation

CONFIG_MODULE = "torchtitan_integration.config"


def _toml_names_config_module(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        path = a.split("=", 1)[1] if a.startswith("--job.config_file=") else None
        if a in ("--job.config_file", "--job.config-file") and i + 1 < len(argv):
            path = argv[i + 1]
        if path and os.path.exists(path):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            with open(path, "rb") as f:
                return "custom_config_module" in tomllib.load(f).get("job", {})
    return False


def _with_config_module(argv: list[str]) -> list[str]:
    """Add our config module unless the command line or the TOML already names one."""
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if any(a.startswith(flags) for a in argv) or _toml_names_config_module(argv):
        return argv
    return [*argv, "--job.custom_config_module", CONFIG_MODULE]


def run() -> None:
    """The entry point for the installed torchtitan (found by feature: :mod:`.versions`)."""
    if titan_generation() == TITAN_0_3:
        from .v03.train import run as run_0_3

        return run_0_3()
    return run_0_2()


def run_0_2() -> None:
    """torchtitan 0.2.2: the only place that installs the CPU patches (for this process)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with cpu.cpu_support():  # before torchtitan is imported; undone when training ends
        from torchtitan.train import main

        from .trainer import Seq1F1BTrainer

        assets.ensure_assets()
        assets.register_dataset()
        spec.register()
        sys.argv = [sys.argv[0], *_with_config_module(sys.argv[1:])]
        with process_groups_destroyed():  # torchtitan destroys them only after a success
            main(Seq1F1BTrainer)


if __name__ == "__main__":
    run()
