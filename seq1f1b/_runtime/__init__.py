"""The seam between seq1f1b and torch's private internals: every private torch name lives in
this package, in two layers: :mod:`.ir` (the action IR, passes, features, helpers; imports
nothing of seq1f1b) and :mod:`.unit` (the runtime subclass, above the lowering). This module
re-exports both, so ``seq1f1b._runtime`` reads as one seam.

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

from .ir import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    HAS_SEND_WAITS,
    HAS_WARMUP_P2P,
    OVERLAP_F_B,
    RECV_B,
    RECV_BUFFER_PER_RECEIVE,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    RUNTIME_OPTIONS,
    SEND_B,
    SEND_F,
    STEP_TAKES_FINALIZE,
    UNSHARD,
    UNSHARD_KEEPS_INSERTION_ORDER,
    WAIT_REDUCE_GRAD,
    WAIT_SEND_B,
    WAIT_SEND_F,
    Action,
    ComputationType,
    PipelineContext,
    PipelineStageBase,
    ScheduleRuntime,
    StandInStage,
    add_reduce_grad,
    add_send_recv,
    add_wait_send,
    default_process_group,
    defer_recv_ops,
    device_type_reported_as,
    flash_cpu_backward,
    flash_cpu_forward,
    flash_cuda_backward,
    flash_cuda_forward,
    flatten_dense_tensors,
    format_pipeline_order,
    fsdp_replicate,
    load_csv,
    received_tensors,
    recv_infos,
    recv_shape,
    set_pg_timeout,
    set_recv_length,
    simulate_comms_compute,
    stand_in_stages,
    torch_add_unshard_reshard,
    torch_lowering,
    unflatten_dense_tensors,
    validate_schedule,
    validate_send_waits,
)
from .unit import UnitRuntime, stage_methods_replaced

__all__ = [
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "FULL_BACKWARD",
    "HAS_SEND_WAITS",
    "HAS_WARMUP_P2P",
    "OVERLAP_F_B",
    "RECV_B",
    "RECV_BUFFER_PER_RECEIVE",
    "RECV_F",
    "REDUCE_GRAD",
    "RESHARD",
    "RUNTIME_OPTIONS",
    "SEND_B",
    "SEND_F",
    "STEP_TAKES_FINALIZE",
    "UNSHARD",
    "UNSHARD_KEEPS_INSERTION_ORDER",
    "WAIT_REDUCE_GRAD",
    "WAIT_SEND_B",
    "WAIT_SEND_F",
    "Action",
    "ComputationType",
    "PipelineContext",
    "PipelineStageBase",
    "ScheduleRuntime",
    "StandInStage",
    "UnitRuntime",
    "add_reduce_grad",
    "add_send_recv",
    "add_wait_send",
    "default_process_group",
    "defer_recv_ops",
    "device_type_reported_as",
    "flash_cpu_backward",
    "flash_cpu_forward",
    "flash_cuda_backward",
    "flash_cuda_forward",
    "flatten_dense_tensors",
    "format_pipeline_order",
    "fsdp_replicate",
    "load_csv",
    "received_tensors",
    "recv_infos",
    "recv_shape",
    "set_pg_timeout",
    "set_recv_length",
    "simulate_comms_compute",
    "stage_methods_replaced",
    "stand_in_stages",
    "torch_add_unshard_reshard",
    "torch_lowering",
    "unflatten_dense_tensors",
    "validate_schedule",
    "validate_send_waits",
]
