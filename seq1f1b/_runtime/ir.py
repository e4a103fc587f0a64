"""The seam's lowest layer: torch's action IR, its private passes and stage types, detected
features, receive shapes, and small helpers over torch internals (see ``__init__``'s table).

Imports nothing of seq1f1b: orders, replay and lowering build on it; :mod:`.unit` (the
runtime) builds on them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch._prims_common as _prims_common
import torch.utils._pytree as _pytree
import torch.utils.checkpoint
from torch.distributed.pipelining import _utils as _pp_utils
from torch.distributed.pipelining import microbatch as _microbatch
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining import stage as _stage

# ---------------------------------------------------------------------------- the action IR
Action = _schedules._Action
ComputationType = _schedules._ComputationType
PipelineContext = _schedules._PipelineContext
ScheduleRuntime = _schedules._PipelineScheduleRuntime
PipelineStageBase = _stage._PipelineStageBase
#: a receive's metadata (2.15 sizes receives from it; patch 5's hook rewrites it per unit).
#: None on a torch older than the runtime this seam drives (see ``PIPELINING_RUNTIME``).
TensorMeta = getattr(_pp_utils, "TensorMeta", None)
DTensorMeta = getattr(_pp_utils, "_DTensorMeta", None)


def tensor_meta_of(tensor: torch.Tensor) -> Any:
    """A plain tensor's metadata, as torch infers it (``_TensorMeta.from_tensor``)."""
    return _pp_utils._TensorMeta.from_tensor(tensor)


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

# torch's passes and checks that our runtime uses (the ones tests and benchmarks only compare
# with live in .reference)
validate_schedule = _schedules._validate_schedule
get_warmup_ops = _schedules._get_warmup_ops  # the interleaved warm-up the Seq1F1B order extends
add_reduce_grad = _schedules._add_reduce_grad
#: torch's batch split of a target (``step()`` cuts the target with it along dim 0)
split_tensor = _microbatch._split_tensor
TARGET_CHUNK_SPEC = getattr(_schedules, "_TARGET_CHUNK_SPEC", None)  # None: see PIPELINING_RUNTIME
#: a per-leaf argument broadcast over a pytree (``vmap``'s ``in_dims`` rule): patch 6 cuts each
#: leaf at its own sequence dim
broadcast_to_and_flatten = _pytree._broadcast_to_and_flatten
#: torch's pytree flatten / unflatten (``torch.utils._pytree``, as torch's pipelining uses it:
#: patch 6 cuts and merges each leaf of a sample with them)
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
#: row-major strides of a shape (``torch._prims_common``): patch 6 sizes a contiguous receive
make_contiguous_strides_for = _prims_common.make_contiguous_strides_for

flatten_dense_tensors = torch._utils._flatten_dense_tensors
unflatten_dense_tensors = torch._utils._unflatten_dense_tensors


# ------------------------------------------------------------- state that backwards see
_T = TypeVar("_T")
_UNSET = object()


def _backward_launch_context() -> contextvars.Context | None:
    """The ``contextvars`` snapshot of the thread that launched the running backward:
    ``torch.autograd.graph._engine_run_backward`` stashes ``copy_context()`` in the engine's
    thread-local state (``"context"``, for the compiler's config), and the engine restores that
    state on its device worker threads before each task. None outside a backward."""
    if torch._C._is_key_in_tls("context"):
        return torch._C._get_obj_in_tls("context")
    return None


class AutogradContextVar(Generic[_T]):
    """A ``contextvars.ContextVar`` whose value, set on the thread that calls ``backward()``,
    is seen by the autograd engine's device worker threads too (checkpoint recomputation and
    Python backward functions run there for CUDA tensors, where a plain ContextVar reads
    nothing). ``get()`` returns this thread's value, else the backward launcher's (its
    snapshot, :func:`_backward_launch_context`), else the default: pytorch#191777's proposed
    ``torch.autograd.graph.AutogradContextVar``, which would replace it (as would #186583,
    which runs worker-thread callbacks in the launcher's context). As with that proposal, a
    backward launched on a worker thread (reentrant checkpointing's inner one) snapshots the
    worker's context, so its own callbacks read the default."""

    def __init__(self, name: str, default: _T) -> None:
        self._var: contextvars.ContextVar[Any] = contextvars.ContextVar(name)
        self._default = default

    def get(self) -> _T:
        value = self._var.get(_UNSET)
        if value is _UNSET:
            launched = _backward_launch_context()
            value = _UNSET if launched is None else launched.get(self._var, _UNSET)
        return self._default if value is _UNSET else value

    @contextlib.contextmanager
    def bound(self, value: _T) -> Iterator[_T]:
        """``value`` for the block, in this context (and backwards launched inside it)."""
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)


