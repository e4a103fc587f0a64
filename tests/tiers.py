"""The tiers' selection, written on the tests themselves: a whole file carries
``pytestmark = pytest.mark.fast``, one test ``@pytest.mark.fast``, and a sample of a
parametrized grid :func:`fast_at`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

__all__ = ["fast_at"]


def fast_at(values: Iterable[Any], *fast: Any) -> list[Any]:
    """``values`` for ``parametrize``, the ones in ``fast`` also in the fast tier."""
    return [pytest.param(v, marks=pytest.mark.fast) if v in fast else v for v in values]
