"""Train entry (torchtitan's TRAIN_FILE): ``python -m torchtitan_integration.train``.

Dispatches on the installed torchtitan, found by feature (:mod:`.versions`): 0.2.2 to
:mod:`.v022.train` (torchtitan's flags, ``--job.config_file X.toml``), 0.3 to
:mod:`.v03.train` (the same TOML and overrides mapped onto 0.3's config, or 0.3's
``--module/--config``). Importing this module changes nothing; each version's ``run()``
installs its patches for the run and undoes them.
"""

from __future__ import annotations

from .versions import TITAN_0_3, titan_generation


def run() -> None:
    """The entry point for the installed torchtitan."""
    if titan_generation() == TITAN_0_3:
        from .v03.train import run as run_version
    else:
        from .v022.train import run as run_version
    run_version()


if __name__ == "__main__":
    run()
