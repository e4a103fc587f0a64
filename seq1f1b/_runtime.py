"""The seam between seq1f1b and torch's private internals: every private torch name lives here.

The schedules build compute-only orders in torch's action IR and let torch's
``_PipelineScheduleRuntime`` run them. What torch does not offer as a public hook is reached
through this module only, so a new torch release is checked in one place. Features are
detected (``hasattr``/signatures), never inferred from version numbers.

Internals used (all checked on 2.13.0, 2.14.1 and 2.15.0 unless noted):

| torch internal                                | why                                              |
|-----------------------------------------------|--------------------------------------------------|
| schedules._Action, _ComputationType           | the action IR every order is written in          |
| schedules._PipelineScheduleRuntime            | base class: torch lowers and runs our orders     |
| schedules._PipelineContext                    | argument of register_custom_function hooks       |
| schedules._validate_schedule                  | stage -> rank mapping and torch's order checks   |
| schedules._add_send_recv,                     | torch's reference lowering and deadlock replay,  |
|   _simulate_comms_compute                     |   which ours must equal (tests, benchmarks)      |
| schedules._add_reduce_grad                    | REDUCE_GRAD (+ WAIT_REDUCE_GRAD, 2.15) per rank  |
| schedules._add_unshard_reshard                | reference for our linear-time FSDP pass (tests)  |
| schedules._add_wait_send,                     | 2.15 only: every SEND retired by a WAIT_SEND     |
|   _validate_send_waits                        |   (a linear per-rank pass: torch's own)          |
| schedules._defer_recv_ops                     | defer_pp_recv=True (torch's own per-rank pass)   |
| schedules._format_pipeline_order              | readable orders in tests                         |
| runtime methods _prepare_schedule_with_comms, | fast per-rank lowering, per-unit losses,         |
|   _maybe_compute_loss, _maybe_get_loss,       |   per-unit receive shapes, forward-only eval     |
|   _update_losses, _initialize_stages,         |   orders (overridden in UnitRuntime only)        |
|   _step_microbatches, _load_csv, _compute_loss|                                                  |
| runtime method _warmup_p2p                    | 2.13/2.14: P2P warm-up once per stage chain      |
| runtime attributes _stages, _n_microbatches,  | read through UnitRuntime's properties            |
|   _has_backward, _loss_fn, _num_stages, specs |                                                  |
| stage._PipelineStageBase                      | type of user stages                              |
| stage._RecvInfo .buffer (2.13/2.14) or        | per-unit receive shape (segments differ in       |
|   .tensor_meta (2.15)                         |   length)                                        |
| torch._utils._flatten_dense_tensors           | BitPipe pair gradient buckets                    |
| aten._scaled_dot_product_flash_attention_*    | flash kernels that return the LSE (attention.py) |
| distributed_c10d._get_default_group,          | BitPipe pair check; torchtitan on gloo (CPU)     |
|   _set_pg_timeout                             |                                                  |
| torch._utils._get_available_device_type       | torchtitan picks "cpu" at import (cpu.py)        |
| _composable.replicate_with_fsdp.replicate     | DP-replicate that the pipelining runtime reduces |

Each workaround names the upstream hook that would remove it in ``docs/upstream_hooks.md``.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining import stage as _stage

__all__ = [
    "Action",
    "ComputationType",
    "PipelineContext",
    "PipelineStageBase",
    "UnitRuntime",
    "flatten_dense_tensors",
    "unflatten_dense_tensors",
]

# ---------------------------------------------------------------------------- the action IR
Action = _schedules._Action
ComputationType = _schedules._ComputationType
PipelineContext = _schedules._PipelineContext
ScheduleRuntime = _schedules._PipelineScheduleRuntime
PipelineStageBase = _stage._PipelineStageBase

FORWARD = ComputationType.FORWARD
FULL_BACKWARD = ComputationType.FULL_BACKWARD
BACKWARD_INPUT = ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = ComputationType.BACKWARD_WEIGHT
UNSHARD = ComputationType.UNSHARD
RESHARD = ComputationType.RESHARD
SEND_F = ComputationType.SEND_F
RECV_F = ComputationType.RECV_F
SEND_B = ComputationType.SEND_B
RECV_B = ComputationType.RECV_B
REDUCE_GRAD = ComputationType.REDUCE_GRAD
OVERLAP_F_B = ComputationType.OVERLAP_F_B
# 2.15 additions (None before)
WAIT_SEND_F: ComputationType | None = getattr(ComputationType, "WAIT_SEND_F", None)
WAIT_SEND_B: ComputationType | None = getattr(ComputationType, "WAIT_SEND_B", None)
WAIT_REDUCE_GRAD: ComputationType | None = getattr(ComputationType, "WAIT_REDUCE_GRAD", None)

# torch's passes and checks, for our lowering, tests and benchmarks
validate_schedule = _schedules._validate_schedule
add_send_recv = _schedules._add_send_recv
simulate_comms_compute = _schedules._simulate_comms_compute
add_reduce_grad = _schedules._add_reduce_grad
torch_add_unshard_reshard = _schedules._add_unshard_reshard
format_pipeline_order = _schedules._format_pipeline_order

flatten_dense_tensors = torch._utils._flatten_dense_tensors
unflatten_dense_tensors = torch._utils._unflatten_dense_tensors


# ---------------------------------------------------------------------------- other internals
def default_process_group() -> Any:
    return torch.distributed.distributed_c10d._get_default_group()


def set_pg_timeout(timeout: Any, group: Any) -> None:
    torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


@contextlib.contextmanager
def device_type_reported_as(device_type: str) -> Iterator[None]:
    """Make ``torch._utils._get_available_device_type()`` answer ``device_type`` for a while."""
    original = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: device_type
    try:
        yield
    finally:
        torch._utils._get_available_device_type = original


def fsdp_replicate() -> Callable[..., Any]:
    """FSDP2's ``replicate`` (DP-replicate whose gradients the pipelining runtime reduces)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def flash_cpu_forward(q, k, v, causal: bool, scale: float, bias=None):  # type: ignore[no-untyped-def]
    """CPU flash attention returning (out, logsumexp); ``bias``: additive mask, q's dtype.

    A row the bias masks completely comes back as out 0, logsumexp 0 (not -inf): callers
    that merge blocks must fix such rows themselves.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    return out, lse


def flash_cpu_backward(g, q, k, v, out, lse, causal: bool, scale: float, bias=None):  # type: ignore[no-untyped-def]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g.contiguous(), q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def flash_cuda_forward(q, k, v, causal: bool, scale: float):  # type: ignore[no-untyped-def]  # pragma: no cover
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return res


def flash_cuda_backward(*args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]  # pragma: no cover
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(*args, **kwargs)


# ---------------------------------------------------------------------------- detected features
_UNSHARD_PARAMS = inspect.signature(_schedules._add_unshard_reshard).parameters
#: 2.15 keeps active FSDP stages in insertion order (a dict) and takes ``unshard_lookahead``;
#: before, a set (whose iteration order decides the order of RESHARDs).
UNSHARD_KEEPS_INSERTION_ORDER = "unshard_lookahead" in _UNSHARD_PARAMS
#: 2.15: every SEND is retired by a matching WAIT_SEND action.
HAS_SEND_WAITS = hasattr(_schedules, "_add_wait_send")
#: 2.15: receive buffers are allocated per receive from ``tensor_meta``; before, they were
#: allocated once per unit at stage initialization and kept.
RECV_BUFFER_PER_RECEIVE = hasattr(_stage._RecvInfo, "allocate_buffer")
#: 2.13/2.14 warm up P2P through ``_warmup_p2p`` (BitPipe runs it once per replica chain).
HAS_WARMUP_P2P = hasattr(ScheduleRuntime, "_warmup_p2p")
#: 2.14.1+: ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``; 2.15: ``finalize_gradients``.
_STEP_PARAMS = inspect.signature(_schedules.PipelineScheduleMulti.step).parameters
STEP_TAKES_FINALIZE = "finalize_gradients" in _STEP_PARAMS
#: runtime options of 2.15's ``_PipelineScheduleRuntime`` (none of them exist before).
_NEWER_OPTIONS = (
    "max_active_stages",
    "unshard_lookahead",
    "defer_reduce_grad_wait",
    "max_outstanding_sends",
)
RUNTIME_OPTIONS: tuple[str, ...] = (
    _NEWER_OPTIONS if hasattr(_schedules, "_resolve_unshard_lookahead") else ()
)


def add_wait_send(rank_actions: list[Action]) -> list[Action]:
    """torch's ``_add_wait_send`` for one rank (a per-rank pass); identity before 2.15."""
    if not HAS_SEND_WAITS:
        return rank_actions
    return _schedules._add_wait_send({0: rank_actions})[0]


