"""The torchtitan integration's structure: a core that imports no torchtitan, private
torchtitan names only in each version's seam, and patch scopes that undo themselves."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

from torchtitan_integration.patches import Patch, Target, applied

pytestmark = pytest.mark.fast

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_integration"
VERSIONS = ("v022", "v03")


def _torchtitan_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every ``torchtitan`` import in ``path``, lazy ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "torchtitan":
                found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "torchtitan"]
    return found


def test_the_core_imports_no_torchtitan() -> None:
    offenders = [
        f"{path.name}: {module}"
        for path in sorted(PACKAGE.glob("*.py"))
        for module, _ in _torchtitan_imports(path)
    ]
    assert not offenders, "core modules import torchtitan (use a version's seam): " + str(offenders)


def test_private_torchtitan_names_only_in_each_seam() -> None:
    offenders = []
    for version in VERSIONS:
        for path in sorted((PACKAGE / version).glob("*.py")):
            if path.name == "_titan.py":
                continue
            for module, names in _torchtitan_imports(path):
                private = [n for n in names if n.startswith("_")]
                private += [p for p in module.split(".") if p.startswith("_")]
                if private:
                    offenders.append(f"{version}/{path.name}: {module} {private}")
    assert not offenders, "private torchtitan names outside _titan.py: " + str(offenders)


def test_each_version_has_the_same_roles() -> None:
    roles = [sorted(p.name for p in (PACKAGE / v).glob("*.py")) for v in VERSIONS]
    shared = {"__init__.py", "_titan.py", "patches.py", "model.py", "pipeline.py"}
    shared |= {"validate.py", "trainer.py", "train.py"}
    for version, names in zip(VERSIONS, roles, strict=True):
        assert shared <= set(names), f"{version} lacks {sorted(shared - set(names))}"


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("_seq1f1b_fake_titan")
    module.f = "original"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_scope_restores_every_original_also_on_error(fake_module: types.ModuleType) -> None:
    target = Target(fake_module.__name__, "f")
    added = Target(fake_module.__name__, "g")
    scope = (Patch(target, lambda original, x: f"{original}+{x}"), Patch.to(added, 1))
    with pytest.raises(RuntimeError, match="inside"), applied(scope, "arg"):
        assert (fake_module.f, fake_module.g) == ("original+arg", 1)
        raise RuntimeError("inside")
    assert fake_module.f == "original"
    assert not hasattr(fake_module, "g")  # an attribute the scope added is removed again


def test_optional_patches_skip_what_is_not_there(fake_module: types.ModuleType) -> None:
    absent_attr = Patch.to(Target(fake_module.__name__, "missing"), 1, optional=True)
    absent_module = Patch.to(Target("_seq1f1b_not_imported", "x"), 1, optional=True)
    with applied((absent_attr, absent_module)):
        assert not hasattr(fake_module, "missing")
        assert "_seq1f1b_not_imported" not in sys.modules


def test_a_failing_patch_undoes_the_ones_before_it(fake_module: types.ModuleType) -> None:
    def fail(_original: object) -> None:
        raise ValueError("cannot make it")

    scope = (Patch.to(Target(fake_module.__name__, "f"), "new"),)
    scope += (Patch(Target(fake_module.__name__, "f"), fail),)
    with pytest.raises(ValueError, match="cannot make it"), applied(scope):
        pass
    assert fake_module.f == "original"


def test_renamed_seq1f1b_keys_are_refused_naming_the_new_name(tmp_path: Path) -> None:
    """``[seq1f1b] split`` became ``seq_split`` (the API's name): the old key, in the TOML or on
    the command line, stops the train entry before anything starts, naming the new one, on
    either torchtitan; the new key passes."""
    from torchtitan_integration.train import refuse_renamed_keys

    old = tmp_path / "old.toml"
    old.write_text('[seq1f1b]\nseq_chunks = 4\nsplit = "compute"\n')
    new = tmp_path / "new.toml"
    new.write_text('[seq1f1b]\nseq_chunks = 4\nseq_split = "compute"\n')
    with pytest.raises(SystemExit, match=r"\[seq1f1b\] split in .*old.toml \(now seq_split\)"):
        refuse_renamed_keys(["--job.config_file", str(old)])
    with pytest.raises(SystemExit, match=r"--seq1f1b.split \(now --seq1f1b.seq_split\)"):
        refuse_renamed_keys([f"--job.config_file={new}", "--seq1f1b.split=uniform"])
    refuse_renamed_keys(["--job.config_file", str(new), "--seq1f1b.seq_split", "uniform"])
