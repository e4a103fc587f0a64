"""benchmarks/ names no module or folder like one in seq1f1b/, so an import or a traceback
always says which of the two is meant (both trees deal in calibration, masks, replay...); and
its text says what and why, not history (no issue numbers, no commit hashes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def module_names(tree: Path) -> dict[str, list[str]]:
    """Name of every module and package under ``tree`` (``__init__``/``__main__`` aside) ->
    where it is, relative to the checkout."""
    names: dict[str, list[str]] = {}
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.stem not in ("__init__", "__main__"):
            names.setdefault(path.stem, []).append(rel)
        elif path.stem == "__init__" and path.parent != tree:
            names.setdefault(path.parent.name, []).append(path.parent.relative_to(ROOT).as_posix())
    return names


def test_module_names_collect_both_files_and_folders() -> None:
    names = module_names(ROOT / "seq1f1b")
    assert "seq1f1b/attention" in names["attention"]
    assert "seq1f1b/attention/masks.py" in names["masks"]


def test_no_benchmark_module_shadows_a_library_module() -> None:
    library = module_names(ROOT / "seq1f1b")
    benchmarks = module_names(ROOT / "benchmarks")
    clashes = [
        f"{', '.join(benchmarks[n])} is named like {', '.join(library[n])}: rename the benchmark"
        for n in sorted(benchmarks.keys() & library.keys())
    ]
    assert not clashes, "\n".join(clashes)


#: an issue number or a commit hash: history, which belongs in git, not in the code
HISTORY = re.compile(
    r"\b(?:issue|PR|pull request)s? ?#?\d+|\b(?:at|since|before|after|commit) [0-9a-f]{7,40}\b",
    re.I,
)


def test_history_pattern_finds_issue_numbers_and_hashes() -> None:
    assert HISTORY.search("Issue 22's targets") and HISTORY.search("48 at cf73c1e")
    assert not HISTORY.search('pp=2, M=2, 4096 tokens, edgecolor="#333333"')


def test_benchmarks_say_what_and_why_not_history() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "benchmarks").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not found, "\n".join(found)