def validate_send_waits(lowered: Mapping[int, list[Action]]) -> None:
    if HAS_SEND_WAITS:
        _schedules._validate_send_waits(dict(lowered))


def defer_recv_ops(
    rank: int, rank_actions: list[Action], stage_to_rank: Callable[[int], int]
) -> list[Action]:
    """torch's ``_defer_recv_ops`` for one rank (it treats each rank's list on its own)."""
    return _schedules._defer_recv_ops({rank: rank_actions}, stage_to_rank)[rank]


class StandInStage(PipelineStageBase):
    """A stage with only what a schedule's constructor reads: no module, no process group.

    Builds and checks orders anywhere (tests, benchmarks, the planner), as torch's own schedule
    tests do with their mock stages.
    """

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None
        self.submod = None
        self.has_backward = True

    def _create_grad_recv_info(self, *args: Any, **kwargs: Any) -> tuple:  # pragma: no cover
        return ()

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
        return None

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
        return None


def stand_in_stages(pp: int, stages_per_rank: int, rank: int = 0) -> list[StandInStage]:
    """Rank ``rank``'s stages in looped placement (stage ``s`` on rank ``s % pp``)."""
    n = pp * stages_per_rank
    return [StandInStage(s, n, pp, rank) for s in range(rank, n, pp)]


