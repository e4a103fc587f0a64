"""The seam to torch's internals (seq1f1b/_runtime/): one place, and what it guards.

* no private ``torch.distributed.pipelining`` name is used outside the seam;
* outside the seam, every name taken from it (under any alias) is in its lists: the IR
  ``VOCABULARY``, its ``API``, and ``reference`` (torch's own passes, compared with in tests/
  and benchmarks/ only, and only through that one module, which the seam's table lists);
* a receive that was not sized per unit is an error, never silently wrong data;
* pre-split samples (torch's ``step(arg_mbs=..., target_mbs=...)``) give the same gradients;
* torch 2.15's runtime options pass through (and are refused clearly before 2.15).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_ranks
from equivalence import CFG, Case, data, loss_fn, reference, rel_err
from mockstages import mock_stages
from torch.distributed.pipelining import PipelineStage

import seq1f1b._runtime as rt
from seq1f1b import ScheduleSeq1F1B
from seq1f1b._runtime import reference as torch_ref
from seq1f1b.schedules.upstream import _SequenceRecvMeta
from seq1f1b.testing import build_stages

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {"venv", "site-packages", "build", "dist", "__pycache__"}


#: the runtime layer's own passes over torch's action IR (lowering, replay, stage topology):
#: they live beside the seam but reach torch only through it, like any module outside
PASSES = ("lowering", "replay", "topology")


def _outside_the_seam() -> list[Path]:
    """Every .py file of the checkout outside the seam's torch-facing modules (seq1f1b/_runtime/
    less :data:`PASSES`; no hidden dirs, no venvs): the package, torchtitan_integration, tests,
    benchmarks, examples and scripts."""
    files = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") or p in SKIPPED_DIRS for p in rel.parts[:-1]):
            continue
        if rel.parts[:2] != ("seq1f1b", "_runtime") or path.stem in PASSES:
            files.append(path)
    return files


def _is_private(dotted: str) -> bool:
    """A torch path with a ``_``-prefixed part (a module, attribute or op; dunders aside)."""
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]
    )


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """Every private torch name ``source`` reaches, as (line, dotted path), found from its
    syntax tree: an imported ``_`` module or name (``import torch._dynamo``, ``from
    torch.utils._pytree import tree_flatten``, ``from torch.distributed.pipelining.schedules
    import _Action``), an attribute chain from any name bound to torch or to something imported
    from it (``torch._C._get_obj_in_tls``, ``dist._functional_collectives``,
    ``schedules._Action``, ``torch.ops.aten._scaled_dot_product_flash_attention``), and a
    constant name given to ``getattr``/``hasattr``/``setattr``/``delattr`` on one, or a module
    given to ``importlib.import_module``/``__import__``. Each chain once, at its longest."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch path it holds
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    found.add((node.lineno, a.name))
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "torch":
                for a in node.names:
                    found.add((node.lineno, f"{node.module}.{a.name}"))
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"

    def path_of(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = path_of(expr.value)
            return None if owner is None else f"{owner}.{expr.attr}"
        return None

    inner: set[int] = set()  # attribute nodes that a longer chain contains
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Attribute):
                inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = path_of(node)
            if dotted is not None:
                found.add((node.lineno, dotted))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first, name = node.args[0], node.args[1] if len(node.args) > 1 else None
            if fname in ("getattr", "hasattr", "setattr", "delattr") and path_of(first):
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.add((node.lineno, f"{path_of(first)}.{name.value}"))
            elif fname in ("import_module", "__import__") and isinstance(first, ast.Constant):
                found.add((node.lineno, str(first.value)))
    return sorted((line, dotted) for line, dotted in found if _is_private(dotted))


