"""The seam between seq1f1b and torch's private internals: every private torch name lives in
this package, in two layers: :mod:`.ir` (the action IR, passes, features, helpers; imports
nothing of seq1f1b) and :mod:`.unit` (the runtime subclass, above the lowering). This module
re-exports both, so ``seq1f1b._runtime`` reads as one seam. Beside them, :mod:`.reference`:
torch's own passes, for comparison only (tests and benchmarks, nothing else).

Outside the seam only three lists may be used (``tests/test_runtime_seam.py`` checks every
use, under any name): :data:`VOCABULARY` (the action IR and detected features), :data:`API`
(the seam's own contract) and :mod:`.reference` (tests/benchmarks compare with torch's passes
only through reference.py). ``__all__`` is VOCABULARY + API.

The schedules build compute-only orders in torch's action IR and let torch's
``_PipelineScheduleRuntime`` run them. What torch does not offer as a public hook is reached
through this module only, so a new torch release is checked in one place. Features are
detected (``hasattr``/signatures), never inferred from version numbers.

Internals used (all checked on 2.13.0, 2.14.1 and 2.15.0 unless noted; on 2.11.0 the package
imports, its schedules refuse: ``PIPELINING_RUNTIME``):

| torch internal                                | why                                              |
|-----------------------------------------------|--------------------------------------------------|
| schedules._Action, _ComputationType           | the action IR every order is written in          |
| schedules._PipelineScheduleRuntime            | base class: torch lowers and runs our orders     |
| schedules._PipelineContext                    | argument of register_custom_function hooks       |
| schedules._validate_schedule                  | stage -> rank mapping and torch's order checks   |
| schedules._get_warmup_ops                     | the interleaved warm-up Seq1F1B's order extends  |
|                                               |   (orders/upstream.py, patch 6's code verbatim)  |
| microbatch._split_tensor,                     | the target split along dim 0 (``_split_target``, |
|   schedules._TARGET_CHUNK_SPEC                |   and schedules/upstream.py, patch 6 verbatim)   |
| utils._pytree._broadcast_to_and_flatten       | a sequence dim per input leaf (patch 6's         |
|                                               |   ``_split_into_segments``, verbatim)            |
| utils._pytree.tree_flatten, tree_unflatten,   | patch 6's cutting and merging of a sample's      |
|   _prims_common.make_contiguous_strides_for   |   leaves, its contiguous receive sizes (verbatim;|
|                                               |   schedules/upstream.py's header binds them)     |
| utils._pytree.tree_map_only (unit.py)         | the last stage's kept outputs detached (what     |
|                                               |   ``step()`` returns holds no graph)             |
| reference.py: schedules._add_send_recv,       | tests/benchmarks compare with torch's passes     |
|   _simulate_comms_compute,                    |   only through reference.py: lowering and        |
|   _add_unshard_reshard,                       |   deadlock replay ours must equal, the FSDP pass |
|   _format_pipeline_order, _validate_schedule, |   of our linear-time one, readable orders, and   |
|   _PipelineScheduleRuntime (plain), its       |   torch's plain runtime (its lowering, its CSV   |
|   _prepare_schedule_with_comms, _load_csv     |   load) as the reference                         |
| schedules._add_reduce_grad                    | REDUCE_GRAD (+ WAIT_REDUCE_GRAD, 2.15) per rank  |
| schedules._add_wait_send,                     | 2.15 only: every SEND retired by a WAIT_SEND     |
|   _validate_send_waits                        |   (a linear per-rank pass: torch's own)          |
| schedules._defer_recv_ops                     | defer_pp_recv=True (torch's own per-rank pass)   |
| runtime methods _prepare_schedule_with_comms, | fast per-rank lowering, per-unit losses,         |
|   _maybe_compute_loss, _maybe_get_loss,       |   per-unit receive shapes, forward-only eval     |
|   _update_losses, _initialize_stages,         |   orders (overridden in UnitRuntime; the first   |
|   _step_microbatches, _load_csv, _compute_loss|   also in schedule_compute_order: torch's        |
|                                               |   classes' orders read without their lowering)   |
| PipelineScheduleMulti                         | schedule_compute_order: the lowering's first     |
|   ._validate_and_set_stage_mapping            |   step, the order's checks and stage mapping     |
| runtime method _warmup_p2p                    | 2.13/2.14: P2P warm-up once per stage chain      |
| runtime methods _get_microbatch_inputs        | where patch 6 is absent: ``_split_target`` added,|
|   (2.14.1+), _split_inputs, _merge_outputs,   |   the split calls it (2.13: a copy of torch's    |
|   step                                        |   ``step()``)                                    |
| runtime attribute _internal_losses            | where patch 1 is absent: our dict, torch's name  |
| runtime attributes _stages, _n_microbatches,  | read through UnitRuntime's properties            |
|   _has_backward, _loss_fn, _num_stages, specs |                                                  |
| stage._PipelineStageBase                      | type of user stages                              |
| _utils.TensorMeta, _DTensorMeta, _TensorMeta  | a receive's metadata, resized per unit (2.15;    |
|                                               |   schedules/upstream.py, patch 6's code verbatim)|
| stage._RecvInfo .buffer (2.13/2.14) or        | per-unit receive shape (segments differ in       |
|   .tensor_meta (2.15)                         |   length)                                        |
| torch._utils._flatten_dense_tensors,          | BitPipe pair gradient buckets                    |
|   _unflatten_dense_tensors                    |                                                  |
| torch._dynamo.config.recompile_limit          | room for a compiled block's variants (a static   |
|                                               |   first length, then dynamic lengths) per block  |
|                                               |   structure, which share one code object         |
| torch._dynamo.eval_frame.OptimizedModule,     | zero-bubble orders run compiled stages'          |
|   Module._compiled_call_impl                  |   backwards whole (split, a compiled backward    |
|                                               |   would run twice; pytorch#161904)               |
| algorithms._checkpoint.checkpoint_wrapper     | zero-bubble orders run checkpointed stages'      |
|   .CheckpointWrapper                          |   backwards whole (split, every weight group's   |
|                                               |   autograd.grad recomputes the block again)      |
| torch._C._get_graph_exec_group                | a weight half's calls share one GraphExecGroup   |
|   (with the public utils.checkpoint           |   (``checkpoints_recomputed_once``): a block     |
|   .GraphExecGroup)                            |   checkpointed inside its forward, which the     |
|                                               |   wrapper check cannot see, recomputes once per  |
|                                               |   W, not once per weight group (pytorch#167251)  |
| torch._C._is_key_in_tls, _get_obj_in_tls     | the contextvars snapshot torch's backward        |
|   ("context")                                 |   launcher stashes for its worker threads        |
|                                               |   (AutogradContextVar: the unit context seen in  |
|                                               |   recomputation on CUDA; pytorch#191777)         |
| aten._scaled_dot_product_flash_attention*     | flash kernels that return the LSE (attention.py) |
| ops.flash_attn._flash_attn_forward            | flash-attn's op (``flash_attn_forward_op``): on  |
|                                               |   selective AC's save list where it is installed |
| torch._C._ForceDispatchKeyGuard,              | autograd inside a custom op's implementation     |
|   _dispatch_tls_local_include_set,            |   (``autograd_inside_custom_op``: the compiled   |
|   _dispatch_tls_local_exclude_set,            |                                                  |
|   DispatchKey(Set)                            |   Gated DeltaNet's backward differentiates it)   |
| distributed_c10d._get_default_group,          | BitPipe pair check; torchtitan on gloo (CPU)     |
|   _set_pg_timeout                             |                                                  |
| torch._utils._get_available_device_type       | named (device_type_probe) for torchtitan 0.2.2's |
|                                               |   CPU patch list, reassigned during the import   |
| _composable.replicate_with_fsdp.replicate     | DP-replicate that the pipelining runtime reduces |
| _dynamo.callback.callback_handler,            | a step hides FSDP2's fp32-accumulated gradients  |
|   CallbackTrigger (register/remove_*_callback)|   of bf16 parameters from dynamo's (re)traces    |
|                                               |   (``wider_grads_hidden_while_tracing``)         |
| FSDPModule._get_fsdp_state()                  | ChunkedLoss restores the head's gradient-sync    |
|   ._fsdp_param_groups[].reduce_grads,         |   and reshard settings (FSDP2 has setters, no    |
|   .reshard_after_backward                     |   getters)                                       |
| schedules._resolve_unshard_lookahead          | 2.15's runtime options detected by it            |
|                                               |   (``RUNTIME_OPTIONS``)                          |
| _functorch.config.donated_buffer              | read (the chunk-aware op keys graphs by it) and, |
|                                               |   in tests, set (``set_donated_buffers``)        |
| tests only: torch._C._stash_obj_in_tls,       | a device worker thread's snapshot without a GPU  |
|   _remove_obj_from_tls                        |   (``as_backward_worker``); dynamo's graph count |
|   _dynamo.utils.counters, _dynamo.exc         |   and untraceable error (``dynamo_counters``,    |
|   .Unsupported,                               |   ``dynamo_unsupported``); Megatron's TorchScript|
|   _C._debug_set_autodiff_subgraph_inlining,   |   setting (``jit_autodiff_subgraphs_kept``);     |
|   _checkpoint.checkpoint_wrapper              |   full AC as torchtitan wraps a block            |
|   .checkpoint_wrapper                         |   (``checkpoint_wrapper``)                       |

Hooks of the upstream series (``upstream/``), found by feature (``TORCH_HOOKS``); on a torch
that has one, the workaround it retires is not used:

| hook (patch)                                  | workaround it retires                            |
|-----------------------------------------------|--------------------------------------------------|
| losses by microbatch index (1)                | our ``_maybe_get_loss`` and our own loss dict    |
| linear-time lowering (2; no API to detect)    | needs no workaround off: lowering.py equals it   |
| forward-only eval lowering (3)                | swapping ``pipeline_order_with_comms`` in eval   |
| ``register_action_context`` (4)               | ``action_contexts_installed`` (stage wrapping)   |
| ``register_recv_meta_fn`` (5)                 | rewriting ``_RecvInfo.tensor_meta`` per unit;    |
|                                               |   the stage method, given by ``UnitRuntime``;    |
|                                               |   with it, ``stage._recv_meta_fns`` is reset     |
|                                               |   when a schedule takes the stages (one function |
|                                               |   per stage; ``release_recv_meta_fns``)          |
| ``_split_target`` (6, ``SPLIT_TARGET_HOOK``)  | ``UnitRuntime``'s ``_split_target`` and split    |

Patch 6's ``ScheduleSeq1F1B`` (schedules/upstream.py, verbatim) runs on ``UnitRuntime`` on
torch without the series: where a hook is absent, ``UnitRuntime`` gives what the class takes
from it (the runtime options at torch's defaults dropped before 2.15, ``_internal_losses`` a
dict, ``loss_kwarg_mbs``, ``register_recv_meta_fn`` on its stages, ``_split_target``). The
package's Seq1F1B schedules are layers over that class, so they run on the same emulation.

Touch points (distinct private torch names, overridden private methods and private attributes
reached in ir.py + unit.py, counted from their syntax trees): 46, plus the 5 that issue 60
moved here from the package and its tests (``_prims_common``, ``_stash_obj_in_tls``,
``_remove_obj_from_tls``, ``_debug_set_autodiff_subgraph_inlining``, flash-attn's
``_flash_attn_forward``): 51. ``tests/test_runtime_seam.py`` finds every private torch name
by parsing, outside the seam (none allowed) and inside (each in this table); the
comparison-only passes are in reference.py (test-only). The per-step stage wrapping is one
composable per-action context (``UnitRuntime.register_action_context``; it wraps the public
``forward_one_chunk``/``backward_one_chunk``/``backward_weight_one_chunk``, whatever they are,
and restores them), the shape of the hook torch would offer.

The dry run's fake execution (fake tensors, the fake process group, MemTracker, a dispatch
mode) is reached through :mod:`.fake`, whose own table lists what it uses.
A failed step's report to every rank (the default c10d store) goes through
:mod:`.failures`, whose own table lists what it uses.

Each workaround names the upstream hook that would remove it in ``docs/upstream_hooks.md``.
"""

