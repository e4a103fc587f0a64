"""The code proposed to torch and the package's are one implementation: each verbatim module's
block (between ``# upstream: begin`` and ``# upstream: end``) must appear, line for line, among
the lines its patch adds to torch's file."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
SERIES = ROOT / "upstream" / "series"
#: verbatim module -> (its patch, the torch file the patch adds the block to)
VERBATIM = {
    "seq1f1b/orders/upstream.py": ("0006-", "torch/distributed/pipelining/schedules.py"),
    "seq1f1b/schedules/upstream.py": ("0006-", "torch/distributed/pipelining/schedules.py"),
}


def block_of(module: str) -> list[str]:
    """The lines between the module's markers."""
    lines = (ROOT / module).read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith("# upstream: begin"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# upstream: end"))
    assert begin < end, f"{module}: markers out of order"
    return lines[begin + 1 : end]


def added_lines(patch: Path, target: str) -> list[str]:
    """The lines ``patch`` adds to ``target`` (every hunk, in order)."""
    out: list[str] = []
    current = None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
        elif current == target and line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
    return out


def contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


@pytest.mark.parametrize("module", sorted(VERBATIM))
def test_verbatim_module_is_the_patch_code(module: str) -> None:
    prefix, target = VERBATIM[module]
    (patch,) = SERIES.glob(f"{prefix}*.patch")
    block = block_of(module)
    assert len(block) > 50, f"{module}: the block is nearly empty"
    added = added_lines(patch, target)
    assert contains(added, block), (
        f"{module} differs from what {patch.name} adds to {target}: change both (the patch is "
        "written in upstream/.work, see upstream/README.md), then regenerate the series"
    )


def test_a_changed_line_is_found() -> None:
    """The check sees a one-character change (it is not vacuous)."""
    module = next(iter(VERBATIM))
    prefix, target = VERBATIM[module]
    (patch,) = SERIES.glob(f"{prefix}*.patch")
    block = block_of(module)
    changed = [*block[:10], block[10] + " ", *block[11:]]
    assert contains(added_lines(patch, target), block)
    assert not contains(added_lines(patch, target), changed)
