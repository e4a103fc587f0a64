"""Fake execution for the dry run: torch's fake tensors, fake process group and memory
tracker, reached here only (the seam), so a torch release that moves them is checked in one
place.

| torch internal                                   | why                                        |
|--------------------------------------------------|--------------------------------------------|
| _subclasses.fake_tensor.FakeTensorMode           | tensors with shapes and no storage         |
| _subclasses.fake_tensor.unset_fake_temporarily   | real tensors where set-up reads values (a  |
|                                                  |   device mesh's rank layout)               |
| testing._internal.distributed.fake_pg.FakeStore  | the "fake" backend: any rank of any world  |
|                                                  |   in one process, collectives return at    |
|                                                  |   once (importing it registers the backend)|
| utils._python_dispatch.TorchDispatchMode         | the dry run's per-op device-time estimate  |
| _subclasses.fake_tensor.unset_fake_temporarily   | a device mesh built inside the fake mode   |
|                                                  |   (its rank table must hold real values)   |
| distributed._tools.mem_tracker.MemTracker        | peak memory by kind (parameters, gradients,|
|                                                  |   optimizer state, activations, temps)     |
| schedules: PipelineScheduleSingle._stage,       | a schedule's stages (``schedule_stages``)  |
|   PipelineScheduleMulti._stages                  |                                            |
| stage._user_meta, ._mesh_cache                   | static metadata given to a built stage     |
|                                                  |   (``set_static_metadata``; upstream: a    |
|                                                  |   ``PipelineStage.set_metadata`` method)   |
| FSDPModule._get_fsdp_state()._fsdp_param_groups, | FSDP2's gathered parameters, made before  |
|   FSDPParam.all_gather_outputs, ._unsharded_param|   a step (a forward that sized a stage):   |
|                                                  |   MemTracker follows their storage resizes |
|                                                  |   only if it knows them (``gathered_``     |
|                                                  |   ``parameters``)                          |
| MemTracker._pre_fw_hook, .memory_tracking,       | a pipeline runs each stage's module once   |
|   ._mod_tracker (ModTracker.get_known_fqn,       |   per unit: MemTracker refuses a root      |
|   .parents, .is_bw)                              |   module's second forward (its per-module  |
|                                                  |   stats), so that module's stats restart   |
| ModTracker._fw_pre_hook, the module global       | its input hooks removed once they ran      |
|   mod_tracker.register_multi_grad_hook (swapped  |   (``_ReleasingModTracker``: they form an  |
|   for the call), Variable._execution_engine      |   uncollectable cycle that kept autograd   |
|   .queue_callback                                |   nodes, and what they hold, alive); an    |
|                                                  |   "all" hook skips leaf inputs (a split    |
|                                                  |   backward's autograd.grad cannot say if  |
|                                                  |   a leaf's node runs)                      |
| MemTracker._WINFO, ._curr_mem_snap,             | what holds the memory at the peak: each    |
|   ._update_peak_stats, _WeakRefInfo (.reftype,   |   storage's kind, size and the op, module  |
|   .mem_consumed)                                 |   and shape that made it (``holders=True``)|
| DTensor._op_dispatcher.sharding_propagator       | the global-shape fake tensors DTensor's    |
|   ._propagate_tensor_meta_non_cached (an         |   sharding propagation makes under the dry |
|   instance attribute while the tracker is on)    |   run's own fake mode are not counted      |
| torch.utils.swap_tensors (public; wrapped while  | the fake local tensor a DTensor parameter  |
|   a dry run builds and runs its rank:            |   swaps out in ``to_empty`` lives until the|
|   ``swapped_out_kept``)                          |   rank is done (its early free corrupts the|
|                                                  |   heap on 2.15)                            |
| DeviceMesh.__init__, .mesh (public, wrapped   | the rank tables of meshes made inside the  |
|   while a dry run builds and runs its rank:      |   fake mode (FSDP's flattened dp shard x cp|
|   ``real_mesh_tables``)                          |   mesh, its per-parameter concatenations)  |
|                                                  |   are real: their ``nonzero`` has a size   |

Checked on 2.13.0, 2.14.1 and 2.15.0; the dry run itself needs 2.15 (``HAS_WARMUP_P2P``
false): 2.13/2.14's stages vote on a P2P warm-up whose result a fake tensor does not hold.
Upstream hook that would retire this table: a public
``torch.distributed.tools`` (MemTracker, fake process group) and a public fake-tensor mode.
The FLOP counts come from the public :mod:`torch.utils.flop_counter`.

Why not torch's ``RuntimeEstimator``: its roofline asserts ``torch.accelerator.is_available()``
(it reads the device's peak), so it cannot run here, on a machine without a GPU; the dry run
prices each op from its FLOPs and bytes with the planner's GPU profiles instead
(:mod:`seq1f1b.dryrun.estimate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools import mod_tracker as _mod_tracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "FakeTensorMode",
    "Holder",
    "PipelineMemTracker",
    "TorchDispatchMode",
    "fake_world",
    "gathered_parameters",
    "is_fake",
    "is_subclass_dispatch",
    "outside_fake_mode",
    "real_mesh_tables",
    "schedule_stages",
    "set_static_metadata",
    "swapped_out_kept",
]


_DEVICE = torch.ops.prim.device.default


@dataclass(frozen=True)
class Holder:
    """Storages of one kind made by one op in one module (``made_by``: ``"aten.mm in
    layers.3.attention.wq (backward)"``, or ``""`` for those tracked from outside: parameters,
    gradients, optimizer state), of one shape and dtype, all alive at the same moment."""

    kind: str  # MemTracker's: Parameter, Buffer, Gradient, Activation, Temp, Optstate
    made_by: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    nbytes: int


class _ReleasingModTracker(_mod_tracker.ModTracker):
    """torch's ModTracker whose backward hook on each module call's inputs is removed at the
    end of the backward that ran it.

    ModTracker registers that hook (``register_multi_grad_hook``, "all" mode) at every
    forward and never removes it; the hook's closure holds the inputs' autograd nodes, on
    which the hook itself is registered: a reference cycle through C++ that Python's collector
    cannot free. Every such node then outlives its backward with what it holds: a custom
    autograd function's context attributes, such as the chunk-aware attention's cached K/V
    entries and their gradients. A tracked Seq1F1B step held, per sample done, its earlier
    segments' K/V and K/V gradients (``2 (K-1)/K`` of the sample's K/V bytes) that an
    untracked step frees. Upstream hook that would remove this: ModTracker keeping (and
    removing) the handles it registers.

    Nor does that hook wait for a leaf input's gradient: in ``autograd.grad`` (a split
    backward's input half, over a stage's received inputs) the engine cannot say whether a
    leaf's node will run, and torch's hook raised there. Upstream hook: the same filter in
    ``register_multi_grad_hook``, or the engine answering for a leaf that is an input."""

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        register = _mod_tracker.register_multi_grad_hook

        def releasing(tensors: Any, fn: Any, mode: str = "all") -> Any:
            handle: Any = None

            def run(*args: Any) -> None:
                fn(*args)
                torch.autograd.Variable._execution_engine.queue_callback(handle.remove)

            # an "all" hook asks the engine which of its tensors' nodes will run, which it
            # cannot answer for a leaf inside autograd.grad (a split backward's input half,
            # over a stage's received inputs): such a hook waits for the non-leaf tensors
            # only, or, where all are leaves, fires at the first one's gradient
            inner = [t for t in tensors if t.grad_fn is not None]
            if mode == "all" and len(inner) < len(tensors):
                tensors, mode = (inner, "all") if inner else (tensors, "any")
            handle = register(tensors, run, mode=mode)
            return handle

        _mod_tracker.register_multi_grad_hook = releasing  # for this call only (see above)
        try:
            super()._fw_pre_hook(mod, input)
        finally:
            _mod_tracker.register_multi_grad_hook = register


class PipelineMemTracker(MemTracker):
    """torch's MemTracker for a pipeline step, whose stage modules run once per unit: a root
    module's next forward restarts its per-module statistics (the memory totals, by kind, are
    MemTracker's own and unaffected). Upstream hook that would remove this: MemTracker
    accepting repeated root calls (it asks to call ``reset_mod_stats`` between iterations,
    which would drop every module's stats in the middle of the step). Its module tracker
    removes the backward hooks it registers once they ran (:class:`_ReleasingModTracker`).

    Nor does it count the tensors DTensor's sharding propagation makes to derive an op's
    output metadata (``_propagate_tensor_meta_non_cached``: fake tensors of the inputs'
    global shapes and the op's global-shape output): it makes them under the fake mode it
    finds active, which in a dry run is the dry run's own, so MemTracker counted them (at
    tensor parallelism, e.g. ``2*b*V*H`` at the embedding's backward), where a real run makes
    them under a fresh fake mode, holding no memory. Upstream hook that would remove this:
    the propagation always entering a fake mode of its own.
    """

    def __init__(self, holders: bool = False) -> None:
        super().__init__()
        self._mod_tracker = _ReleasingModTracker()
        self._propagating = 0  # inside DTensor's sharding propagation: nothing is counted
        # with ``holders``: each storage's maker, and the storages held on the climb to the
        # peak (taken each time the total passes the last taking by 1%: a few hundred takes)
        self._holders = holders
        self._held_at: int = 0
        self._holders_at: list[Holder] = []

    def holders_at_peak(self) -> tuple[int, list[Holder]]:
        """(bytes held then, what held them, largest first): the storages alive when the
        total last passed its previous taking by 1% on its way to the peak (within 1% of the
        peak). Needs ``holders=True``."""
        if not self._holders:
            raise RuntimeError("PipelineMemTracker(holders=True) records what holds the peak")
        return self._held_at, sorted(self._holders_at, key=lambda h: -h.nbytes)

    def _label(self, func: Any, out: Any) -> None:
        """Name the storages ``func`` made (the first maker of a storage names it)."""
        parents = self._mod_tracker.parents - {"Global"}
        where = max(parents, key=len) if parents else "(no module)"
        phase = "backward" if self._mod_tracker.is_bw else "forward"
        if self._in_opt:
            phase = "optimizer"
        made_by = f"{func.overloadpacket} in {where} ({phase})"
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
                continue
            winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
            if winfo is not None and not hasattr(winfo, "made_by"):
                winfo.made_by = (made_by, tuple(t.shape), str(t.dtype).removeprefix("torch."))

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        if not self._holders:
            return
        total = sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())
        if total <= self._held_at * 1.01:
            return
        groups: dict[tuple, list[int]] = {}
        for winfo, _ in list(self._WINFO.values()):
            if winfo.mem_consumed <= 0:
                continue
            made_by, shape, dtype = getattr(winfo, "made_by", ("", (winfo.size,), ""))
            key = (str(winfo.reftype.value), made_by, shape, dtype)
            group = groups.setdefault(key, [0, 0])
            group[0] += 1
            group[1] += winfo.mem_consumed
        self._held_at = total
        self._holders_at = [Holder(*key, *group) for key, group in groups.items()]

    def __enter__(self) -> PipelineMemTracker:
        if self._depth == 0:
            propagator = DTensor._op_dispatcher.sharding_propagator
            derive = propagator._propagate_tensor_meta_non_cached

            def uncounted(*args: Any, **kwargs: Any) -> Any:
                self._propagating += 1
                try:
                    return derive(*args, **kwargs)
                finally:
                    self._propagating -= 1

            propagator._propagate_tensor_meta_non_cached = uncounted  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:  # the class's method again
            vars(DTensor._op_dispatcher.sharding_propagator).pop(
                "_propagate_tensor_meta_non_cached", None
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE or self._propagating:  # ``t.device``, metadata only: not tracked
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # with ``holders``, name what the op made (the base class tracks the outputs and
        # updates the peak in one call: named here, taken at the next op's update)
        if self._holders and out is not NotImplemented:
            self._label(func, out)
        return out

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        tracker = self._mod_tracker
        name = tracker.get_known_fqn(module)
        if module in self.memory_tracking and not tracker.is_bw:
            if set(tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank ``rank`` of ``world_size`` on the fake backend
    (no traffic: sends, receives and collectives return at once), destroyed on exit."""
    if dist.is_initialized():
        raise RuntimeError(
            "the dry run makes its own (fake) process group, but one is initialized already: "
            "run it in a process without torch.distributed.init_process_group"
        )
    # importing it registers the backend (at the first dry run, not at ``import seq1f1b``)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def swapped_out_kept() -> Iterator[None]:
    """While a dry run builds and runs its rank: the fake local tensor of each DTensor that
    ``nn.Module._apply`` swaps out (``to_empty`` after ``fully_shard``, through
    ``torch.utils.swap_tensors``) is kept until the context exits.

    Freed at once, as torch frees it, that fake tensor (on the meta device, no storage)
    corrupts the heap on torch 2.15 now and then: a segmentation fault, or a garbled device
    or storage error, in FSDP's lazy initialisation or the first forward (torchtitan's
    trainer, a rank of two stages: 4 runs in 6 at debug size). Kept, it costs a Python
    object per parameter. Upstream hook that would remove this: the use after free found and
    fixed in torch (``swap_tensors`` of wrapper subclasses over fake tensors)."""
    swap = torch.utils.swap_tensors
    kept: list[torch.Tensor] = []

    def keeping(t1: torch.Tensor, t2: torch.Tensor) -> None:
        swap(t1, t2)
        if isinstance(t2, DTensor):
            kept.append(t2._local_tensor)

    torch.utils.swap_tensors = keeping
    try:
        yield  # ``kept`` lives until here
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def real_mesh_tables() -> Iterator[None]:
    """While a dry run builds and runs its rank: a :class:`DeviceMesh` is made, and its rank
    table (``mesh``) read, on real tensors, also inside the fake mode.

    ``fully_shard(dp_mesh_dims=...)`` makes meshes itself, inside the trainer's fake build:
    it flattens data-parallel shard x CP into one axis (a new process group from the rank
    table's ``tolist``) and concatenates that with TP for each parameter (the table's
    ``nonzero``). A fake table has neither values nor sizes. Upstream hook that would
    remove this: a mesh whose rank coordinates come from its ``_MeshLayout`` (already
    tensor-free) rather than from tensor ops."""
    init, prop = DeviceMesh.__init__, DeviceMesh.mesh

    def real_init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def mesh(self: DeviceMesh) -> torch.Tensor:
        with unset_fake_temporarily():
            return prop.fget(self)

    DeviceMesh.__init__ = real_init  # type: ignore[method-assign]
    DeviceMesh.mesh = property(mesh, doc=prop.__doc__)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = init, prop  # type: ignore[method-assign]


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """Real tensors for a while inside a :class:`FakeTensorMode`: what must hold values,
    such as ``init_device_mesh``'s rank table (a fake one cannot be read)."""
    return unset_fake_temporarily()


def is_fake(t: object) -> bool:
    """Whether ``t`` is a fake tensor (or a DTensor over one)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return isinstance(local, FakeTensor)


def is_subclass_dispatch(types: tuple[type, ...]) -> bool:
    """Whether a dispatch-mode call sees a DTensor: count its local ops only, as MemTracker
    does (return NotImplemented, and the local ops come back)."""
    return any(isinstance(t, type) and issubclass(t, DTensor) for t in types)


def schedule_stages(schedule: Any) -> list[Any]:
    """This rank's stages of a schedule: torch's single-stage classes hold one, the
    multi-stage ones (ours among them) a list."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def set_static_metadata(stage: Any, inputs: tuple, outputs: tuple) -> None:
    """Give a built ``PipelineStage`` the static metadata its constructor takes as
    ``input_args`` / ``output_args`` (a trainer builds its stages without them): a stage
    made with them lends its own."""
    from torch.distributed.pipelining import PipelineStage

    twin = PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device,
                         input_args=inputs, output_args=outputs, group=stage.group)  # fmt: skip
    stage._user_meta = twin._user_meta
    stage._mesh_cache = twin._mesh_cache


def gathered_parameters(modules: Any) -> list[Any]:
    """The tensors FSDP2 gathers ``modules``' parameters into (empty storage while
    resharded), so that a tracker made after them sees each step's gather (a storage resize
    MemTracker follows for storages it knows): on a GPU these are the unsharded weights."""
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    for root in modules:
        for module in root.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    out += list(getattr(param, "all_gather_outputs", None) or ())
    return out