def backward_launch_context() -> contextvars.Context | None:
    """The snapshot :class:`AutogradContextVar` reads on a worker thread (None outside a
    backward): tests check that torch's backward launcher still stashes it."""
    return _backward_launch_context()


@contextlib.contextmanager
def as_backward_worker(snapshot: contextvars.Context) -> Iterator[None]:
    """This thread as the autograd engine makes a device worker thread for a task: the
    launcher's ``snapshot`` in the thread-local state (``torch._C._stash_obj_in_tls``) for the
    block, removed after. For tests of :class:`AutogradContextVar` without a GPU."""
    torch._C._stash_obj_in_tls("context", snapshot)
    try:
        yield
    finally:
        torch._C._remove_obj_from_tls("context")


# ---------------------------------------------------------------------------- other internals
def default_process_group() -> Any:
    return torch.distributed.distributed_c10d._get_default_group()


def set_pg_timeout(timeout: Any, group: Any) -> None:
    torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def device_type_probe() -> tuple[Any, str]:
    """Where torch answers "which accelerator is there" (``torch._utils``,
    ``_get_available_device_type``), as ``(owner, attribute)``: torchtitan reads it once at
    import to pick its device. The library never reassigns it; an integration's CPU patch
    list may, for the length of torchtitan's import, and undoes it."""
    return torch._utils, "_get_available_device_type"


def has_compiled_module(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` or a submodule is compiled (``module.compile()`` or an
    ``OptimizedModule`` wrapper, as torchtitan's per-block compile makes); None: no module
    (mock stages)."""
    return compiled_modules(module) > 0


def compiled_modules(module: torch.nn.Module | None) -> int:
    """How many of ``module``'s submodules (itself included) are compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def allow_compiled_variants(compiled: int, variants: int) -> int:
    """Raise dynamo's recompile limit (``torch._dynamo.config.recompile_limit``: per code
    object, process-wide) so that each of ``compiled`` modules may compile ``variants``
    versions; never lowers it. Blocks of one class share a code object, so a model whose
    blocks differ in structure (DeepSeek-V3's dense and MoE layers, GPT-OSS's windowed and
    full ones) needs an entry per structure and variant, and torchtitan's ``fullgraph=True``
    turns the limit into a hard failure. torchtitan raises it the same way for GPT-OSS.
    Upstream hook that would remove this: a recompile limit per compiled module. Returns
    the limit in force."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, compiled * variants)
    return config.recompile_limit


def dynamo_counters() -> Any:
    """dynamo's process-wide event counters (``torch._dynamo.utils.counters``; e.g.
    ``["stats"]["unique_graphs"]``): tests bound how many graphs a compiled stage makes, which
    no public API reports. Cleared by ``.clear()``."""
    from torch._dynamo.utils import counters

    return counters


def dynamo_unsupported() -> type[Exception]:
    """The error dynamo raises for what it cannot trace (``torch._dynamo.exc.Unsupported``)."""
    from torch._dynamo.exc import Unsupported

    return Unsupported


def set_donated_buffers(enabled: bool) -> bool:
    """Turn AOTAutograd's donated buffers on or off (``torch._functorch.config.donated_buffer``,
    process-wide); returns the previous setting. Zero-bubble orders run compiled backwards
    whole, so a donated buffer is used once (tests run them with it on)."""
    import torch._functorch.config as functorch_config

    before = bool(getattr(functorch_config, "donated_buffer", False))
    functorch_config.donated_buffer = enabled
    return before


@contextlib.contextmanager
def jit_autodiff_subgraphs_kept() -> Iterator[None]:
    """TorchScript's differentiable subgraphs kept (not inlined) inside the block, torch's
    default after (``torch._C._debug_set_autodiff_subgraph_inlining``): as Megatron-LM's
    ``initialize.py`` sets it, so a test sees the graph that trainer's fused kernels run."""
    torch._C._debug_set_autodiff_subgraph_inlining(False)
    try:
        yield
    finally:
        torch._C._debug_set_autodiff_subgraph_inlining(True)


def checkpoint_wrapper(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """``module`` wrapped for activation checkpointing as torchtitan's full AC wraps a block
    (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, ``CheckpointWrapper``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **kwargs)


def flash_attn_forward_op() -> Any | None:
    """flash-attn's forward as the op it registers with torch
    (``torch.ops.flash_attn._flash_attn_forward.default``), None where it registers none."""
    try:
        return torch.ops.flash_attn._flash_attn_forward.default
    except (AttributeError, RuntimeError):  # not installed, or a release without the op
        return None


def has_checkpointed_module(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` or a submodule is wrapped for activation checkpointing
    (``CheckpointWrapper``, as torchtitan's full and selective AC wrap each block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if not isinstance(module, torch.nn.Module):
        return False
    return any(isinstance(m, CheckpointWrapper) for m in module.modules())


@contextlib.contextmanager
def checkpoints_recomputed_once() -> Iterator[None]:
    """Each non-reentrant checkpointed block the enclosed backward calls reach is recomputed at
    most once (torch's ``GraphExecGroup``). Why: torch's weight half (``stage_backward_weight``)
    differentiates each group of weights in an ``autograd.grad`` call of its own, and such a
    block recomputes once per call, keeping each call's copy of the block's activations until
    the half ends: a Llama block (9 weight groups) ran 9 times and held 9 copies (the dry run's
    grid, a checkpoint called inside the block's forward, which ``has_checkpointed_module``
    does not see). The groups touch disjoint saved tensors, as the context requires. Entered
    only where no group is active (they do not nest) and torch has it. Upstream hook that
    would remove it: ``stage_backward_weight`` running its calls in one group
    (pytorch#167251, closed unmerged)."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    active = getattr(torch._C, "_get_graph_exec_group", None)
    if group is None or active is None or active() is not None:
        yield
        return
    with group():
        yield


@contextlib.contextmanager
def autograd_inside_custom_op() -> Iterator[None]:
    """Autograd recording again inside a ``torch.library`` custom op's implementation, which
    torch runs with the autograd dispatch keys excluded (the compiled Gated DeltaNet's
    backward differentiates its layer there). Upstream hook that would remove it: a custom op
    option to run its implementation with autograd (or ``register_autograd`` accepting a
    backward that differentiates the implementation itself)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
    for name in ("AutogradOther", "AutogradNestedTensor", "AutogradCPU", "AutogradCUDA"):
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name))
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - keys), torch.enable_grad():
        yield


