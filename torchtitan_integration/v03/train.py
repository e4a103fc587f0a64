"""The train entry on torchtitan 0.3 (``torchtitan_integration.train`` dispatches here).

Two command lines, one trainer:

* ``--job.config_file X.toml [--section.key value ...]`` (what ``run_train.sh`` passes): the
  0.2.2-style TOML mapped onto 0.3's config (:mod:`.toml`);
* ``--module M --config F [--section.key value ...]``: 0.3's own, through its
  ``ConfigManager`` (tyro).

Then the run goes as in ``torchtitan.train.main``: seed checkpoint or training, then close.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..common import process_groups_destroyed
from .toml import build_config


def _toml_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The ``--job.config_file`` value and the remaining arguments."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--job.config_file=", "--job.config-file=")):
            path = a.split("=", 1)[1]
        elif a in ("--job.config_file", "--job.config-file") and i + 1 < len(argv):
            path = argv[i + 1]
            i += 1
        else:
            rest.append(a)
        i += 1
    return path, rest


def parse(argv: list[str]) -> Any:
    """The trainer config from either command line."""
    if any(a == "--module" or a.startswith("--module=") for a in argv):
        from torchtitan.config import ConfigManager

        return ConfigManager().parse_args(argv)
    path, rest = _toml_path(argv)
    return build_config(path, rest)


def print_help(argv: list[str]) -> None:
    """``--help`` of the TOML command line: usage, the [seq1f1b] keys and every torchtitan
    0.3 option this launcher maps (for the TOML's model, or the debug Llama3)."""
    from ..config import USAGE, seq1f1b_help
    from .configs import seq1f1b_model
    from .toml import options_help

    path, _ = _toml_path([a for a in argv if a not in ("-h", "--help")])
    values: dict[str, Any] = {}
    if path is not None and os.path.exists(path):
        from ..config import load_toml

        values = load_toml(path).get("model", {})
    config = seq1f1b_model(
        str(values.get("name", "llama3")), str(values.get("flavor", "debugmodel"))
    )
    print(f"{USAGE}\n\n{seq1f1b_help()}\n\n{options_help(config)}")


def run(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    native = any(a == "--module" or a.startswith("--module=") for a in args)
    if not native and any(a in ("-h", "--help") for a in args):  # tyro's help on --module
        print_help(args)
        return
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    config = parse(args)
    if getattr(getattr(config, "seq1f1b", None), "dry_run", False):  # nothing trains: the
        # fake world, one process per rank shown
        from .dry_run import dry_run

        dry_run(args)
        return
    with process_groups_destroyed():  # also when training fails
        _train(config, logger)


def _train(config: Any, logger: Any) -> None:
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError(
                    "--checkpoint.create_seed_checkpoint needs a single process (NGPU=1): the "
                    "seed checkpoint must be unsharded"
                )
            if not config.checkpoint.enable:
                raise ValueError("--checkpoint.create_seed_checkpoint needs --checkpoint.enable")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