from .failures import StepFailures, raised_on_every_rank
from .fake import (
    FakeTensorMode,
    Holder,
    PipelineMemTracker,
    TorchDispatchMode,
    fake_world,
    gathered_parameters,
    is_fake,
    is_subclass_dispatch,
    outside_fake_mode,
    real_mesh_tables,
    schedule_stages,
    set_static_metadata,
    swapped_out_kept,
)
from .ir import (
    ACTION_CONTEXT_HOOK,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FORWARD_ONLY_EVAL,
    FULL_BACKWARD,
    HAS_SEND_WAITS,
    HAS_WARMUP_P2P,
    LOSSES_BY_INDEX,
    MICROBATCH_INPUTS_HOOK,
    OVERLAP_F_B,
    PIPELINING_RUNTIME,
    RECV_B,
    RECV_BUFFER_PER_RECEIVE,
    RECV_F,
    RECV_META_HOOK,
    REDUCE_GRAD,
    RESHARD,
    RUNTIME_OPTIONS,
    SEND_B,
    SEND_F,
    SPLIT_TARGET_HOOK,
    STEP_TAKES_FINALIZE,
    STEP_TAKES_MICROBATCHES,
    TARGET_CHUNK_SPEC,
    TORCH_HOOKS,
    UNSHARD,
    UNSHARD_KEEPS_INSERTION_ORDER,
    WAIT_REDUCE_GRAD,
    WAIT_SEND_B,
    WAIT_SEND_F,
    Action,
    AutogradContextVar,
    ComputationType,
    DTensorMeta,
    PipelineContext,
    PipelineStageBase,
    StandInStage,
    TensorMeta,
    add_reduce_grad,
    add_wait_send,
    allow_compiled_variants,
    as_backward_worker,
    autograd_inside_custom_op,
    backward_launch_context,
    broadcast_to_and_flatten,
    checkpoint_wrapper,
    checkpoints_recomputed_once,
    compiled_modules,
    default_process_group,
    defer_recv_ops,
    device_type_probe,
    donated_buffers_enabled,
    dynamo_counters,
    dynamo_unsupported,
    flash_attn_forward_op,
    flash_cpu_backward,
    flash_cpu_forward,
    flash_cuda_backward,
    flash_cuda_forward,
    flatten_dense_tensors,
    fsdp_held_unsharded,
    fsdp_replicate,
    get_warmup_ops,
    has_checkpointed_module,
    has_compiled_module,
    jit_autodiff_subgraphs_kept,
    make_contiguous_strides_for,
    received_tensors,
    recv_infos,
    recv_shape,
    release_recv_meta_fns,
    schedule_compute_order,
    set_donated_buffers,
    set_pg_timeout,
    split_tensor,
    stand_in_stages,
    tree_flatten,
    tree_unflatten,
    unflatten_dense_tensors,
    validate_schedule,
    validate_send_waits,
    wider_grads_hidden_while_tracing,
)
from .unit import ActionContextFactory, UnitRuntime, action_contexts_installed, small_buffers_kept