def test_no_private_torch_name_outside_the_seam() -> None:
    """No allow-list: the verbatim modules (seq1f1b/orders/upstream.py, schedules/upstream.py,
    tests/test_upstream_verbatim.py) bind what torch's code there reads to the seam's names in
    their headers, so their blocks reach no torch internal either."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {dotted}"
        for path in _outside_the_seam()
        for line, dotted in private_torch_names(path.read_text())
    ]
    assert not offenders, (
        "torch internals outside seq1f1b/_runtime/ (reach them through a name of the seam, and "
        "list them in its table):\n" + "\n".join(offenders)
    )


PRIVATE_USES = [
    ("import torch._dynamo\n", "torch._dynamo"),
    ("import torch\ntorch._dynamo.reset()\n", "torch._dynamo.reset"),
    ("import torch\ntorch._C._get_obj_in_tls('context')\n", "torch._C._get_obj_in_tls"),
    ("from torch._prims_common import make_contiguous_strides_for\n",
     "torch._prims_common.make_contiguous_strides_for"),
    ("from torch.utils._pytree import tree_flatten\n", "torch.utils._pytree.tree_flatten"),
    ("from torch.distributed.pipelining.schedules import _Action\n",
     "torch.distributed.pipelining.schedules._Action"),
    ("from torch.distributed.pipelining import schedules as s\ns._validate_schedule\n",
     "torch.distributed.pipelining.schedules._validate_schedule"),
    ("import torch.distributed as dist\ndist.distributed_c10d._get_default_group()\n",
     "torch.distributed.distributed_c10d._get_default_group"),
    ("import torch as T\nT.ops.aten._scaled_dot_product_flash_attention\n",
     "torch.ops.aten._scaled_dot_product_flash_attention"),
    ("from torch import nn\nnn.Module._call_impl\n", "torch.nn.Module._call_impl"),
    ("import torch\ngetattr(torch._utils, '_flatten_dense_tensors')\n",
     "torch._utils._flatten_dense_tensors"),
    ("import torch\nhasattr(torch.distributed, '_composable')\n", "torch.distributed._composable"),
    ("import importlib\nimportlib.import_module('torch._functorch.config')\n",
     "torch._functorch.config"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "name"), PRIVATE_USES)
def test_private_torch_names_are_found(source: str, name: str) -> None:
    assert name in [dotted for _, dotted in private_torch_names(source)], source


def test_public_torch_names_are_not_flagged() -> None:
    source = (
        "import torch\nimport torch.nn.functional as F\nfrom torch.distributed.pipelining "
        "import PipelineStage\nx = torch.zeros(1).__class__\nF.scaled_dot_product_attention\n"
        "torch.compiler.reset()\nself._stages\n_private = 1\n"
    )
    assert private_torch_names(source) == []


def _table_names(doc: str) -> set[str]:
    """The ``_`` names the seam's table lists (a trailing ``*`` in it matches a prefix)."""
    return set(re.findall(r"\b_\w+\*?", doc))


def test_the_seam_table_lists_every_private_name_it_reaches() -> None:
    """The table in seq1f1b/_runtime/__init__.py (or a seam module's own, as fake.py's) names
    every private torch name the seam's modules reach (found as outside, by
    :func:`private_torch_names`), by its last private part: kept in sync with the code."""
    missing = []
    for path in sorted((ROOT / "seq1f1b" / "_runtime").glob("*.py")):
        source = path.read_text()
        listed = _table_names((rt.__doc__ or "") + (ast.get_docstring(ast.parse(source)) or ""))
        prefixes = tuple(n[:-1] for n in listed if n.endswith("*"))
        for line, dotted in private_torch_names(source):
            last = [p for p in dotted.split(".") if p.startswith("_")][-1]
            if last not in listed and not last.startswith(prefixes):
                missing.append(f"{path.name}:{line}: {dotted}")
    assert not missing, "not in the seam's table:\n" + "\n".join(sorted(set(missing)))


# ---------------------------------------------------------------------------- the seam's lists
SEAM = "seq1f1b._runtime"
#: the seam's layers, read as one seam: what is taken from any of them is checked the same way
LAYERS = {SEAM, f"{SEAM}.ir", f"{SEAM}.unit"}
REFERENCE = f"{SEAM}.{rt.REFERENCE}"
#: where torch's own passes may be compared with (through ``reference`` only)
COMPARING = {"tests", "benchmarks"}
#: the lists themselves (and the seam's own description), which tests may read
LISTS = {"VOCABULARY", "API", "REFERENCE", "__all__", "__doc__", "__file__"}


