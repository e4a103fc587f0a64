"""One schedule registry: name -> schedule class, stages per rank, replicas, segments.

The torchtitan integration (TOML ``pipeline_parallel_schedule``), the benchmarks and the planner
all look schedules up here, so a schedule is described once: which class runs it, how its
stages are placed, how many model replicas it holds, and whether it cuts samples into
sequence segments. Names match case-insensitively, as torch's ``get_schedule_class`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from ._runtime.ir import FORWARD, Action, schedule_compute_order, stand_in_stages
from ._runtime.ir import StandInStage as _Stage
from .bitpipe import ScheduleBitPipe
from .schedules.schedule import (
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    ScheduleZBSeq1F1B,
    ScheduleZBVSeq1F1B,
)

if TYPE_CHECKING:
    from .orders.order import OrderSpec

__all__ = ["BASELINE_NAME", "REGISTRY", "ScheduleEntry", "is_baseline", "lookup", "schedule_names"]

Order = dict[int, list[Action | None]]


@dataclass(frozen=True)
class ScheduleEntry:
    """How one schedule is built and placed.

    ``placement``: ``"looped"`` (stage ``s`` on rank ``s % pp``), ``"v"`` (rank ``r`` holds
    stages ``r`` and ``2pp-1-r``) or ``"bitpipe"`` (two V-shaped replicas, 4 stages per rank).
    """

    name: str
    stages_per_rank: int
    placement: str = "looped"
    replicas: int = 1
    seq_chunked: bool = False  # samples run as K sequence segments (the Seq1F1B family)
    split_backward: bool = False  # backwards as BACKWARD_INPUT + BACKWARD_WEIGHT
    #: torch's own order splits backwards (its zero-bubble schedules): under checkpointing its
    #: weight half recomputes each block once per weight group (docs/upstream_hooks.md 11)
    torch_weight_half: bool = False
    ours: bool = False  # built by this library; otherwise torch's get_schedule_class(name)
    min_stages_per_rank: int = 1
    max_stages_per_rank: int | None = 1
    # published closed forms with equal-cost units (None: no simple form), and the backward
    # cost (in forwards) they assume: (pp, M, K, stages per rank) -> idle fraction / stage-0
    # peak activations in units of one sample's activations on one rank
    bubble_formula: Callable[[int, int, int, int], float] | None = None
    memory_formula: Callable[[int, int, int, int], float] | None = None
    formula_backward_cost: float = 2.0

    def schedule_class(self) -> type:
        if not self.ours:
            return get_schedule_class(self.name)
        return {
            "Seq1F1B": ScheduleSeq1F1B,
            "InterleavedSeq1F1B": ScheduleInterleavedSeq1F1B,
            "ZBSeq1F1B": ScheduleZBSeq1F1B,
            "ZBVSeq1F1B": ScheduleZBVSeq1F1B,
            "BitPipe": ScheduleBitPipe,
        }[self.name]

    @property
    def single_stage(self) -> bool:
        """torch's single-stage schedules take one stage object, not a list."""
        return not self.ours and issubclass(self.schedule_class(), PipelineScheduleSingle)

    def check_stages_per_rank(self, v: int) -> None:
        hi = self.max_stages_per_rank
        if v < self.min_stages_per_rank or (hi is not None and v > hi):
            want = (
                f"exactly {hi}"
                if hi == self.min_stages_per_rank
                else (f">= {self.min_stages_per_rank}")
            )
            raise ValueError(f"{self.name} needs {want} stages per rank (got {v})")

    def stages_of(self, pp: int, rank: int, stages_per_rank: int | None = None) -> list[int]:
        """The stage indices ``rank`` holds (looped or V placement; BitPipe has its layout)."""
        if self.placement == "bitpipe":
            from .bitpipe import BitPipeLayout

            return BitPipeLayout(pp).stages_of(rank)
        if self.placement == "v":
            return [rank, 2 * pp - 1 - rank]
        return list(range(rank, pp * (stages_per_rank or self.stages_per_rank), pp))

    def model_stages(self, pp: int, stages_per_rank: int | None = None) -> int:
        """Stages one copy of the model is cut into (BitPipe: 2*pp per replica)."""
        return pp * (stages_per_rank or self.stages_per_rank) // self.replicas

    def order_spec(
        self, pp: int, n_microbatches: int, seq_chunks: int, stages_per_rank: int | None = None
    ) -> OrderSpec:
        """The Seq1F1B-family order :meth:`compute_orders` builds (sequence-chunked entries)."""
        from .orders.order import OrderSpec

        if not self.seq_chunked:
            raise ValueError(f"{self.name} is not sequence-chunked: its order has no OrderSpec")
        v = stages_per_rank or self.stages_per_rank
        placement = "v" if self.placement == "v" else "looped"
        return OrderSpec(pp, v, n_microbatches, seq_chunks, self.split_backward, placement)

    def compute_orders(
        self, pp: int, n_microbatches: int, seq_chunks: int = 1, stages_per_rank: int | None = None
    ) -> Order:
        """Every rank's compute-only order, built without processes (stand-in stages)."""
        v = stages_per_rank or self.stages_per_rank
        self.check_stages_per_rank(v)
        if self.seq_chunked:
            from .orders.order import build_orders
            from .orders.order_v import build_v_orders

            spec = self.order_spec(pp, n_microbatches, seq_chunks, v)
            return dict(build_v_orders(spec) if spec.placement == "v" else build_orders(spec))
        if self.placement == "bitpipe":
            from .bitpipe import build_bitpipe_orders

            return dict(build_bitpipe_orders(pp, n_microbatches))
        n = pp * v
        if self.placement == "v":
            stages: list[_Stage] = [_Stage(0, n, pp, 0), _Stage(n - 1, n, pp, 0)]
        else:
            stages = stand_in_stages(pp, v)
        order = schedule_compute_order(
            self.schedule_class(), stages[0] if self.single_stage else stages, n_microbatches
        )
        return _shift_last_rank_forwards(order, n_microbatches)


