"""Scoped patch lists: how this integration reassigns a torch or torchtitan name.

Each torchtitan version folder lists every reassignment it makes in its ``patches.py``, as
:class:`Patch` entries (which name, replaced by what) grouped by the scope they hold for (the
run, the trainer's ``__init__``, one train step, ...); :func:`applied` installs one group for
the length of a ``with`` block and puts every original back when the block ends, also on
error. The names themselves come from the version's seam (``_titan.py``). Nothing here imports
torchtitan; the library (``seq1f1b/``) reassigns nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["Installed", "Patch", "Target", "applied", "install", "install_cpu_support"]


@dataclass(frozen=True)
class Target:
    """A module attribute by name (``module`` is imported only when the name is used)."""

    module: str
    attr: str

    def get(self) -> Any:
        """The attribute's current value (imports the module)."""
        owner, attr = _owner(importlib.import_module(self.module), self.attr)
        return getattr(owner, attr)


def _owner(module: Any, attr: str) -> tuple[Any, str]:
    """The object holding ``attr`` (``"Class.method"``: the class in ``module``) and its
    last name."""
    *path, last = attr.split(".")
    for name in path:
        module = getattr(module, name)
    return module, last


@dataclass(frozen=True)
class Patch:
    """``target`` replaced by ``make(original, *scope_args)`` while its scope lasts.

    ``optional``: skipped when the module is not imported yet or lacks the attribute (the
    modules that copied a value at import, which a release may not have).
    """

    target: Target
    make: Callable[..., Any]
    optional: bool = False

    @classmethod
    def to(cls, target: Target, value: Any, optional: bool = False) -> Patch:
        """A patch that sets ``value`` whatever the original and the scope."""
        return cls(target, lambda *_: value, optional)


_MISSING = object()


class Installed:
    """What an :func:`install` changed, so that :meth:`uninstall` can put it back."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr, _MISSING)))
        setattr(owner, attr, value)

    def uninstall(self) -> None:
        """Restore every original, last change first (twice is harmless)."""
        for owner, attr, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        self._saved.clear()


def install(patches: Iterable[Patch], *args: Any) -> Installed:
    """Apply ``patches`` in order (``args``: the scope's arguments to each ``make``); on an
    error the ones already applied are undone."""
    done = Installed()
    try:
        for patch in patches:
            name = patch.target
            owner = sys.modules.get(name.module) if patch.optional else None
            if patch.optional and (owner is None or not hasattr(owner, name.attr)):
                continue
            owner, attr = _owner(owner or importlib.import_module(name.module), name.attr)
            done.set(owner, attr, patch.make(getattr(owner, attr, None), *args))
    except BaseException:
        done.uninstall()
        raise
    return done


@contextlib.contextmanager
def applied(patches: Iterable[Patch], *args: Any) -> Iterator[Installed]:
    """``patches`` for the length of a ``with`` block."""
    done = install(patches, *args)
    try:
        yield done
    finally:
        done.uninstall()


def install_cpu_support(
    patches: Iterable[Patch],
    *,
    import_first: Iterable[str] = (),
    while_importing: Iterable[Patch] = (),
) -> Installed | None:
    """A version's CPU/gloo patches, or None when CUDA is available (nothing to do).

    ``import_first``: torchtitan modules imported first with ``while_importing`` in place (and
    undone right after), for a torchtitan that reads the device once, at import.
    """
    if torch.cuda.is_available():
        return None
    with applied(while_importing):
        for name in import_first:
            importlib.import_module(name)
    installed = install(patches)
    logger.info("torchtitan runs on CPU with gloo (no CUDA device found)")
    return installed
