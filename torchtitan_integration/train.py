"""Train entry (torchtitan's TRAIN_FILE): ``python -m torchtitan_integration.train``.

Dispatches on the installed torchtitan, found by feature (:mod:`.versions`): 0.2.2 to
:mod:`.v022.train` (torchtitan's flags, ``--job.config_file X.toml``), 0.3 to
:mod:`.v03.train` (the same TOML and overrides mapped onto 0.3's config, or 0.3's
``--module/--config``). Importing this module changes nothing; each version's ``run()``
installs its patches for the run and undoes them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .config import RENAMED, config_file_arg, load_toml
from .versions import TITAN_0_3, titan_generation


def refuse_renamed_keys(argv: Sequence[str]) -> None:
    """A renamed ``[seq1f1b]`` key in the TOML (``--job.config_file``) or on the command line
    is an error naming its new name, on either torchtitan, before anything starts."""
    found: list[str] = []
    for arg in argv:
        key = arg.partition("=")[0]
        name = key[len("--seq1f1b.") :].replace("-", "_") if key.startswith("--seq1f1b.") else ""
        if name in RENAMED:
            found.append(f"--seq1f1b.{name} (now --seq1f1b.{RENAMED[name]})")
    path = config_file_arg(argv)
    if path:
        try:
            section = load_toml(path).get("seq1f1b", {})
        except (OSError, ValueError):  # tomllib.TOMLDecodeError is a ValueError
            section = {}  # torchtitan reports an unreadable file itself
        found += [f"[seq1f1b] {k} in {path} (now {RENAMED[k]})" for k in section if k in RENAMED]
    if found:
        raise SystemExit(
            "seq1f1b: renamed key(s): " + "; ".join(found) + ". The values are the same "
            "('uniform', 'compute' or lengths): rename the key."
        )


def run() -> None:
    """The entry point for the installed torchtitan."""
    refuse_renamed_keys(sys.argv[1:])
    if titan_generation() == TITAN_0_3:
        from .v03.train import run as run_version
    else:
        from .v022.train import run as run_version
    run_version()


if __name__ == "__main__":
    run()