# ---------------------------------------------------------------------------- receive shapes
def recv_infos(stage: PipelineStageBase, backward: bool) -> Mapping[int, Sequence[Any]]:
    """Per unit, the stage's receive descriptors (activations, or gradients if ``backward``)."""
    return stage.grad_recv_info if backward else stage.args_recv_info


def recv_shape(info: Any) -> torch.Size | None:
    """The shape a descriptor will receive into (None for root inputs / no tensor)."""
    if getattr(info, "is_root_arg", False):
        return None
    if RECV_BUFFER_PER_RECEIVE:
        meta = getattr(info, "tensor_meta", None)
        return None if meta is None else torch.Size(meta.shape)
    buf = getattr(info, "buffer", None)
    return buf.shape if isinstance(buf, torch.Tensor) else None


def set_recv_length(info: Any, dim: int, length: int) -> None:
    """Make a descriptor receive ``length`` positions at ``dim`` (other dims unchanged)."""
    if RECV_BUFFER_PER_RECEIVE:
        meta = info.tensor_meta
        shape = list(meta.shape)
        if shape[dim] == length and tuple(meta.stride) == _contiguous(shape):
            return
        shape[dim] = length  # and a contiguous buffer: p2p backends send contiguous tensors
        changes: dict[str, Any] = {"shape": torch.Size(shape), "stride": _contiguous(shape)}
        global_shape = getattr(meta, "global_shape", None)
        if global_shape is not None and len(global_shape) == len(shape):
            scale = shape[dim] / meta.shape[dim]
            gshape = list(global_shape)
            gshape[dim] = round(gshape[dim] * scale)
            changes["global_shape"] = torch.Size(gshape)
            changes["global_stride"] = _contiguous(gshape)
        # descriptors of different units may share one meta object: give this one its own
        info.tensor_meta = dataclasses.replace(meta, **changes)
        return
    buf = info.buffer
    if buf.shape[dim] == length:
        return
    shape = list(buf.shape)
    shape[dim] = length
    new = torch.empty(shape, dtype=buf.dtype, device=buf.device)
    info.buffer = new.requires_grad_(buf.requires_grad)


def received_tensors(stage: PipelineStageBase, unit: int) -> list[torch.Tensor]:
    """Activations received for ``unit`` and not yet consumed (for the length check)."""
    out: list[torch.Tensor] = []
    for info in stage.args_recv_info.get(unit, ()):
        buf = getattr(info, "buffer", None)
        if not getattr(info, "is_root_arg", False) and isinstance(buf, torch.Tensor):
            out.append(buf)
    return out


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


