"""The package's import structure: layers that import only downward, and no circle.

Every import of a ``seq1f1b`` module (lazy ones inside functions included) is read from the
source and checked against :data:`LAYERS`: a module may import its own folder and anything in
a lower layer, never a layer above it or a folder beside it on the same layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parent.parent / "seq1f1b"

#: layer of each top-level entry of the package (folders and modules), bottom up
LAYERS = {
    "_runtime": 0,  # the seam to torch and its passes on torch's action IR
    "attention": 1,
    "orders": 1,
    "schedules": 2,
    "chunked_loss": 2,
    "huggingface": 2,
    "testing": 2,
    "bitpipe": 3,
    "verify": 3,
    "registry": 4,
    "planning": 5,
    "__init__": 6,
}


def _modules() -> dict[str, Path]:
    """Dotted name under seq1f1b (``attention.kv``; ``""`` for the package) -> file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The seq1f1b modules ``name`` imports (a ``from pkg import module`` counts the module)."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    if name == "":
        package = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "seq1f1b" or node.module.startswith("seq1f1b.")):
                target = node.module[len("seq1f1b.") :] if node.module != "seq1f1b" else ""
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "seq1f1b" or alias.name.startswith("seq1f1b."):
                    found.add(alias.name[len("seq1f1b.") :] if alias.name != "seq1f1b" else "")
    found.discard(name)
    return found


def _top(name: str) -> str:
    return name.split(".")[0] if name else "__init__"


def test_every_top_level_entry_has_a_layer_and_there_are_at_most_12() -> None:
    entries = {
        p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert entries == set(LAYERS), entries ^ set(LAYERS)
    assert len(entries) <= 12


def test_imports_point_down_only() -> None:
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for dep in _imports(name, path, set(modules)):
            here, there = _top(name), _top(dep)
            if here == there:
                continue
            if LAYERS[there] >= LAYERS[here]:
                bad.append(f"{name or 'seq1f1b'} (layer {LAYERS[here]}) imports {dep} "
                           f"(layer {LAYERS[there]})")  # fmt: skip
    assert not bad, "\n".join(bad)


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {n: _imports(n, p, set(modules)) & set(modules) for n, p in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle of modules
    for n in graph:
        graph[n] = {d for d in graph[n] if not ((d and n.startswith(d + ".")) or (d == "" and n))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                raise AssertionError("import circle: " + " -> ".join(c or "seq1f1b" for c in cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


#: the planner's parts in planning/, bottom up: types, pricing, search, report, the command
#: line, and the façade that re-exports them
PLANNER_PARTS = ("plan_types", "pricing", "search", "reporting", "cli", "planner")


def test_the_planner_parts_import_only_the_parts_below() -> None:
    """Each of the planner's modules imports only the parts before it in
    :data:`PLANNER_PARTS`, so that pricing a setting needs no search and the search no command
    line; the façade (``planning.planner``) comes last."""
    modules = _modules()
    parts = [f"planning.{p}" for p in PLANNER_PARTS]
    bad = []
    for i, name in enumerate(parts):
        deps = _imports(name, modules[name], set(modules)) & set(parts)
        bad += [f"{name} imports {d}" for d in sorted(deps) if parts.index(d) > i]
    assert not bad, "\n".join(bad)


#: lines of ``ScheduleInterleaved1F1B`` in torch 2.15.0, the current release (2.13's is 114)
TORCH_INTERLEAVED_1F1B_LINES = 142


def test_no_schedule_class_longer_than_torchs_interleaved_1f1b() -> None:
    """Schedule classes read like torch's: what is not the schedule (input cutting, checks,
    K/V bookkeeping, pair sync) lives in collaborators, so no schedule class is longer than
    torch's ``ScheduleInterleaved1F1B`` of the current release."""
    import inspect

    import torch
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    limit = TORCH_INTERLEAVED_1F1B_LINES
    if torch.__version__.startswith("2.15."):  # the reference release: the number is its own
        assert len(inspect.getsourcelines(ScheduleInterleaved1F1B)[0]) == limit
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "_runtime":  # the seam's runtime is torch's runtime, not a schedule
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [getattr(b, "attr", None) or getattr(b, "id", "") for b in
                     getattr(node, "bases", ())]  # fmt: skip
            is_schedule = isinstance(node, ast.ClassDef) and any(
                b.endswith(("UnitRuntime", "PipelineSchedule", "Seq1F1B")) for b in bases
            )
            size = node.end_lineno - node.lineno + 1 if is_schedule else 0
            if size > limit:
                long.append(f"{path.relative_to(PACKAGE)}: {node.name}, {size} lines > {limit}")
    assert len(long) == 0, "\n".join(long)


#: the private methods a Seq1F1B layer may override: patch 6's hooks, and torch's own hooks of a
#: schedule (its order, its split of the step's inputs, its merge of the outputs)
LAYER_HOOKS = {
    "_calculate_single_rank_operations",
    "_get_microbatch_inputs",
    "_merge_outputs",
    "_lengths_for",
    "_agree_seq_len",
    "_loss_weight",
}


def test_the_package_schedules_are_layers_over_the_upstream_class() -> None:
    """``seq1f1b.ScheduleSeq1F1B`` and its kin are patch 6's class (schedules/upstream.py,
    verbatim) with hooks answered: they derive from it, and of the private methods it and
    torch's runtime define, they override only :data:`LAYER_HOOKS` (public hooks of the seam's
    ``UnitRuntime`` aside), so a fix to the class is a fix to the package's schedules."""
    import seq1f1b
    from seq1f1b.schedules import upstream

    schedules = [seq1f1b.ScheduleSeq1F1B, seq1f1b.ScheduleInterleavedSeq1F1B,
                 seq1f1b.ScheduleZBSeq1F1B, seq1f1b.ScheduleZBVSeq1F1B]  # fmt: skip
    wrong = []
    for cls in schedules:
        assert issubclass(cls, upstream.ScheduleSeq1F1B), cls
        layers = cls.__mro__[: cls.__mro__.index(upstream.ScheduleSeq1F1B)]
        for layer in layers:
            for name in vars(layer):
                inherited = hasattr(upstream.ScheduleSeq1F1B, name)
                method = callable(vars(layer)[name]) and not name.startswith("__")
                if method and name.startswith("_") and inherited and name not in LAYER_HOOKS:
                    wrong.append(f"{layer.__name__}.{name}")
    assert not wrong, f"layers override private methods that are not hooks: {sorted(set(wrong))}"


def test_importing_the_library_does_not_load_the_planner() -> None:
    """The planning layer is a tool on the library: ``import seq1f1b`` leaves it unloaded
    (a fresh interpreter), and ``seq1f1b.MemoryCappedSplit`` still resolves, on first use."""
    import subprocess
    import sys

    code = (
        "import sys, seq1f1b\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('seq1f1b.planning'))\n"
        "assert not loaded, loaded\n"
        "from seq1f1b import MemoryCappedSplit, SequenceSplit\n"
        "assert issubclass(MemoryCappedSplit, SequenceSplit)\n"
        "assert 'seq1f1b.planning.split_search' in sys.modules\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