def donated_buffers_enabled() -> bool:
    """AOTAutograd's donated buffers are on (the chunk-aware op keys its graphs by it)."""
    import torch._functorch.config as functorch_config

    return bool(getattr(functorch_config, "donated_buffer", False))


@contextlib.contextmanager
def fsdp_held_unsharded(module: torch.nn.Module) -> Iterator[None]:
    """For an FSDP2 module: while the block runs, its parameters stay gathered and its
    gradients accumulate unsharded (no reduction, no reshard after each backward); then the
    module's own settings back. A loss that runs its head's backward inside the forward, once
    per chunk (:class:`seq1f1b.ChunkedLoss`), then issues the same collectives whatever its
    number of chunks (which follows the segment length, and so may differ between data-
    parallel ranks), and the stage's REDUCE_GRAD (or the caller's backward) reduces the head's
    group (torchtitan: ``[norm, lm_head]``) once. FSDP2 has setters but no getters: the
    settings are read from its param groups."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    groups = module._get_fsdp_state()._fsdp_param_groups
    sync = all(g.reduce_grads for g in groups)
    reshard = all(g.reshard_after_backward for g in groups)
    module.set_requires_gradient_sync(False, recurse=False)
    module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(sync, recurse=False)
        module.set_reshard_after_backward(reshard, recurse=False)


@contextlib.contextmanager
def wider_grads_hidden_while_tracing(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """While dynamo traces a frame (a compile or a recompile) inside this context, every
    parameter of ``modules`` whose ``.grad`` has another dtype than itself holds no ``.grad``;
    each is put back, the same tensor, when the trace ends (also when it fails).

    Why: 2.15's FSDP2 keeps a bf16 unsharded parameter's gradient, accumulated over a step's
    backwards without reduction (pipelining), in the reduce dtype (fp32, ``grad_dtype``), and
    dynamo refuses to wrap a tensor whose gradient's dtype differs ("dtype mismatch between
    tensor and its gradient"). Units of different lengths (segments, per-sample splits) can
    make a compiled block recompile after a step's first backward, which then fails. A trace
    reads no gradient: hiding them changes nothing else. Only dynamo's own traces
    (``CallbackTrigger.DYNAMO``) act; a lazily compiled backward does not.

    Upstream hook that would remove this: dynamo accepting a gradient whose dtype is the
    tensor's ``grad_dtype`` (``torch/_dynamo/variables/builder.py``'s dtype check).
    """
    from torch._dynamo import callback as _callback

    handler = _callback.callback_handler
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(args: Any) -> None:
        if getattr(args, "callback_trigger", None) is not _callback.CallbackTrigger.DYNAMO:
            return
        for module in modules:
            for param in module.parameters():
                grad = param.grad
                if grad is not None and grad.dtype != param.dtype:
                    hidden.append((param, grad))
                    param.grad = None

    def end(_args: Any) -> None:
        while hidden:
            param, grad = hidden.pop()
            param.grad = grad

    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # torch._dynamo.reset() clears every callback
            handler.remove_start_callback(start)
            handler.remove_end_callback(end)
        end(None)


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
#: 2.13+: the pipelining runtime this seam drives: receive metadata (``_TensorMeta``), the
#: target's chunk spec, loss kwargs through the runtime. torch 2.11 and 2.12 lack all three,
#: and their runtime also differs where a one-rank step first runs (``defer_pp_recv`` unknown,
#: a P2P warm-up sent to the rank itself, each microbatch's input strides checked against the
#: first's): there ``import seq1f1b`` works (attention, masks, kernels, recurrent layers) and
#: the schedules refuse to be built (``UnitRuntime``), naming the torch they need.
PIPELINING_RUNTIME = (
    hasattr(_pp_utils, "_TensorMeta")
    and TARGET_CHUNK_SPEC is not None
    and "loss_kwargs" in inspect.signature(ScheduleRuntime._step_microbatches).parameters
)
#: 2.14.1+: ``step(arg_mbs=, kwarg_mbs=, target_mbs=)``; 2.15: ``finalize_gradients``.
_STEP_PARAMS = inspect.signature(_schedules.PipelineScheduleMulti.step).parameters
STEP_TAKES_FINALIZE = "finalize_gradients" in _STEP_PARAMS
STEP_TAKES_MICROBATCHES = "arg_mbs" in _STEP_PARAMS
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


#: torch hooks of the upstream series (upstream/README.md), found by feature. Where one is
#: found, the matching workaround is not used.
#: patch 5: ``PipelineStage.register_recv_meta_fn`` sizes each receive per microbatch
#: (retires rewriting ``_RecvInfo.tensor_meta`` / ``.buffer`` per unit in set_recv_meta).
RECV_META_HOOK = hasattr(PipelineStageBase, "register_recv_meta_fn")
#: patch 1: losses kept by microbatch index (with per-microbatch ``loss_kwarg_mbs`` in
#: ``step``); retires our ``_maybe_get_loss`` override and our own loss dict.
LOSSES_BY_INDEX = "loss_kwarg_mbs" in _STEP_PARAMS
#: patch 3: ``eval()`` runs a forward-only lowering that the runtime asks for
#: (``_get_forward_only_order_with_comms``); retires swapping ``pipeline_order_with_comms``
#: around an eval step (our lowering still supplies it: it knows non-chain stage graphs).
FORWARD_ONLY_EVAL = hasattr(ScheduleRuntime, "_get_forward_only_order_with_comms")
#: patch 4: ``register_action_context(factory)`` on the runtime; retires wrapping the stages'
#: per-chunk methods for each step (``action_contexts_installed``).
ACTION_CONTEXT_HOOK = hasattr(ScheduleRuntime, "register_action_context")
#: patch 6: ``_PipelineSchedule._split_target`` (torch's ``step()`` splits the target through
#: it); without it the seam's runtime gives the method and the split that calls it.
SPLIT_TARGET_HOOK = hasattr(ScheduleRuntime, "_split_target")
#: 2.14.1+: ``step()`` splits its inputs in ``_get_microbatch_inputs`` (2.13: inline).
MICROBATCH_INPUTS_HOOK = hasattr(ScheduleRuntime, "_get_microbatch_inputs")
#: every hook of the series, and whether this torch has it (upstream/check.sh asserts all)
TORCH_HOOKS = {
    "losses kept by microbatch index (patch 1)": LOSSES_BY_INDEX,
    "forward-only eval lowering (patch 3)": FORWARD_ONLY_EVAL,
    "register_action_context (patch 4)": ACTION_CONTEXT_HOOK,
    "register_recv_meta_fn (patch 5)": RECV_META_HOOK,
    "_split_target (patch 6)": SPLIT_TARGET_HOOK,
}


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


def release_recv_meta_fns(stages: Sequence[PipelineStageBase]) -> None:
    """Patch 5 (one receive metadata function per stage at a time): forget the one registered
    on each stage, so that a schedule built on them takes over their receive sizing (an earlier
    schedule's sizes units of its own steps); a stand-in stage gets the registry it lacks.

    Upstream hook that would remove this: patch 6's class keeping its registration handles and
    releasing them when another schedule takes the stages.
    """
    for stage in stages if RECV_META_HOOK else ():
        stage._recv_meta_fns = OrderedDict()  # type: ignore[attr-defined]


def set_recv_meta(info: Any, meta: Any) -> None:
    """Make a descriptor receive into ``meta``: torch's metadata (2.15), else a buffer of its
    shape (2.13/2.14)."""
    if RECV_BUFFER_PER_RECEIVE:
        info.tensor_meta = meta
    else:
        _receive_into(info, torch.Size(meta.shape))


def contiguous_receives(stages: Sequence[PipelineStageBase]) -> None:
    """Every receive of these stages into a contiguous buffer. Torch sizes a gradient receive
    from the next stage's inferred input gradient, whose strides can be a view's (the
    gradient of a transposed activation under tensor parallelism: DeepSeek-V3 x TP); gloo
    and NCCL receive only into contiguous buffers, and what is sent is made contiguous.
    Upstream hook that would remove this: ``_RecvInfo`` allocating contiguous buffers."""
    for stage in stages:
        for backward in (False, True):
            for infos in recv_infos(stage, backward).values():
                for info in infos:
                    if getattr(info, "is_root_arg", False):
                        continue
                    if RECV_BUFFER_PER_RECEIVE:
                        meta = getattr(info, "tensor_meta", None)
                        dense = None if meta is None else _dense_strides(meta.shape)
                        if meta is not None and tuple(meta.stride) != dense:
                            info.tensor_meta = dataclasses.replace(meta, stride=dense)
                    else:
                        buf = getattr(info, "buffer", None)
                        if isinstance(buf, torch.Tensor) and not buf.is_contiguous():
                            new = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)
                            info.buffer = new.requires_grad_(buf.requires_grad)


def _dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    return torch.empty(tuple(shape), device="meta").stride()


def _receive_into(info: Any, shape: torch.Size) -> None:
    """2.13/2.14: reallocate the descriptor's buffer when its shape differs."""
    buf = info.buffer
    if buf.shape != shape:
        new = torch.empty(shape, dtype=buf.dtype, device=buf.device)
        info.buffer = new.requires_grad_(buf.requires_grad)


def received_tensors(stage: PipelineStageBase, unit: int) -> list[tuple[int, Any, torch.Tensor]]:
    """(slot, descriptor, tensor) of each activation received for ``unit`` and not yet
    consumed (for the length check); slot is the descriptor's index, as in recv_infos."""
    out: list[tuple[int, Any, torch.Tensor]] = []
    for slot, info in enumerate(stage.args_recv_info.get(unit, ())):
        buf = getattr(info, "buffer", None)
        if not getattr(info, "is_root_arg", False) and isinstance(buf, torch.Tensor):
            out.append((slot, info, buf))
    return out


_STAGE_MAPPING = getattr(_schedules.PipelineScheduleMulti, "_validate_and_set_stage_mapping", None)


def schedule_compute_order(
    schedule_class: type, stages: Any, n_microbatches: int
) -> dict[int, list[Action | None]]:
    """The compute-only ``pipeline_order`` torch's ``schedule_class`` builds on ``stages``.

    Why: a multi-stage schedule's constructor ends by lowering every rank's order to
    send/receive actions (``_prepare_schedule_with_comms``, seconds at pp=32), which a reader of
    the compute order does not use; here that step only validates the order and maps stages to
    ranks (its first step), so the order is the constructor's own.
    """
    cls = schedule_class
    if issubclass(cls, ScheduleRuntime) and _STAGE_MAPPING is not None:

        def validate_only(self: Any, actions: Any, format: str = "compute_only") -> None:
            _STAGE_MAPPING(self, actions)

        cls = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": validate_only})
    schedule = cls(stages, n_microbatches)
    return dict(schedule.pipeline_order or {})
