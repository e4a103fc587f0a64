"""torchtitan's published H100 measurements, the planner's predictions of them, and the fit of
the H100 profile to some of them.

Why: these are the published H100 measurements of the trainer the planner writes configs for
(pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, December 2024, and
``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md``, June 2025). Their H100s are Grand
Teton's: SXM H100s with 96 GB of HBM2e at a 500 W power limit (the files: "the actual peak
TFLOPs number is between SXM and NVL"), NVLink inside a host, 400 Gb/s RDMA per GPU between
hosts. Only their bf16 rows are used (the planner prices no Float8), and no row with async TP.

Every cell trains Llama 3 at 8192 tokens per sequence (the configs of those commits), one
forward and backward of ``local_batch`` sequences per step and GPU group (no pipeline, no
gradient accumulation), the loss on the whole vocabulary in fp32 (``cross_entropy(pred.float())``
of those commits), FSDP with bf16 parameters and fp32 reductions. TPS is tokens per second per
GPU; memory is ``torch.cuda.max_memory_reserved()`` in GiB, the largest over GPUs.

The H100 profile is fitted on the compiled FSDP cells (:data:`FIT`: how far the H100 reaches
the A100's fitted fractions of its own peak, and its collectives' fraction of the links) and
predicts the compiled TP cells, which it never saw (:data:`HELD_OUT`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from seq1f1b._runtime import ir as rt
from seq1f1b.planning.costmodel import (
    PRESETS,
    MemoryModel,
    TimeModel,
    action_work,
    fsdp_exposed_seconds,
)
from seq1f1b.planning.fitting import Observation, pattern_search, relative_errors
from seq1f1b.planning.profiles import A100_FIT, Efficiency, GpuProfile

__all__ = [
    "CELLS",
    "FIT",
    "HELD_OUT",
    "SLACK_CELL",
    "TitanCell",
    "allocator_slack",
    "fit_h100",
    "memory_gib",
    "memory_parts",
    "titan_rows",
    "tokens_per_second",
]

GIB = 2.0**30
SEQ_LEN = 8192
#: the published tables (the paper's and torchtitan's), as data beside this benchmark
PUBLISHED: dict[str, Any] = json.loads((Path(__file__).parent / "published.json").read_text())
_TITAN = PUBLISHED["torchtitan_h100"]


@dataclass(frozen=True)
class TitanCell:
    """One published torchtitan run on H100s: the model, its degrees, activation
    checkpointing (``selective``: op-level, or ``full``), whether blocks were compiled, and
    what it measured (tokens/s per GPU; peak reserved GiB, None where not published)."""

    label: str
    model: str  # a key of PRESETS
    gpus: int
    tp: int
    local_batch: int
    ac: str
    compiled: bool
    tps: float
    memory_gib: float | None
    source: str

    @property
    def fsdp(self) -> int:
        return self.gpus // self.tp


CELLS = tuple(
    TitanCell(**{**cell, "source": _TITAN["sources"][cell["source"][0]] + cell["source"][1]})
    for cell in _TITAN["cells"]
)
#: the cells the H100 profile is fitted on: compiled FSDP on one host and on 16 (the
#: kernels, and FSDP's collectives across hosts)
FIT = CELLS[:2]
#: compiled cells the fit never saw: tensor parallelism inside a host, a 70B with full AC
HELD_OUT = CELLS[2:4]
#: the cell the caching allocator's slack is read from (:func:`allocator_slack`): eager, as
#: Megatron-LM runs, on one host
SLACK_CELL = CELLS[4]


def _time_model(prof: GpuProfile, cell: TitanCell) -> TimeModel:
    shape = PRESETS[cell.model]
    return TimeModel(
        prof.hardware(cell.gpus), shape, cell.tp, cell.ac == "full", shape.n_layers,
        actions=prof.action_costs(), selective=cell.ac == "selective",
    )  # fmt: skip


def tokens_per_second(prof: GpuProfile, cell: TitanCell) -> float:
    """The planner's tokens/s per GPU of ``cell`` on ``prof``: one forward and one backward of
    the local batch (each sequence's attention causal over its own 8192 tokens), this GPU's
    ``1/tp`` share, and what FSDP's collectives leave exposed
    (:func:`~seq1f1b.planning.costmodel.fsdp_exposed_seconds`)."""
    time = _time_model(prof, cell)
    shape, layers = time.shape, time.shape.n_layers
    tokens = cell.local_batch * SEQ_LEN
    work = action_work(shape, layers, True, SEQ_LEN, SEQ_LEN).scaled(cell.local_batch)
    forward = time.seconds(rt.FORWARD, work, tokens, layers)
    backward = time.seconds(rt.FULL_BACKWARD, work, tokens, layers)
    params = layers * shape.params_per_layer + 2 * shape.vocab * shape.hidden
    fsdp = fsdp_exposed_seconds(
        params / cell.tp, cell.fsdp, time.hardware.link_gbps(cell.gpus), layers,
        pipelined=False, microbatches=1, forward=forward, backward=backward,
    )  # fmt: skip
    return tokens / cell.tp / (forward + backward + fsdp)


def memory_parts(cell: TitanCell) -> tuple[float, float]:
    """The planner's peak memory of ``cell`` in GiB as (model state, activations): the state
    sharded by FSDP (and TP) with the units FSDP gathers; the local batch's saved
    activations and the loss's fp32 logits (:class:`~seq1f1b.planning.costmodel.MemoryModel`).
    No GPU figure enters it."""
    shape = PRESETS[cell.model]
    memory = MemoryModel(
        shape, cell.tp, cell.fsdp, cell.ac == "full", fsdp_wrapped=True,
        selective=cell.ac == "selective",
    )  # fmt: skip
    tokens, layers = cell.local_batch * SEQ_LEN, shape.n_layers
    state = memory.state_bytes(layers, True, True)
    return state / GIB, memory.activation_bytes(tokens, tokens, layers, True, False) / GIB


def memory_gib(cell: TitanCell) -> float:
    """The planner's peak memory of ``cell`` in GiB (:func:`memory_parts`), what a trainer
    allocates at its peak."""
    return sum(memory_parts(cell))


def allocator_slack(cell: TitanCell = SLACK_CELL) -> float:
    """What the published ``max_memory_reserved`` holds beyond the planner's allocated peak,
    as a fraction of the activations: ``(published - state) / activations - 1``.

    Why a fraction of the activations: PyTorch's caching allocator keeps freed blocks
    reserved for reuse, and a block serves a later request only if it is large enough, so the
    tensors a step allocates and frees in changing sizes (activations, the loss's logits) leave
    reserved memory no later request fills, while the model state, allocated once, leaves
    none. One published cell gives the fraction; the others test it (torchtitan's 128-host
    cell, whose state is a sixth of this one's, and the Seq1F1B paper's four memory cells)."""
    assert cell.memory_gib is not None
    state, activations = memory_parts(cell)
    return (cell.memory_gib - state) / activations - 1


def _observations(cells: Sequence[TitanCell]) -> list[Observation]:
    def predictor(cell: TitanCell):
        return lambda prof: tokens_per_second(prof, cell)

    return [Observation(c.label, predictor(c), c.tps) for c in cells]


def _scaled(base: Efficiency, scale: float, collectives: float) -> Efficiency:
    return replace(
        base, linear=base.linear * scale, attention=base.attention * scale,
        collectives=collectives,
    )  # fmt: skip


def fit_h100(prof: GpuProfile, cells: Sequence[TitanCell] = FIT, *, rounds: int = 10) -> Efficiency:
    """Two numbers fitted to ``cells`` (squared relative errors of tokens/s): the scale by
    which this GPU reaches the A100's fitted kernel fractions of its own peak (matmuls and
    attention alike: two cells of one sequence length cannot tell them apart), and the
    fraction of the links' peak its collectives reach. The per-action overhead and the
    pipeline sends' fraction stay the A100's: no published H100 cell has a pipeline."""
    observations = _observations(cells)

    def loss(v: list[float]) -> float:
        trial = prof.with_efficiency(_scaled(A100_FIT, v[0], v[1]))
        return math.fsum(e * e for e in relative_errors(trial, observations))

    bounds = [(0.02, 1.0 / A100_FIT.linear), (0.02, 1.0)]  # no fraction above the peak
    x = pattern_search(loss, [0.5, 0.5], bounds, (0, 1), rounds=rounds, tolerance=1e-14)
    names = ", ".join(c.label for c in cells)
    return _scaled(
        replace(A100_FIT, source=f"fitted on torchtitan's H100 cells {names}"), x[0], x[1]
    )


def titan_rows(prof: GpuProfile) -> list[dict[str, Any]]:
    """Every cell predicted on ``prof``: tokens/s, memory as allocated and as reserved (with
    :func:`allocator_slack`), with errors, and whether the profile was fitted on it."""
    rows = []
    slack = allocator_slack()
    for cell in CELLS:
        tps = tokens_per_second(prof, cell)
        state, act = memory_parts(cell)
        mem, reserved = state + act, state + act * (1 + slack)
        rows.append({
            "cell": cell.label, "published_tps": cell.tps, "predicted_tps": tps,
            "tps_error": tps / cell.tps - 1, "fitted": cell in FIT,
            "compiled": cell.compiled, "published_gib": cell.memory_gib, "predicted_gib": mem,
            "gib_error": None if cell.memory_gib is None else mem / cell.memory_gib - 1,
            "reserved_gib": reserved,
            "reserved_error": None if cell.memory_gib is None else reserved / cell.memory_gib - 1,
            "slack_fitted": cell is SLACK_CELL, "source": cell.source,
        })  # fmt: skip
    return rows
