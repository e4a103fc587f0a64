"""torch's own passes, for comparison only: what tests and benchmarks check ours against.

Tests and benchmarks reach torch's private pipelining passes through this module alone
(``from seq1f1b._runtime import reference as torch_ref``); package modules never import it
(what they run goes through the seam's API, ``seq1f1b._runtime.__all__``).
``tests/test_runtime_seam.py`` checks both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.pipelining import schedules as _schedules

from .ir import Action, PipelineStageBase, ScheduleRuntime, validate_schedule

__all__ = [
    "add_send_recv",
    "add_unshard_reshard",
    "format_pipeline_order",
    "load_csv",
    "lowering",
    "plain_runtime",
    "simulate_comms_compute",
    "validate_schedule",
]

# ``validate_schedule`` (from .ir): torch's ``_validate_schedule``, the checks and the
# stage -> rank mapping the runtime itself relies on; compared with here as a validator.


def add_send_recv(
    compute_actions: Mapping[int, list[Action | None]],
    stage_to_rank: Callable[[int], int],
    num_stages: int,
) -> dict[int, list[Action]]:
    """torch's ``_add_send_recv``: its lock-step SEND/RECV lowering of every rank's order."""
    return _schedules._add_send_recv(dict(compute_actions), stage_to_rank, num_stages)  # type: ignore[arg-type]


def simulate_comms_compute(
    pipeline_order: Mapping[int, list[Action | None]],
    stage_to_rank: Callable[[int], int],
    num_stages: int,
) -> dict[int, list[Action | None]]:
    """torch's ``_simulate_comms_compute``: replays a lowered order, raises on a deadlock."""
    return _schedules._simulate_comms_compute(dict(pipeline_order), stage_to_rank, num_stages)


def add_unshard_reshard(compute_actions: list[Action | None], **options: Any) -> list[Action]:
    """torch's ``_add_unshard_reshard`` for one rank (the FSDP pass ours must equal)."""
    return _schedules._add_unshard_reshard(compute_actions, **options)


def format_pipeline_order(
    pipeline_order: Mapping[int, list[Action | None]], error_step_number: int | None = None
) -> str:
    """torch's ``_format_pipeline_order``: an order as a readable table."""
    return _schedules._format_pipeline_order(dict(pipeline_order), error_step_number)


def plain_runtime(
    stages: Sequence[PipelineStageBase], n_microbatches: int, **options: Any
) -> ScheduleRuntime:
    """torch's plain ``_PipelineScheduleRuntime`` over ``stages`` (no seq1f1b hooks)."""
    return ScheduleRuntime(list(stages), n_microbatches, **options)


def load_csv(runtime: ScheduleRuntime, filename: str, format: str = "compute_only") -> None:
    """torch's own CSV load (``_load_csv``) into a runtime, e.g. a :func:`plain_runtime`."""
    ScheduleRuntime._load_csv(runtime, filename, format=format)  # type: ignore[arg-type]


def lowering(
    stages: Sequence[PipelineStageBase],
    actions: Mapping[int, Sequence[Action | None]],
    n_microbatches: int,
    **options: Any,
) -> dict[int, list[Action]]:
    """torch's own ``_prepare_schedule_with_comms`` of ``actions`` (every rank), on a plain
    runtime: the lowering ours must equal."""
    runtime = plain_runtime(stages, n_microbatches, **options)
    ScheduleRuntime._prepare_schedule_with_comms(runtime, {r: list(a) for r, a in actions.items()})
    return dict(runtime.pipeline_order_with_comms)
