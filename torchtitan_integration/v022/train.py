"""The train entry on torchtitan 0.2.2 (``torchtitan_integration.train`` dispatches here).

Same flags as ``python -m torchtitan.train``. Adds the ``[seq1f1b]`` config section, the
Seq1F1B schedules, CPU/gloo support when there is no GPU (:mod:`.patches`, installed for the
run and undone at its end), the offline ``pycode`` dataset, and a trainer whose pipeline loss
is divided by the global token count *before* backward.
"""

from __future__ import annotations

import os
import sys

from .. import assets
from ..common import process_groups_destroyed
from ..config import config_file_arg, load_toml
from . import _titan, patches, spec

CONFIG_MODULE = "torchtitan_integration.config"


def _toml_names_config_module(argv: list[str]) -> bool:
    path = config_file_arg(argv)
    return (
        bool(path)
        and os.path.exists(path)
        and ("custom_config_module" in load_toml(path).get("job", {}))
    )


def with_config_module(argv: list[str]) -> list[str]:
    """Add our config module unless the command line or the TOML already names one."""
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if any(a.startswith(flags) for a in argv) or _toml_names_config_module(argv):
        return argv
    return [*argv, "--job.custom_config_module", CONFIG_MODULE]


def print_help(argv: list[str]) -> None:
    """``--help``: usage and the [seq1f1b] keys, then torchtitan 0.2.2's own help (tyro, with
    our config module merged, so its [seq1f1b] section is listed there too); exits."""
    from torchtitan.config import ConfigManager

    from ..config import USAGE, seq1f1b_help

    print(f"{USAGE}\n\n{seq1f1b_help()}\n\ntorchtitan 0.2.2 options:", flush=True)
    ConfigManager().parse_args(with_config_module(argv))  # tyro prints the help and exits


def run() -> None:
    """Train with the command line's config; the only place that installs the CPU patches."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv
    cpu = patches.install_cpu()  # before torchtitan is imported
    try:
        if any(a in ("-h", "--help") for a in argv[1:]):
            print_help(argv[1:])  # (torchtitan's tyro help exits)
            return
        from torchtitan.train import main

        from .trainer import Seq1F1BTrainer

        assets.ensure_assets()
        assets.register_dataset(_titan.DATASET_CONFIG.get(), _titan.DATASETS.get())
        spec.register()
        sys.argv = [argv[0], *with_config_module(argv[1:])]  # torchtitan's main parses it
        with process_groups_destroyed():  # torchtitan destroys them only after a success
            main(Seq1F1BTrainer)
    finally:
        sys.argv = argv
        if cpu is not None:
            cpu.uninstall()
