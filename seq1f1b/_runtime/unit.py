"""The seam's runtime layer: ``UnitRuntime``, torch's ``_PipelineScheduleRuntime`` with the
hook-shaped extension points our schedules override, and the per-step stage method wrapping.

Sits above :mod:`.ir` and the lowering it drives (:mod:`seq1f1b._runtime.lowering`).
"""

from __future__ import annotations

import contextlib
import csv
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle

from .ir import (
    _NEWER_OPTIONS,
    ACTION_CONTEXT_HOOK,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_ONLY_EVAL,
    FULL_BACKWARD,
    LOSSES_BY_INDEX,
    MICROBATCH_INPUTS_HOOK,
    PIPELINING_RUNTIME,
    RECV_BUFFER_PER_RECEIVE,
    RECV_META_HOOK,
    RUNTIME_OPTIONS,
    SPLIT_TARGET_HOOK,
    STEP_TAKES_FINALIZE,
    TARGET_CHUNK_SPEC,
    Action,
    PipelineStageBase,
    ScheduleRuntime,
    contiguous_receives,
    recv_infos,
    recv_shape,
    set_recv_meta,
    split_tensor,
    tensor_meta_of,
    validate_schedule,
    wider_grads_hidden_while_tracing,
)
from .lowering import LoweredOrders, SendRecvLowering, StageTopology, fast_path_supported

# ---------------------------------------------------------------------------- action contexts
#: makes the context one action runs in: ``factory(stage, action)`` for F, B, I and W
ActionContextFactory = Callable[[PipelineStageBase, Action], contextlib.AbstractContextManager]

_CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _backward_kind(args: tuple, kwargs: dict) -> Any:
    """FULL_BACKWARD or BACKWARD_INPUT, from ``backward_one_chunk``'s ``full_backward``."""
    full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
    return FULL_BACKWARD if full else BACKWARD_INPUT


@contextlib.contextmanager
def _entered(
    factories: Sequence[ActionContextFactory], stage: PipelineStageBase, action: Action
) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for factory in factories:  # the first registered is the outermost
            stack.enter_context(factory(stage, action))
        yield