__all__ = [
    "ACTION_CONTEXT_HOOK",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "FORWARD_ONLY_EVAL",
    "FULL_BACKWARD",
    "HAS_SEND_WAITS",
    "HAS_WARMUP_P2P",
    "LOSSES_BY_INDEX",
    "MICROBATCH_INPUTS_HOOK",
    "OVERLAP_F_B",
    "PIPELINING_RUNTIME",
    "RECV_B",
    "RECV_BUFFER_PER_RECEIVE",
    "RECV_F",
    "RECV_META_HOOK",
    "REDUCE_GRAD",
    "RESHARD",
    "RUNTIME_OPTIONS",
    "SEND_B",
    "SEND_F",
    "SPLIT_TARGET_HOOK",
    "STEP_TAKES_FINALIZE",
    "STEP_TAKES_MICROBATCHES",
    "TARGET_CHUNK_SPEC",
    "TORCH_HOOKS",
    "UNSHARD",
    "UNSHARD_KEEPS_INSERTION_ORDER",
    "WAIT_REDUCE_GRAD",
    "WAIT_SEND_B",
    "WAIT_SEND_F",
    "Action",
    "ActionContextFactory",
    "AutogradContextVar",
    "ComputationType",
    "DTensorMeta",
    "FakeTensorMode",
    "Holder",
    "PipelineContext",
    "PipelineMemTracker",
    "PipelineStageBase",
    "StandInStage",
    "StepFailures",
    "TensorMeta",
    "TorchDispatchMode",
    "UnitRuntime",
    "action_contexts_installed",
    "add_reduce_grad",
    "add_wait_send",
    "allow_compiled_variants",
    "as_backward_worker",
    "autograd_inside_custom_op",
    "backward_launch_context",
    "broadcast_to_and_flatten",
    "checkpoint_wrapper",
    "checkpoints_recomputed_once",
    "compiled_modules",
    "default_process_group",
    "defer_recv_ops",
    "device_type_probe",
    "donated_buffers_enabled",
    "dynamo_counters",
    "dynamo_unsupported",
    "fake_world",
    "flash_attn_forward_op",
    "flash_cpu_backward",
    "flash_cpu_forward",
    "flash_cuda_backward",
    "flash_cuda_forward",
    "flatten_dense_tensors",
    "fsdp_held_unsharded",
    "fsdp_replicate",
    "gathered_parameters",
    "get_warmup_ops",
    "has_checkpointed_module",
    "has_compiled_module",
    "is_fake",
    "is_subclass_dispatch",
    "jit_autodiff_subgraphs_kept",
    "make_contiguous_strides_for",
    "outside_fake_mode",
    "raised_on_every_rank",
    "real_mesh_tables",
    "received_tensors",
    "recv_infos",
    "recv_shape",
    "release_recv_meta_fns",
    "schedule_compute_order",
    "schedule_stages",
    "set_donated_buffers",
    "set_pg_timeout",
    "set_static_metadata",
    "small_buffers_kept",
    "split_tensor",
    "stand_in_stages",
    "swapped_out_kept",
    "tree_flatten",
    "tree_unflatten",
    "unflatten_dense_tensors",
    "validate_schedule",
    "validate_send_waits",
    "wider_grads_hidden_while_tracing",
]