# ---------------------------------------------------------------------------- stage hooks
@contextlib.contextmanager
def stage_methods_replaced(
    replacements: Mapping[PipelineStageBase, Mapping[str, Callable[..., Any]]],
) -> Iterator[None]:
    """Replace per-chunk stage methods (instance attributes) for the length of one step; the
    replacements call what was there before (:meth:`ScheduleSeq1F1B._stage_wrappers` binds it).

    Upstream hook that would remove this: a backward counterpart of 2.15's
    ``PipelineStage.register_forward_context`` (see docs/upstream_hooks.md).
    """
    patched: list[tuple[Any, str, Any]] = []
    try:
        for stage, methods in replacements.items():
            for name, fn in methods.items():
                # an instance override of the user's is put back afterwards, not deleted
                patched.append((stage, name, vars(stage).get(name, _ABSENT)))
                setattr(stage, name, fn)
        yield
    finally:
        for stage, name, before in reversed(patched):
            if before is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(stage, name)
            else:
                setattr(stage, name, before)


_ABSENT = object()


# ---------------------------------------------------------------------------- runtime base
class UnitRuntime(ScheduleRuntime):
    """torch's ``_PipelineScheduleRuntime`` with the hooks our schedules need, version-proof.

    Subclasses build ``pipeline_order`` (compute only) and call :meth:`_install_order`; they
    override the public-named hooks below instead of torch's private methods:

    * :meth:`stage_topology` -- which stage feeds which (default: torch's chain ``s -> s+1``);
    * :meth:`unit_loss` -- the loss of one microbatch (default: torch's ``loss_fn``);
    * :meth:`collect_losses` -- what ``losses`` receives at the end of ``step()``;
    * :meth:`after_stage_init` -- after torch initialized the stages' receive descriptors;
    * :meth:`unit_scope` -- a context around the whole run of one step's actions.

    Per microbatch losses are kept by index, so a stage may compute them in any order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in _NEWER_OPTIONS if k in kwargs and k not in RUNTIME_OPTIONS]
        if unknown:
            raise ValueError(
                f"{unknown} need torch >= 2.15 (this is torch {torch.__version__}): upgrade "
                "torch or drop these options"
            )
        super().__init__(*args, **kwargs)
        self._unit_losses: dict[int, torch.Tensor] = {}
        self._forward_only_lowered: dict[int, list[Action]] | None = None

    # ------------------------------------------------------------------ read-only views
    @property
    def local_stages(self) -> list[PipelineStageBase]:
        return list(self._stages)

    @property
    def n_units(self) -> int:
        """Microbatches as torch's runtime counts them (Seq1F1B: samples x segments)."""
        return int(self._n_microbatches)

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def has_backward(self) -> bool:
        return bool(self._has_backward)

    @property
    def loss_fn(self) -> Callable[..., torch.Tensor] | None:
        return self._loss_fn

    @property
    def chunk_specs(self) -> tuple[Any, Any, Any]:
        """(args_chunk_spec, kwargs_chunk_spec, output_merge_spec) as given to torch."""
        return self._args_chunk_spec, self._kwargs_chunk_spec, self._output_merge_spec

    @property
    def backward_requires_autograd(self) -> bool:
        return bool(self._backward_requires_autograd)

    def set_finalize_gradients(self, finalize: bool) -> None:
        """2.15's ``step(finalize_gradients=...)``; only True exists before."""
        if STEP_TAKES_FINALIZE:
            self._finalize_gradients = finalize
        elif not finalize:
            raise ValueError(
                f"finalize_gradients=False needs torch >= 2.15 (this is {torch.__version__})"
            )

    def run_microbatches(
        self,
        arg_mbs: list,
        kwarg_mbs: list,
        target_mbs: list | None,
        losses: list | None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Run one step on inputs already split into this runtime's microbatches."""
        self._step_microbatches(
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
        )

    def lowering_options(self) -> dict[str, Any]:
        """The runtime options that shape the lowering, with torch's defaults."""
        return {
            "defer_recv": bool(getattr(self, "_defer_pp_recv", False)),
            "max_active_stages": int(getattr(self, "_max_active_stages", 3)),
            "unshard_lookahead": getattr(self, "_unshard_lookahead", "full"),
            "defer_reduce_grad_wait": bool(getattr(self, "_defer_reduce_grad_wait", False)),
            "max_outstanding_sends": getattr(self, "_max_outstanding_sends", None),
        }

    # ------------------------------------------------------------------ hooks for subclasses
    def stage_topology(self, stage_to_rank: Mapping[int, int]) -> Any:
        """The stage graph the lowering follows (``seq1f1b.lowering.StageTopology``)."""
        from .lowering import StageTopology

        return StageTopology.chain([stage_to_rank[s] for s in range(self.num_stages)])

    def microbatches_per_stage(self) -> int:
        """How many microbatches each stage runs (REDUCE_GRAD follows its last backward)."""
        return self.n_units

    def stage_mapping(self, actions: Mapping[int, Sequence[Action | None]]) -> dict[int, int]:
        """Validate ``actions`` and return stage -> rank (torch's ``_validate_schedule``)."""
        return validate_schedule(dict(actions), self.pp_group_size, self.num_stages, self.n_units)

    def unit_loss(
        self, stage: PipelineStageBase, output: Any, target: Any, mb_index: int, loss_kwargs: Any
    ) -> torch.Tensor:
        return self._compute_loss(output, target, loss_kwargs)

    def collect_losses(self, unit_losses: dict[int, torch.Tensor], losses: list) -> None:
        losses.extend(unit_losses[i] for i in sorted(unit_losses))

    def after_stage_init(self) -> None:
        """Called after torch initialized the stages (receive descriptors exist)."""

    def unit_scope(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def finish_step(self) -> None:
        """Called after the last action of a step, before the losses are collected."""

    def stage_chain(self, stage: PipelineStageBase) -> int:
        """Which independent pipeline chain a stage belongs to (BitPipe: its replica)."""
        del stage
        return 0

    # ------------------------------------------------------------------ lowering
    def _install_order(self, actions: dict[int, list[Action | None]]) -> None:
        """Set ``pipeline_order`` and lower it (this rank now, the others on access)."""
        self.pipeline_order = actions
        self._forward_only_lowered = None
        self._prepare_schedule_with_comms(actions)

    def _prepare_schedule_with_comms(
        self, actions: dict[int, list[Action | None]], format: str = "compute_only"
    ) -> None:
        from .lowering import LoweredOrders, SendRecvLowering, fast_path_supported

        options = self.lowering_options()
        mapping = self.stage_mapping(actions) if format == "compute_only" else None
        topology = None if mapping is None else self.stage_topology(mapping)
        if mapping is None or topology is None or not fast_path_supported(actions, options):
            if topology is not None and not topology.is_chain:
                raise ValueError(
                    f"{type(self).__name__} lowers compute-only orders itself (its stages do "
                    "not form torch's s -> s+1 chain); torch's lowering would send across "
                    f"pipelines. Options {options} and format={format!r} are not supported."
                )
            super()._prepare_schedule_with_comms(actions, format=format)  # type: ignore[arg-type]
            return
        self.stage_index_to_group_rank = mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = mapping
        lowering = SendRecvLowering(actions, topology, self.microbatches_per_stage(), options)
        self.pipeline_order_with_comms = LoweredOrders(lowering)  # type: ignore[assignment]
        self.pipeline_order_with_comms[self.rank]  # this rank's list, at construction

    def _forward_only_order(self) -> dict[int, list[Action]]:
        """eval(): the forwards alone, lowered (torch would still walk the backward actions
        and hand gradients between same-rank stages that computed none)."""
        if self._forward_only_lowered is None:
            from .lowering import LoweredOrders, SendRecvLowering

            fwd = {
                r: [a for a in acts if a is not None and a.computation_type == FORWARD]
                for r, acts in self.pipeline_order.items()
            }
            mapping = dict(self.stage_index_to_group_rank)
            options = self.lowering_options()
            options["defer_reduce_grad_wait"] = False
            lowering = SendRecvLowering(
                fwd, self.stage_topology(mapping), self.microbatches_per_stage(), options
            )
            self._forward_only_lowered = LoweredOrders(lowering)  # type: ignore[assignment]
        return self._forward_only_lowered  # type: ignore[return-value]

    # ------------------------------------------------------------------ torch's runtime hooks
    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):  # type: ignore[override]
        with self.stage_init_scope():
            super()._initialize_stages(args, kwargs, target, loss_kwargs)
        self.after_stage_init()

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        """Context for torch's stage initialisation (its forward metadata inference runs the
        model once, outside any unit)."""
        return contextlib.nullcontext()

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):  # type: ignore[override]
        if stage.is_last and self._loss_fn is not None:
            self._unit_losses[mb_index] = self.unit_loss(
                stage, output, target_mbs[mb_index], mb_index, loss_kwargs
            )

    def _maybe_get_loss(self, stage, mb_index):  # type: ignore[override]
        if stage.is_last and self._loss_fn is not None:
            if mb_index not in self._unit_losses:
                raise RuntimeError(f"no loss for microbatch {mb_index} yet")
            return self._unit_losses[mb_index]
        return None

    def _update_losses(self, stages, losses):  # type: ignore[override]
        try:
            self.finish_step()
            if any(s.is_last for s in self._stages) and self._loss_fn is not None:
                collected: list = []
                self.collect_losses(dict(self._unit_losses), collected)
                if losses is not None:
                    losses.clear()
                    losses.extend(collected)
        finally:
            self._unit_losses.clear()
            self._internal_losses.clear()

    def _warmup_p2p(self, stages, has_backward, p2p_done):  # type: ignore[override]
        """2.13/2.14: torch's P2P warm-up vote, once per independent chain of stages."""
        for chain in sorted({self.stage_chain(s) for s in stages}):
            mine = [s for s in stages if self.stage_chain(s) == chain]
            super()._warmup_p2p(mine, has_backward, p2p_done)  # type: ignore[misc]

    def _step_microbatches(  # type: ignore[override]
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._unit_losses.clear()
        lowered = self.pipeline_order_with_comms
        if not self._has_backward:
            self.pipeline_order_with_comms = self._forward_only_order()
        try:
            with self.unit_scope():
                super()._step_microbatches(
                    arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
                )
        finally:
            self.pipeline_order_with_comms = lowered

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:  # type: ignore[override]
        """torch's CSV format; a compute-only order is checked, then lowered like a built one."""
        if format != "compute_only":
            super()._load_csv(filename, format=format)  # type: ignore[arg-type]
            return
        with open(filename, newline="") as f:
            rows = list(csv.reader(f))
        actions = {r: [Action.from_str(s) for s in row] for r, row in enumerate(rows)}
        self.check_loaded_order(actions)
        self._install_order(actions)  # type: ignore[arg-type]

    def check_loaded_order(self, actions: Mapping[int, Sequence[Action | None]]) -> None:
        """Hook: refuse a loaded order that breaks the schedule's rules."""

    # ------------------------------------------------------------------ public CSV / lowering
    def dump_csv(self, filename: str, format: str = "compute_only") -> None:
        """torch's CSV dump (one row per rank): ``compute_only`` or ``compute_comms``."""
        ScheduleRuntime._dump_csv(self, filename, format=format)  # type: ignore[arg-type]

    def load_csv(self, filename: str, format: str = "compute_only") -> None:
        """torch's CSV load; a compute-only order is lowered like a built one."""
        self._load_csv(filename, format=format)

    def lower(self, actions: dict[int, list[Action | None]], format: str = "compute_only") -> None:
        """Lower ``actions`` into ``pipeline_order_with_comms`` (torch's entry point)."""
        self._prepare_schedule_with_comms(actions, format=format)


def load_csv(runtime: ScheduleRuntime, filename: str, format: str = "compute_only") -> None:
    """torch's CSV load on any runtime (e.g. a plain ``_PipelineScheduleRuntime``)."""
    runtime._load_csv(filename, format=format)  # type: ignore[arg-type]


def torch_lowering(
    stages: Sequence[PipelineStageBase],
    actions: Mapping[int, Sequence[Action | None]],
    n_microbatches: int,
    **options: Any,
) -> dict[int, list[Action]]:
    """torch's own ``_prepare_schedule_with_comms`` of ``actions`` (every rank), as a reference."""
    runtime = ScheduleRuntime(list(stages), n_microbatches, **options)
    ScheduleRuntime._prepare_schedule_with_comms(runtime, {r: list(a) for r, a in actions.items()})
    return dict(runtime.pipeline_order_with_comms)