def seam_violations(source: str, rel: str) -> list[str]:
    """What ``source`` (the file at ``rel``, relative to the checkout) takes from the seam and
    may not: every name taken from ``seq1f1b._runtime`` (or its layers), by an import or as an
    attribute of any alias of it, must be in ``VOCABULARY`` or ``API``; torch's own passes
    (``reference.__all__``) are reached only as ``reference.<name>``, from tests/ and
    benchmarks/ only (package modules may still take the few their run needs from ``API``)."""
    parts = PurePosixPath(rel).with_suffix("").parts
    package, comparing = parts[:-1], parts[0] in COMPARING
    aliases: dict[str, str] = {}  # local name -> dotted path, for everything under seq1f1b
    taken: list[tuple[int, str, str]] = []  # (line, seam module, name)
    bad: list[str] = []

    def bind(local: str, path: str) -> None:
        if path == "seq1f1b" or path.startswith("seq1f1b."):
            aliases[local] = path

    def walk_path(line: int, dotted: str) -> None:  # `import a.b.c` takes b from a, c from a.b
        names = dotted.split(".")
        for i in range(1, len(names)):
            owner = ".".join(names[:i])
            if owner == SEAM and names[i] in PASSES:
                return  # the runtime layer's own passes: not the seam's torch-facing lists
            if owner in LAYERS or owner == REFERENCE:
                taken.append((line, owner, names[i]))

    def path_of(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = path_of(expr.value)
            return None if owner is None else f"{owner}.{expr.attr}"
        return None

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bind(a.asname or a.name.split(".")[0], a.name if a.asname else "seq1f1b")
                walk_path(node.lineno, a.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([module] if module else [])])
            walk_path(node.lineno, module)
            for a in node.names:
                if a.name == "*":
                    if module in LAYERS or module == REFERENCE:
                        bad.append(f"{rel}:{node.lineno}: `from {module} import *`")
                    continue
                bind(a.asname or a.name, f"{module}.{a.name}")
                if module in LAYERS or module == REFERENCE:
                    taken.append((node.lineno, module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = path_of(node.value)
            if owner in LAYERS or owner == REFERENCE:
                taken.append((node.lineno, owner, node.attr))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = node.args[0]
            if fname == "vars" and path_of(first) in LAYERS | {REFERENCE}:
                bad.append(f"{rel}:{node.lineno}: vars() of the seam")
            elif fname in ("getattr", "setattr", "hasattr", "delattr"):
                owner = path_of(first)
                if owner in LAYERS or owner == REFERENCE:
                    name = node.args[1] if len(node.args) > 1 else None
                    if isinstance(name, ast.Constant) and isinstance(name.value, str):
                        taken.append((node.lineno, owner, name.value))
                    else:
                        bad.append(f"{rel}:{node.lineno}: {fname}() on the seam, name unknown")
            elif (
                fname in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and str(first.value).startswith(SEAM)
            ):
                bad.append(f"{rel}:{node.lineno}: dynamic import of {first.value}")

    for line, module, name in taken:
        where = f"{rel}:{line}: {module}.{name}"
        if comparing and name in LISTS:
            continue
        if module == REFERENCE or f"{module}.{name}" == REFERENCE:
            if not comparing:
                bad.append(f"{where}: torch's own passes are for tests/ and benchmarks/ only")
            elif module == REFERENCE and name not in torch_ref.__all__:
                bad.append(f"{where}: not in reference.__all__")
        elif f"{module}.{name}" in LAYERS:
            continue  # a layer of the seam: what is taken from it is checked in turn
        elif name in torch_ref.__all__ and (comparing or name not in rt.API):
            bad.append(f"{where}: torch's own pass: compare with it through `reference` only")
        elif name in rt.VOCABULARY or name in rt.API:
            continue
        else:
            bad.append(f"{where}: in neither the seam's VOCABULARY nor its API")
    return bad


def test_every_name_taken_from_the_seam_is_listed() -> None:
    bad: list[str] = []
    for path in _outside_the_seam():
        bad += seam_violations(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not bad, "names taken from seq1f1b._runtime outside its lists:\n" + "\n".join(bad)


def test_the_seam_lists_are_consistent() -> None:
    assert set(rt.VOCABULARY) <= set(rt.__all__)
    assert set(rt.API) == set(rt.__all__) - set(rt.VOCABULARY)
    assert set(rt.__all__) <= set(dir(rt))
    assert set(torch_ref.__all__) <= set(dir(torch_ref))
    assert not set(torch_ref.__all__) & set(rt.VOCABULARY)
    # the seam's table lists reference.py and every torch private it reaches
    assert "reference.py" in (rt.__doc__ or "")
    source = Path(torch_ref.__file__).read_text()
    for private in set(re.findall(r"(?:_schedules|ScheduleRuntime)\.(_\w+)", source)):
        assert private in (rt.__doc__ or ""), private


VIOLATIONS = [
    ("tests/test_x.py", "import seq1f1b._runtime as rt\nrt.add_send_recv({}, None, 1)\n"),
    ("benchmarks/x.py", "from seq1f1b import _runtime\n_runtime.validate_schedule({}, 1, 1, 1)\n"),
    ("tests/test_x.py", "import seq1f1b._runtime\nseq1f1b._runtime.simulate_comms_compute()\n"),
    ("tests/test_x.py", "import seq1f1b\nseq1f1b._runtime.ir.format_pipeline_order({})\n"),
    ("tests/test_x.py", "from seq1f1b._runtime import validate_schedule\n"),
    ("tests/test_x.py", "from seq1f1b._runtime.ir import add_send_recv\n"),
    ("tests/test_x.py", "from seq1f1b._runtime import reference as r\nr.add_reduce_grad([])\n"),
    ("tests/test_x.py", "import seq1f1b._runtime as rt\ngetattr(rt, 'add_send_recv')\n"),
    ("tests/test_x.py", "import seq1f1b._runtime as rt\nname = 'x'\ngetattr(rt, name)\n"),
    ("tests/test_x.py", "from seq1f1b._runtime import *\n"),
    ("tests/test_x.py", "import seq1f1b._runtime as rt\nvars(rt)['add_send_recv']\n"),
    ("tests/test_x.py", "import importlib\nimportlib.import_module('seq1f1b._runtime')\n"),
    ("scripts/x.py", "from seq1f1b._runtime import reference\nreference.lowering([], {}, 1)\n"),
    ("seq1f1b/x.py", "from ._runtime.reference import add_send_recv\n"),
    ("seq1f1b/x.py", "from . import _runtime as rt\nrt.add_send_recv({}, None, 1)\n"),
    ("seq1f1b/bitpipe/x.py", "from .. import _runtime as rt\nrt.reference.lowering([], {}, 1)\n"),
    ("seq1f1b/x.py", "from ._runtime import ir as rt\nrt._schedules\n"),
    ("seq1f1b/x.py", "from ._runtime import API\n"),
]


def test_seam_check_flags_a_torch_pass_under_a_public_name() -> None:
    source = "import seq1f1b._runtime as rt\n\nrt.add_send_recv({}, lambda s: s, 1)\n"
    (found,) = seam_violations(source, "tests/test_x.py")
    assert found.startswith("tests/test_x.py:3: seq1f1b._runtime.add_send_recv: ")


@pytest.mark.parametrize(("rel", "source"), VIOLATIONS)
def test_seam_check_flags_a_violation(rel: str, source: str) -> None:
    assert seam_violations(source, rel), source


ALLOWED = [
    ("tests/test_x.py", "from seq1f1b._runtime import reference as r\nr.add_send_recv({}, f, 1)\n"),
    ("benchmarks/x.py", "import seq1f1b._runtime.reference as r\nr.lowering([], {}, 1)\n"),
    ("tests/test_x.py", "import seq1f1b._runtime as rt\nrt.FORWARD, rt.stand_in_stages(1, 1)\n"),
    ("seq1f1b/bitpipe/x.py", "from .. import _runtime as rt\nrt.validate_schedule({}, 1, 1, 1)\n"),
    (
        "seq1f1b/x.py",
        "from ._runtime import ir as rt\nfrom ._runtime.ir import Action\nrt.UNSHARD\n",
    ),
    ("seq1f1b/x.py", "import seq1f1b._runtime as rt\nrt.Action.FORWARD.value\n"),
]


@pytest.mark.parametrize(("rel", "source"), ALLOWED)
def test_seam_check_allows_the_listed_names(rel: str, source: str) -> None:
    assert seam_violations(source, rel) == []


def test_seam_detects_this_release() -> None:
    # features, not version numbers; the send waits and per-receive buffers came together
    assert rt.HAS_SEND_WAITS == (rt.WAIT_SEND_F is not None)
    assert rt.RECV_BUFFER_PER_RECEIVE == rt.HAS_SEND_WAITS
    assert rt.HAS_WARMUP_P2P != rt.HAS_SEND_WAITS


def test_newer_runtime_options() -> None:
    if rt.RUNTIME_OPTIONS:
        # torch's placement of the backward sends' waits, to compare with torch's lowering
        sched = ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, max_active_stages=2,
                                backward_send_waits="end")  # fmt: skip
        assert sched.lowering_options()["max_active_stages"] == 2
        expected = torch_ref.lowering(
            mock_stages(2, 2), sched.pipeline_order, 4, max_active_stages=2
        )
        assert sched.pipeline_order_with_comms[0] == expected[0]
        # options the fast lowering does not model go to torch's own lowering
        other = ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, unshard_lookahead="auto")
        assert isinstance(other.pipeline_order_with_comms, dict)
    else:
        with pytest.raises(ValueError, match=r"need torch >= 2\.15"):
            ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, max_active_stages=2)