def _wrapped(
    stage: PipelineStageBase, name: str, factories: Sequence[ActionContextFactory]
) -> Callable[..., Any]:
    """``stage.<name>`` run inside the factories' contexts. The action kind is settled here,
    once per method and step, not per call (except FULL vs INPUT, an argument of the call);
    one factory (the usual case) is entered directly, without an ExitStack."""
    run = getattr(stage, name)  # whatever is there: the class's method or an instance override
    index = stage.stage_index
    fixed = {"forward_one_chunk": FORWARD, "backward_weight_one_chunk": BACKWARD_WEIGHT}.get(name)
    single = factories[0] if len(factories) == 1 else None

    def per_action(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        kind = fixed if fixed is not None else _backward_kind(args, kwargs)
        action = Action(index, kind, chunk_id)
        scope = single(stage, action) if single is not None else _entered(factories, stage, action)
        with scope:
            return run(chunk_id, *args, **kwargs)

    return per_action


@contextlib.contextmanager
def action_contexts_installed(
    stages: Sequence[PipelineStageBase], factories: Sequence[ActionContextFactory]
) -> Iterator[None]:
    """Run every F / B / I / W of ``stages`` inside the contexts ``factories`` make, for the
    length of one step; each stage is left exactly as it was found (an instance override of
    the user's is wrapped, then put back, never deleted).

    Upstream hook that would remove this: ``register_action_context(factory) -> handle`` on
    the schedule (docs/upstream_hooks.md); 2.15's ``PipelineStage.register_forward_context``
    covers forwards only, one per stage, without the action.
    """
    if not factories:
        yield
        return
    saved: list[tuple[PipelineStageBase, str, Any]] = []
    try:
        for stage in stages:
            for name in _CHUNK_METHODS:
                saved.append((stage, name, vars(stage).get(name, _ABSENT)))
                setattr(stage, name, _wrapped(stage, name, factories))
        yield
    finally:
        for stage, name, before in reversed(saved):
            if before is _ABSENT:
                with contextlib.suppress(AttributeError):
                    delattr(stage, name)
            else:
                setattr(stage, name, before)


_ABSENT = object()

#: 2.15's runtime options at torch's defaults: an older torch runs as if they were given
_NEWER_DEFAULTS: dict[str, Any] = {
    "max_active_stages": 3,
    "unshard_lookahead": "full",
    "defer_reduce_grad_wait": False,
    "max_outstanding_sends": None,
}
assert set(_NEWER_DEFAULTS) == set(_NEWER_OPTIONS)

#: (stage index, backward, unit, arg index) of one receive
_ReceiveKey = tuple[int, bool, int, int]


# ---------------------------------------------------------------------------- receive metadata
def _register_recv_meta_fn(
    fns: OrderedDict[int, Callable[..., Any]], fn: Callable[..., Any]
) -> RemovableHandle:
    """Patch 5's ``stage.register_recv_meta_fn(fn)``, kept by the runtime that owns it."""
    handle = RemovableHandle(fns)
    fns[handle.id] = fn
    return handle


def _meta_of(info: Any) -> Any:
    """A receive's inferred metadata (2.15), or its buffer's, as one (2.13/2.14)."""
    if RECV_BUFFER_PER_RECEIVE:
        return info.tensor_meta
    return tensor_meta_of(info.buffer)


# ---------------------------------------------------------------------------- runtime base
class UnitRuntime(ScheduleRuntime):
    """torch's ``_PipelineScheduleRuntime`` with the hooks our schedules need, version-proof.

    Subclasses build ``pipeline_order`` (compute only) and call :meth:`_install_order`; they
    override the public-named hooks below instead of torch's private methods:

    * :meth:`stage_topology` -- which stage feeds which (default: torch's chain ``s -> s+1``);
    * :meth:`unit_loss` -- the loss of one microbatch (default: torch's ``loss_fn``);
    * :meth:`collect_losses` -- what ``losses`` receives at the end of ``step()``;
    * :meth:`after_stage_init` -- after torch initialized the stages' receive descriptors;
    * :meth:`unit_scope` -- a context around the whole run of one step's actions;
    * :meth:`register_action_context` -- a context around each F / B / I / W (composable).

    Per microbatch losses are kept by index, so a stage may compute them in any order.

    Where a hook of the upstream series is absent, it also gives what patch 6's
    ``ScheduleSeq1F1B`` (schedules/upstream.py, verbatim) takes from a patched runtime: 2.15's
    options at their defaults on older torch, ``_internal_losses`` as the dict, the
    ``loss_kwarg_mbs`` keyword, ``stage.register_recv_meta_fn`` on its stages, and
    ``_split_target`` with the split that calls it (2.13: a ``step()``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not PIPELINING_RUNTIME:
            raise RuntimeError(
                f"seq1f1b's schedules need torch >= 2.13 (this is torch {torch.__version__}, "
                "whose pipelining runtime lacks receive metadata and loss kwargs): upgrade "
                "torch; the model side (chunk-aware attention, masks, kernels) runs on it"
            )
        for name in [k for k in _NEWER_OPTIONS if k in kwargs and k not in RUNTIME_OPTIONS]:
            if kwargs[name] == _NEWER_DEFAULTS[name]:
                del kwargs[name]  # torch's default: what an older torch does anyway
        unknown = [k for k in _NEWER_OPTIONS if k in kwargs and k not in RUNTIME_OPTIONS]
        if unknown:
            raise ValueError(
                f"{unknown} need torch >= 2.15 (this is torch {torch.__version__}): upgrade "
                "torch or drop these options"
            )
        super().__init__(*args, **kwargs)
        # losses by microbatch index, one dict under torch's name: patch 1's torch keeps it
        # itself; before, torch's list is replaced (its users are overridden below)
        if LOSSES_BY_INDEX:
            self._unit_losses: dict[int, torch.Tensor] = self._internal_losses  # type: ignore[assignment]
        else:
            self._unit_losses = {}
            self._internal_losses = self._unit_losses  # type: ignore[assignment]
        self._loss_kwarg_mbs: list[dict[str, Any]] | None = None
        # patch 5 emulated: each stage's receive metadata functions, applied once torch
        # initialized the stages (the functions see each receive's first inferred metadata)
        self._recv_meta_fns: dict[int, OrderedDict[int, Callable[..., Any]]] = {}
        self._inferred_recv_metas: dict[_ReceiveKey, Any] = {}
        if not RECV_META_HOOK:
            for stage in self._stages:
                fns = self._recv_meta_fns.setdefault(stage.stage_index, OrderedDict())
                # the method torch lacks, on the stages this runtime owns
                stage.register_recv_meta_fn = functools.partial(_register_recv_meta_fn, fns)  # type: ignore[attr-defined]
        if not ACTION_CONTEXT_HOOK:  # patch 4's torch keeps its own (of this name)
            # an OrderedDict, as torch's module hooks use (RemovableHandle: a weak reference)
            self._action_contexts: OrderedDict[int, ActionContextFactory] = OrderedDict()
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

    def begin_step(self, finalize_gradients: bool = True) -> None:
        """What torch's ``step()`` does before it splits inputs: refuse training under
        ``no_grad``, take ``finalize_gradients``, and reset every stage for the step."""
        if self.has_backward and self.backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; "
                "it should not be used under torch.no_grad() context. Please call eval() instead."
            )
        self.set_finalize_gradients(finalize_gradients)
        for stage in self._stages:
            stage.has_backward = self.has_backward
            stage.clear_runtime_states()

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
            # ours (``SendRecvLowering``): torch's placement unless a schedule asks otherwise
            "backward_send_waits": getattr(self, "backward_send_waits", "end"),
        }

    # ------------------------------------------------------------------ hooks for subclasses
    def stage_topology(self, stage_to_rank: Mapping[int, int]) -> Any:
        """The stage graph the lowering follows (``seq1f1b._runtime.lowering.StageTopology``)."""

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

    def register_action_context(self, factory: ActionContextFactory) -> RemovableHandle:
        """Run every compute action (F, B, I, W) inside ``factory(stage, action)``.

        Factories compose: the first registered is the outermost. Returns a handle whose
        ``remove()`` unregisters the factory (as torch's module hooks do).
        """
        if ACTION_CONTEXT_HOOK:  # patch 4: torch enters it around each action itself
            return super().register_action_context(factory)  # type: ignore[misc]
        handle = RemovableHandle(self._action_contexts)
        self._action_contexts[handle.id] = factory
        return handle

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
        mods = [s.submod for s in self._stages]
        with self.stage_init_scope(), small_buffers_kept(mods):
            super()._initialize_stages(args, kwargs, target, loss_kwargs)
        contiguous_receives(self._stages)
        self.after_stage_init()
        self._apply_recv_meta_fns()

    def _apply_recv_meta_fns(self) -> None:
        """Patch 5 emulated: each receive's metadata (from the first inference) through its
        stage's registered functions, ``fn(mb_index, kind, arg_index, meta) -> meta``."""
        for stage in self._stages:
            fns = list(self._recv_meta_fns.get(stage.stage_index, {}).values())
            if not fns:
                continue
            for backward in (False, True):
                kind = "gradient" if backward else "activation"
                for unit, infos in recv_infos(stage, backward).items():
                    if unit >= self.n_units:  # left by a schedule of more units on this stage
                        continue
                    for i, info in enumerate(infos):
                        if recv_shape(info) is None:
                            continue
                        key = (stage.stage_index, backward, unit, i)
                        meta = self._inferred_recv_metas.setdefault(key, _meta_of(info))
                        for fn in fns:
                            meta = fn(unit, kind, i, meta)
                        set_recv_meta(info, meta)

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        """Context for torch's stage initialisation (its forward metadata inference runs the
        model once, outside any unit)."""
        return contextlib.nullcontext()

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):  # type: ignore[override]
        if self._loss_kwarg_mbs is not None:  # patch 1's per-microbatch loss kwargs, emulated
            loss_kwargs = self._loss_kwarg_mbs[mb_index]
        if stage.is_last and self._loss_fn is not None:
            self._unit_losses[mb_index] = self.unit_loss(
                stage, output, target_mbs[mb_index], mb_index, loss_kwargs
            )
        if stage.is_last and stage.output_chunks and stage.output_chunks[-1] is output:
            # what ``step()`` returns is values: kept with its graph, a split backward's input
            # half (retain_graph) and weight half leave every saved tensor off the weight
            # path alive until the step ends (found under TP: a step's activations on the
            # last rank). The unit's backward has its own reference (the stage's fwd_cache).
            stage.output_chunks[-1] = _detached(output)

    def _maybe_get_loss(self, stage, mb_index):  # type: ignore[override]
        """The unit's loss for its backward, which is about to run; what the step keeps of
        it for ``losses`` is detached. Kept with its graph (torch's runtime does), each
        unit's autograd nodes would outlive their backward until the step ends, and with
        them every leaf they reach: the last stage's received inputs and their gradients,
        the K/V cache entries and theirs, one unit's worth more each unit. Before patch 1
        torch indexed a list kept in completion order: this is also the lookup by index."""
        if not (stage.is_last and self._loss_fn is not None):
            return None
        if mb_index not in self._unit_losses:
            raise RuntimeError(f"no loss for microbatch {mb_index} yet")
        loss = self._unit_losses[mb_index]
        self._unit_losses[mb_index] = loss.detach()
        return loss

    if FORWARD_ONLY_EVAL:  # patch 3: the runtime asks for the forward-only order itself

        def _get_forward_only_order_with_comms(self) -> Any:  # type: ignore[override]
            return self._forward_only_order()

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
        **newer: Any,  # patch 1's step() passes loss_kwarg_mbs
    ) -> None:
        self._unit_losses.clear()
        if not LOSSES_BY_INDEX:  # patch 1's loss_kwarg_mbs, emulated (None: torch's own path)
            self._loss_kwarg_mbs = _checked_loss_kwarg_mbs(
                newer.pop("loss_kwarg_mbs", None), loss_kwargs, self.n_units
            )
        lowered = self.pipeline_order_with_comms
        if not self._has_backward and not FORWARD_ONLY_EVAL:
            self.pipeline_order_with_comms = self._forward_only_order()
        try:
            factories = [] if ACTION_CONTEXT_HOOK else list(self._action_contexts.values())
            modules = [s.submod for s in self._stages if isinstance(s.submod, torch.nn.Module)]
            with (
                self.unit_scope(),
                action_contexts_installed(self._stages, factories),
                wider_grads_hidden_while_tracing(modules),
            ):
                super()._step_microbatches(
                    arg_mbs,
                    kwarg_mbs,
                    target_mbs,
                    losses,
                    return_outputs,
                    loss_kwargs=loss_kwargs,
                    **newer,
                )
        finally:
            self.pipeline_order_with_comms = lowered
            self._loss_kwarg_mbs = None

    if not SPLIT_TARGET_HOOK:  # patch 6's _PipelineSchedule hunk: the target split, a method

        def _split_target(self, target: Any) -> list[Any]:
            """Splits a full-batch target into one target per microbatch (along dim 0)."""
            return list(split_tensor(target, TARGET_CHUNK_SPEC, self._n_microbatches))

        def _get_microbatch_inputs(  # type: ignore[override]
            self,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            target: Any,
            arg_mbs: Any = None,
            kwarg_mbs: Any = None,
            target_mbs: Any = None,
        ) -> tuple[list | None, list | None, list | None]:
            """torch's (2.14.1+), the whole-batch target split by :meth:`_split_target`."""
            if any(mbs is not None for mbs in (arg_mbs, kwarg_mbs, target_mbs)):
                if not MICROBATCH_INPUTS_HOOK:
                    raise ValueError(f"pre-split inputs need torch >= 2.14.1 ({torch.__version__})")
                return super()._get_microbatch_inputs(  # type: ignore[misc]
                    args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
                )
            args_split, kwargs_split = self._split_inputs(args, kwargs)
            targets_split = self._split_target(target) if target is not None else None
            return args_split, kwargs_split, targets_split

    if not MICROBATCH_INPUTS_HOOK:  # 2.13: step() splits inline; this one calls the methods

        def step(  # type: ignore[override]
            self,
            *args: Any,
            target: Any = None,
            losses: list | None = None,
            return_outputs: bool = True,
            loss_kwargs: dict[str, Any] | None = None,
            **kwargs: Any,
        ) -> Any:
            """torch 2.13's ``step()``, its inputs split by ``_get_microbatch_inputs``."""
            self.begin_step()
            args_split, kwargs_split, targets_split = self._get_microbatch_inputs(
                args, kwargs, target, None, None, None
            )
            self._step_microbatches(
                args_split, kwargs_split, targets_split, losses, return_outputs,
                loss_kwargs=loss_kwargs,
            )  # fmt: skip
            for stage in self._stages:
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

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


