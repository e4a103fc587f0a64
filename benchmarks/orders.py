"""Real ``pipeline_order`` of every compared schedule, built without processes.

Why: the simulator must run the orders torch and this library actually execute, not a
re-derivation. torch's schedules are constructed on stand-in stages (no process group), the
way PyTorch's own schedule tests do; Seq1F1B's order comes from :mod:`seq1f1b.order`, which is
what ``ScheduleSeq1F1B.pipeline_order`` holds; BitPipe's from :mod:`seq1f1b.bitpipe.order`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from seq1f1b._runtime import Action, ComputationType, StandInStage
from seq1f1b.bitpipe import build_bitpipe_orders
from seq1f1b.order import OrderSpec, build_orders

__all__ = ["SCHEDULES", "ScheduleSpec", "pipeline_order"]

Order = dict[int, list[Action | None]]

# name -> stages per rank (V schedules place stages r and 2*pp-1-r on rank r)
SCHEDULES: dict[str, int] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
    "Seq1F1B": 1,
    "InterleavedSeq1F1B": 2,
    "BitPipe": 4,  # 2 replicas x 2 V stages; each stage is L/(2pp) layers
}


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule at one size: ``name`` from :data:`SCHEDULES`, K only for Seq1F1B ones."""

    name: str
    pp: int
    microbatches: int
    seq_chunks: int = 1

    @property
    def stages_per_rank(self) -> int:
        return SCHEDULES[self.name]

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def replicas(self) -> int:
        """Independent pipelines in the stage id space (BitPipe's two model replicas)."""
        return 2 if self.name == "BitPipe" else 1

    @property
    def model_stages(self) -> int:
        """Stages one copy of the model is cut into (BitPipe: 2*pp per replica)."""
        return self.num_stages // self.replicas

    @property
    def label(self) -> str:
        if self.name.endswith("Seq1F1B"):
            return f"{self.name} K={self.seq_chunks}"
        return self.name


def _repair_1f1b(order: Order, n_microbatches: int) -> Order:
    """Fix torch 2.13's ``Schedule1F1B._get_pipeline_order`` on the last rank.

    It lists that rank's forwards as microbatches ``1..M`` instead of ``0..M-1`` (the runtime,
    which does not use this IR, is correct). Shift them back so the IR is runnable.
    """
    fixed: Order = {}
    for rank, actions in order.items():
        fwd = sorted(
            a.microbatch_index
            for a in actions
            if a is not None and a.computation_type == ComputationType.FORWARD
        )
        if fwd == list(range(1, n_microbatches + 1)):
            actions = [
                Action(a.stage_index, a.computation_type, a.microbatch_index - 1)
                if a is not None and a.computation_type == ComputationType.FORWARD
                else a
                for a in actions
            ]
        fixed[rank] = list(actions)
    return fixed


def pipeline_order(spec: ScheduleSpec) -> Order:
    """rank -> actions of ``spec``'s schedule; raises ValueError where torch refuses the size."""
    pp, m = spec.pp, spec.microbatches
    if spec.name in ("Seq1F1B", "InterleavedSeq1F1B"):
        return dict(build_orders(OrderSpec(pp, spec.stages_per_rank, m, spec.seq_chunks)))
    if spec.name == "BitPipe":
        return dict(build_bitpipe_orders(pp, m))
    if spec.name == "GPipe":
        return dict(ScheduleGPipe(StandInStage(0, pp, pp, 0), m).pipeline_order or {})
    if spec.name == "1F1B":
        order = Schedule1F1B(StandInStage(0, pp, pp, 0), m).pipeline_order or {}
        return _repair_1f1b(dict(order), m)
    n = spec.num_stages
    if spec.name == "Interleaved1F1B":
        stages = [StandInStage(s, n, pp, 0) for s in range(0, n, pp)]
        return dict(ScheduleInterleaved1F1B(stages, m).pipeline_order)
    v_stages = [StandInStage(0, n, pp, 0), StandInStage(n - 1, n, pp, 0)]
    if spec.name == "ZBVZeroBubble":
        return dict(ScheduleZBVZeroBubble(v_stages, m).pipeline_order)
    if spec.name == "DualPipeV":
        return dict(ScheduleDualPipeV(v_stages, m).pipeline_order)
    raise ValueError(f"unknown schedule {spec.name!r}: use one of {list(SCHEDULES)}")