def _chain_bubble(units: Callable[[int, int, int], int]) -> Callable[[int, int, int, int], float]:
    """(p-1)/(units + p-1): the idle fraction of a chain with ``units`` per stage pass."""
    return lambda p, m, k, v: (p - 1) / (units(m, k, v) + p - 1)


REGISTRY: tuple[ScheduleEntry, ...] = (
    ScheduleEntry(
        "GPipe",
        1,
        bubble_formula=_chain_bubble(lambda m, k, v: m),
        memory_formula=lambda p, m, k, v: float(m),
    ),
    ScheduleEntry(
        "1F1B",
        1,
        bubble_formula=_chain_bubble(lambda m, k, v: m),
        memory_formula=lambda p, m, k, v: float(min(p, m)),
    ),
    ScheduleEntry(
        "Interleaved1F1B",
        2,
        min_stages_per_rank=2,
        max_stages_per_rank=None,
        bubble_formula=_chain_bubble(lambda m, k, v: v * m),
    ),
    ScheduleEntry("LoopedBFS", 2, min_stages_per_rank=2, max_stages_per_rank=None),
    ScheduleEntry("InterleavedZeroBubble", 2, min_stages_per_rank=2, max_stages_per_rank=None,
                  torch_weight_half=True),
    ScheduleEntry("ZBVZeroBubble", 2, "v", min_stages_per_rank=2, max_stages_per_rank=2,
                  torch_weight_half=True),
    ScheduleEntry("DualPipeV", 2, "v", min_stages_per_rank=2, max_stages_per_rank=2,
                  torch_weight_half=True),
    ScheduleEntry(
        "Seq1F1B",
        1,
        seq_chunked=True,
        ours=True,
        bubble_formula=_chain_bubble(lambda m, k, v: k * m),
        memory_formula=lambda p, m, k, v: min(p + k - 1, m * k) / k,
    ),
    ScheduleEntry(
        "ZBSeq1F1B",
        1,
        seq_chunked=True,
        ours=True,
        split_backward=True,
        max_stages_per_rank=None,
        memory_formula=lambda p, m, k, v: min(p + k - 1, m * k) / k,
    ),
    ScheduleEntry(
        "ZBVSeq1F1B",
        2,
        "v",
        seq_chunked=True,
        ours=True,
        split_backward=True,
        min_stages_per_rank=2,
        max_stages_per_rank=2,
        # every rank: min(2MK, 2p+2K-2) units of 1/K sample on half of the rank's layers
        # (seq1f1b.orders.order_v.rank_peak_units), Seq1F1B's stage-0 peak
        memory_formula=lambda p, m, k, v: min(2 * p + 2 * k - 2, 2 * m * k) / (2 * k),
        formula_backward_cost=1.0,
    ),
    ScheduleEntry(
        "InterleavedSeq1F1B",
        2,
        seq_chunked=True,
        ours=True,
        min_stages_per_rank=2,
        max_stages_per_rank=None,
        bubble_formula=_chain_bubble(lambda m, k, v: v * k * m),
    ),
    ScheduleEntry(
        "BitPipe",
        4,
        "bitpipe",
        replicas=2,
        ours=True,
        min_stages_per_rank=4,
        max_stages_per_rank=4,
        # published with t_b = t_f; 2*pp chunk passes of A/2 (fewer when M/2 runs out)
        bubble_formula=lambda p, m, k, v: (p - 2) / (4 * m + p - 2),
        memory_formula=lambda p, m, k, v: float(min(p, m)),
        formula_backward_cost=1.0,
    ),
)
#: the schedule every benchmark ratio is taken against
BASELINE_NAME = "1F1B"
_BY_NAME = {e.name.lower(): e for e in REGISTRY}


def schedule_names(ours: bool | None = None) -> list[str]:
    return [e.name for e in REGISTRY if ours is None or e.ours == ours]


def lookup(name: str) -> ScheduleEntry:
    """The entry for ``name`` (any case); ValueError listing the known names otherwise."""
    entry = _BY_NAME.get(str(name).lower())
    if entry is None:
        raise ValueError(f"schedule {name!r} is unknown: use one of {schedule_names()}")
    return entry


def is_baseline(name: str) -> bool:
    return lookup(name) is lookup(BASELINE_NAME)


def _shift_last_rank_forwards(order: Order, n_microbatches: int) -> Order:
    """torch 2.13's ``Schedule1F1B`` IR lists the last rank's forwards as microbatches 1..M
    (its runtime, which does not read this IR, is right); shift them to 0..M-1 so the IR can
    be simulated. Orders without that defect are returned unchanged."""
    fixed: Order = {}
    for rank, actions in order.items():
        fwd = sorted(
            a.microbatch_index for a in actions if a is not None and a.computation_type == FORWARD
        )
        if fwd == list(range(1, n_microbatches + 1)):
            actions = [
                Action(a.stage_index, a.computation_type, a.microbatch_index - 1)
                if a is not None and a.computation_type == FORWARD
                else a
                for a in actions
            ]
        fixed[rank] = list(actions)
    return fixed
