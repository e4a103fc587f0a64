"""pytest: helper modules and benchmarks/ come from ``pythonpath`` in pyproject.toml.

The tiers are chosen by markers on the tests themselves (``fast``, ``titan_grid``,
``default_release_only``, ``gpu``; :mod:`tiers` for a sample of a grid). Markers are strict
(``--strict-markers`` in pyproject.toml), so a misspelt tier marker fails the collection
instead of silently leaving a test out of its tier; and a test marked for two tiers that
exclude each other fails it too.

The multi-rank tests' worker processes (:mod:`dist_utils`) are stopped when the session ends.
"""

from __future__ import annotations

import sys

import pytest

#: marker pairs no test may carry together: the fast tier runs in minutes on 2 cores
EXCLUSIVE = (("fast", "titan_grid"), ("fast", "gpu"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    bad = [
        f"{item.nodeid}: marked both {a!r} and {b!r}"
        for item in items
        for a, b in EXCLUSIVE
        if item.get_closest_marker(a) and item.get_closest_marker(b)
    ]
    if bad:
        raise pytest.UsageError("tier markers that exclude each other:\n" + "\n".join(bad))


def pytest_sessionfinish(session: pytest.Session) -> None:
    dist_utils = sys.modules.get("dist_utils")  # imported only if a multi-rank test ran
    if dist_utils is not None:
        dist_utils.close_pools()
    titan_utils = sys.modules.get("titan_utils")  # imported only if a torchtitan test ran
    if titan_utils is not None:
        titan_utils.close_launcher()
