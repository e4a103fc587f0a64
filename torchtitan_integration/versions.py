"""Which torchtitan is installed, found by feature (its files), without importing it.

torchtitan picks its device when first imported, so the CPU patches must come before that:
this module only looks at the installed package's layout, as :mod:`seq1f1b._runtime` detects
torch features instead of comparing version strings.

* ``"0.2"``: TOML configs and train specs (``torchtitan/protocols/train_spec.py``), 0.2.2.
* ``"0.3"``: config functions and a configurable ``Trainer`` (``torchtitan/trainer.py`` with
  ``torchtitan/config/configurable.py``), 0.3.0.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["TITAN_0_2", "TITAN_0_3", "titan_generation"]

TITAN_0_2 = "0.2"
TITAN_0_3 = "0.3"


def _package_dir() -> Path | None:
    spec = importlib.util.find_spec("torchtitan")  # a top-level package: not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def titan_generation() -> str | None:
    """``"0.2"`` or ``"0.3"`` for the installed torchtitan; None when it is not installed.

    Raises for a layout neither generation has, naming what was looked for.
    """
    root = _package_dir()
    if root is None:
        return None
    if (root / "protocols" / "train_spec.py").exists():
        return TITAN_0_2
    if (root / "trainer.py").exists() and (root / "config" / "configurable.py").exists():
        return TITAN_0_3
    raise RuntimeError(
        f"torchtitan at {root} has neither 0.2's train specs (protocols/train_spec.py) nor "
        "0.3's configurable Trainer (trainer.py, config/configurable.py): install "
        "torchtitan 0.2.2 or 0.3.0 (TORCHTITAN_VERSION=... scripts/setup_env.sh)"
    )