def _checked_loss_kwarg_mbs(
    loss_kwarg_mbs: Any, loss_kwargs: dict[str, Any] | None, n_units: int
) -> list[dict[str, Any]] | None:
    """Patch 1's checks of ``loss_kwarg_mbs``: one dict per microbatch, not with loss_kwargs."""
    if loss_kwarg_mbs is None:
        return None
    if loss_kwargs is not None:
        raise ValueError("pass loss_kwargs or loss_kwarg_mbs (one dict per microbatch), not both")
    if not isinstance(loss_kwarg_mbs, list) or not all(isinstance(d, dict) for d in loss_kwarg_mbs):
        raise TypeError(f"loss_kwarg_mbs must be a list of dicts, got {loss_kwarg_mbs!r}")
    if len(loss_kwarg_mbs) != n_units:
        raise ValueError(f"Expecting {n_units} loss_kwarg_mbs but got {len(loss_kwarg_mbs)}")
    return loss_kwarg_mbs


#: buffers up to this many elements (counters, running statistics) are put back after torch's
#: stage initialisation; larger ones are caches a forward fills, left as it leaves them
SMALL_BUFFER_NUMEL = 1 << 20


@contextlib.contextmanager
def small_buffers_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Put back the small buffers of ``modules`` that torch's stage initialisation changes.

    Its forward metadata inference runs each stage once on the first microbatch (torch 2.13
    with the real inputs), so an MoE layer's token counts per expert, or a norm's running
    statistics, would count a forward that the unpipelined run never makes. Upstream hook that
    would remove this: metadata inference that does not run the module's forward (meta/fake
    tensors)."""
    saved = [
        (b, b.detach().clone())
        for m in modules
        for b in m.buffers()
        if b.numel() <= SMALL_BUFFER_NUMEL
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _detached(value: Any) -> Any:
    """``value`` (a tensor or a tuple / list / dict of them) with every tensor detached."""
    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)