def _unsized_receive_fails(rank: int, world: int) -> None:
    case = Case(1, 3, 1, split=(12, 8, 4))
    mods = build_stages(CFG, world)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 1, 3, loss_fn, seq_split=list(case.split))
    # as if a torch release ignored the per-unit sizes (patch 5's hook, or its emulation)
    _SequenceRecvMeta.__call__ = lambda self, mb_index, kind, arg_index, meta: meta
    x, y = data(case)
    if rank == 1:
        with pytest.raises(RuntimeError, match="received an activation with 12 positions"):
            sched.step(target=y[:1])
        os._exit(0)  # leave at once: the sender's wait then fails instead of timing out
    with pytest.raises(Exception):  # noqa: B017 - the peer is gone; how gloo says it varies
        sched.step(x[:1])
    os._exit(0)


def test_unsized_receive_is_an_error_not_wrong_data() -> None:
    run_ranks(_unsized_receive_fails, 2, fresh=True)  # it patches the seam and ends its ranks


def _presplit(rank: int, world: int) -> None:
    case = Case(1, 2, 2, split=(14, 10))
    ref_loss, ref_grads = reference(case, world)
    mods = build_stages(CFG, world)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn, seq_split=list(case.split))
    x, y = data(case)
    xs, ys = list(torch.tensor_split(x, 2)), list(torch.tensor_split(y, 2))
    losses: list[torch.Tensor] = []
    if rank == 0:
        sched.step(arg_mbs=[(t,) for t in xs])
    else:
        sched.step(target_mbs=ys, losses=losses)
        assert abs(torch.stack(losses).mean().item() - ref_loss) <= 1e-5 * ref_loss
    for n, p in mods[rank].named_parameters():
        assert rel_err(p.grad, ref_grads[f"{rank}.{n}"]) <= 1e-5, n