#: (a) the action IR every order is written in, and the features detected in this release:
#: usable anywhere.
VOCABULARY = (
    "Action",
    "ComputationType",
    "FORWARD",
    "FULL_BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "UNSHARD",
    "RESHARD",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "REDUCE_GRAD",
    "OVERLAP_F_B",
    "WAIT_SEND_F",
    "WAIT_SEND_B",
    "WAIT_REDUCE_GRAD",
    "HAS_SEND_WAITS",
    "HAS_WARMUP_P2P",
    "PIPELINING_RUNTIME",
    "RECV_META_HOOK",
    "TORCH_HOOKS",
    "ACTION_CONTEXT_HOOK",
    "FORWARD_ONLY_EVAL",
    "LOSSES_BY_INDEX",
    "RECV_BUFFER_PER_RECEIVE",
    "RUNTIME_OPTIONS",
    "SPLIT_TARGET_HOOK",
    "MICROBATCH_INPUTS_HOOK",
    "STEP_TAKES_FINALIZE",
    "STEP_TAKES_MICROBATCHES",
    "UNSHARD_KEEPS_INSERTION_ORDER",
)
#: (b) the seam's own contract, what package modules need to do their job: the runtime, stage
#: types and stand-in stages, receive shapes, the torch passes our lowering runs, helpers over
#: other internals. Everything in ``__all__`` that is not VOCABULARY.
API = tuple(name for name in __all__ if name not in VOCABULARY)
#: (c) torch's own passes, only to compare ours with: only in tests/ and benchmarks/, and only
#: through this submodule (``from seq1f1b._runtime import reference as torch_ref``).
REFERENCE = "reference"