def test_presplit_samples_match_reference() -> None:
    run_ranks(_presplit, 2)


def test_presplit_needs_one_entry_per_sample() -> None:
    sched = ScheduleSeq1F1B(mock_stages(1, 1), 2, 2)
    with pytest.raises(ValueError, match="n_microbatches=2 samples"):
        sched.step(arg_mbs=[(torch.zeros(1, 4),)])
    with pytest.raises(ValueError, match="not both"):
        sched.step(torch.zeros(2, 4), arg_mbs=[(torch.zeros(1, 4),)] * 2)


def test_receive_metadata_is_patch_6s_and_contiguous() -> None:
    """Each unit's receive metadata is patch 6's (``_SequenceRecvMeta``, in
    seq1f1b/schedules/upstream.py): contiguous whatever layout torch inferred (p2p backends
    receive into contiguous buffers), a DTensor's global shape in proportion."""
    plain = rt.DTensorMeta.__bases__[0]  # torch's plain tensor metadata
    sizing = _SequenceRecvMeta(seq_dim=1)
    sizing.lengths = (8, 4)
    transposed = plain(torch.Size([2, 8, 4]), (1, 8, 2), torch.float32, True)
    for unit, n in enumerate(sizing.lengths):
        out = sizing(unit, "activation", 0, transposed)
        assert (out.shape, tuple(out.stride)) == (torch.Size([2, n, 4]), (4 * n, 4, 1))
    sharded = rt.DTensorMeta(torch.Size([2, 4, 4]), (16, 4, 1), torch.float32, True,
                             torch.Size([2, 8, 4]), (1, 8, 2), None, None, None)  # fmt: skip
    out = sizing(1, "activation", 1, sharded)  # 2 of this rank's positions: 4 in all
    assert (out.shape, out.global_shape) == (torch.Size([2, 2, 4]), torch.Size([2, 4, 4]))
    assert (tuple(out.stride), tuple(out.global_stride)) == ((8, 4, 1), (16, 4, 1))


def _sized(lengths: list[int], inferred: int) -> list[int]:
    """Each unit's receive length at dim 1, as this torch sizes it with patch 6's sizing, for
    a stage that inferred ``inferred`` positions from unit 0."""
    plain = rt.DTensorMeta.__bases__[0]  # torch's plain tensor metadata
    meta = plain(torch.Size([2, inferred, 3]), (3 * inferred, 3, 1), torch.float32, True)
    infos = {
        u: [SimpleNamespace(is_root_arg=False, tensor_meta=meta, buffer=torch.empty(meta.shape))]
        for u in range(len(lengths))
    }
    sizing = _SequenceRecvMeta(seq_dim=1)
    sizing.lengths = tuple(lengths)
    if rt.RECV_META_HOOK:  # patch 5: the stage's hook sizes each receive
        return [sizing(u, "activation", 0, meta).shape[1] for u in range(len(lengths))]
    stage = SimpleNamespace(stage_index=1, args_recv_info=infos, grad_recv_info={})
    runtime = SimpleNamespace(_stages=[stage], _recv_meta_fns={1: {0: sizing}},
                              _inferred_recv_metas={}, n_units=len(lengths))  # fmt: skip
    rt.UnitRuntime._apply_recv_meta_fns(runtime)  # type: ignore[arg-type]
    return [rt.recv_shape(infos[u][0])[1] for u in range(len(lengths))]


def test_each_unit_receives_its_share_of_the_inferred_positions() -> None:
    """Receives are torch's sizing (patch 6's ``_SequenceRecvMeta``): per unit, so samples cut
    differently get their own lengths, and in proportion to what torch inferred from unit 0,
    so a sequence-sharded plain activation (sequence parallelism) gets its shard's length."""
    lengths = [8, 4, 2, 10]  # two samples, cut 8+4 and 2+10
    assert _sized(lengths, 8) == lengths
    assert _sized(lengths, 4) == [4, 2, 1, 5]  # half the positions on each of 2 ranks
    with pytest.raises(ValueError, match="does not scale"):
        _sized(lengths, 3)
