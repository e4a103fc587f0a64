"""``--seq1f1b.dry_run``: one training step of each distinct pipeline rank of a torchtitan 0.3
configuration, at its real size and world size, in one CPU process.

The real trainer is built (:class:`DryRunTrainer`: the model on meta then fake tensors, its
FSDP / TP / CP / EP DTensors over the fake process group, the schedule and the chunk-aware
attention), then :func:`seq1f1b.planning.dryrun.dry_run_rank` runs one steady-state step and
the optimizer under torch's MemTracker and the per-op device-time estimate. Ranks that differ
only in their data, tensor, context or expert coordinate hold the same memory, so one rank of
each pipeline coordinate runs (global rank ``p * world / pp``: torchtitan's mesh puts pp first).

What the dry run changes in the trainer, for its step only: no weight initialisation (fake
weights hold no values; torchtitan's truncated normal reads them), static stage metadata
(the fake process group carries no shape inference), one document per row (documents come
from the data's values), and no start-up self-check (it compares values).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import traceback
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from seq1f1b import _runtime as rt
from seq1f1b import packed_documents
from seq1f1b.planning.dryrun import RankReport, RankStep, dry_run_rank, gpu_spec
from seq1f1b.planning.dryrun.tables import format_holders, format_reports, plot_memory
from seq1f1b.registry import lookup

from .. import assets
from ..patches import applied
from . import patches
from .model import default_positions
from .plan_check import planner_lines
from .trainer import Seq1F1BTrainer

__all__ = [
    "DryRunTrainer",
    "dry_run",
    "prepare",
    "rank_report",
    "representative_ranks",
    "step_arguments",
    "world_size_of",
]


class DryRunTrainer(Seq1F1BTrainer):
    """The trainer over the fake process group already initialised: its device mesh is built
    on real tensors (its rank table is read), everything else as in a real run."""

    def init_distributed(self) -> Any:
        from torchtitan.distributed import ParallelDims

        with rt.outside_fake_mode():
            world = torch.distributed.get_world_size()
            dims = ParallelDims.from_config(self.config.parallelism, world)
            dims.build_mesh()
        return dims


def world_size_of(parallelism: Any) -> int:
    """The world a configuration names: ``NGPU`` if set, else the product of its degrees
    (a data-parallel shard degree of -1, "the rest", counts as 1)."""
    if os.environ.get("NGPU"):
        return int(os.environ["NGPU"])
    degrees = (parallelism.pipeline_parallel_degree, parallelism.data_parallel_replicate_degree,
               max(parallelism.data_parallel_shard_degree, 1),
               parallelism.context_parallel_degree, parallelism.tensor_parallel_degree)  # fmt: skip
    return math.prod(max(d, 1) for d in degrees)


def representative_ranks(pp: int, world: int, chosen: str = "") -> list[int]:
    """One global rank per pipeline coordinate (the others only repeat its memory): of every
    coordinate, or of those ``chosen`` names ("0,7"; ``[seq1f1b] dry_run_ranks``)."""
    coords = [int(c) for c in chosen.split(",") if c.strip()] if chosen else list(range(pp))
    if bad := [c for c in coords if not 0 <= c < pp]:
        raise ValueError(
            f"[seq1f1b] dry_run_ranks = {chosen!r} names pipeline ranks {bad}: they run from "
            f"0 to {pp - 1} (pipeline_parallel_degree = {pp})"
        )
    return [c * (world // pp) for c in coords]


def _first_unit_length(schedule: Any, seq_len: int, mb: int) -> int:
    """The positions of the first unit a stage runs: a sample's first segment (ours, cut
    for the step's one document per row), or the whole sample (torch's schedules)."""
    lengths = getattr(schedule, "sample_lengths", None)
    if lengths is None:
        return seq_len
    return int(lengths(seq_len, [_one_document(mb, seq_len)])[0][0])


def _one_document(rows: int, seq_len: int) -> torch.Tensor:
    """Document ids of rows that hold one document each: host data, so real tensors."""
    with rt.outside_fake_mode():
        return torch.zeros(rows, seq_len, dtype=torch.long)


def _static_metadata(trainer: Any, config: Any) -> None:
    """Each local stage's metadata from its first unit: tokens into stage 0, the model's
    hidden states (the compute dtype FSDP casts to) into the others; under CP this rank's
    share of the unit (``1/cp`` of it: one document per row shares equally)."""
    schedule = trainer.pp_schedule
    training = config.training
    mb = config.parallelism.pipeline_parallel_microbatch_size
    cp = max(config.parallelism.context_parallel_degree, 1)
    unit = _first_unit_length(schedule, training.seq_len, mb) // cp
    dtype = getattr(torch, training.mixed_precision_param)
    dim = trainer.model_config.dim
    for stage in rt.schedule_stages(schedule):
        if stage.is_first:  # a view of its sample, as the schedule cuts it
            example = torch.zeros(mb, training.seq_len, dtype=torch.long)[:, :unit]
        else:
            example = torch.zeros(mb, unit, dim, dtype=dtype).requires_grad_()
        with packed_documents(_one_document(mb, unit)):
            out = stage.submod(example, positions=default_positions(example))
        out = out.detach().requires_grad_(out.requires_grad)
        rt.set_static_metadata(stage, (example,), (out,))
        for module in stage.submod.modules():  # resharded: the step gathers them, measured
            if isinstance(module, FSDPModule):
                module.reshard()


def step_arguments(trainer: Any, config: Any) -> dict[str, Any]:
    """``schedule.step``'s arguments for one step of zeros (the values do not exist), as
    torchtitan's ``pp_forward_backward_step`` passes them, one document per row."""
    training = config.training
    mb = config.parallelism.pipeline_parallel_microbatch_size
    m = training.local_batch_size // mb
    tokens = [torch.zeros(mb, training.seq_len, dtype=torch.long) for _ in range(m)]
    first, last = trainer.pp_has_first_stage, trainer.pp_has_last_stage
    return {
        "arg_mbs": [(t,) for t in tokens] if first else None,
        "kwarg_mbs": [{"positions": default_positions(t)} for t in tokens],
        "target_mbs": tokens if last else None,
        "losses": [] if last else None,
        "loss_kwargs": {"global_valid_tokens": torch.tensor(float(m * mb * training.seq_len))},
        "return_outputs": False,
        "document_ids": [_one_document(mb, training.seq_len) for _ in range(m)],
    }


def _build(config: Any) -> Any:
    def build(rank: int) -> RankStep:
        os.environ.update(RANK=str(rank), LOCAL_RANK="0")
        with applied(patches.DRY_RUN):
            trainer = DryRunTrainer(config)
        _static_metadata(trainer, config)
        stages = rt.schedule_stages(trainer.pp_schedule)
        return RankStep(trainer.pp_schedule, stages, list(trainer.model_parts),
                        trainer.optimizers, kwargs=step_arguments(trainer, config),
                        seq_len=config.training.seq_len)  # fmt: skip

    return build


def prepare(config: Any) -> None:
    """What a dry run changes in a configuration: no start-up self-check (it compares values),
    a fixed seed (else rank 0 broadcasts its own), the offline tokenizer where the named one
    is absent (no data is read), eager blocks (fake tensors do not run compiled graphs), and
    nothing written: no checkpointer (its state dict reads the fake weights' storage) and no
    metrics files."""
    config.seq1f1b.verify = False
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    config.metrics.enable_wandb = False
    if config.debug.seed is None:
        config.debug.seed = 0
    if not (Path(config.hf_assets_path or "") / "tokenizer.json").exists():
        config.hf_assets_path = str(assets.ensure_assets() / "tokenizer")
    if config.compile.enable:
        from torchtitan.tools.logging import logger

        logger.info("Seq1F1B dry run: [compile] enable = true is measured eagerly (an upper "
                    "bound: compiled blocks fuse elementwise temporaries)")  # fmt: skip
        config.compile.enable = False


def rank_report(argv: Sequence[str], rank: int) -> RankReport:
    """One rank's dry run of the configuration ``argv`` names (a fresh process's work: each
    rank builds its own trainer, meshes and patches)."""
    from torchtitan.tools.logging import init_logger

    from .train import parse

    init_logger()
    config = parse(list(argv))
    prepare(config)
    world = world_size_of(config.parallelism)
    os.environ["WORLD_SIZE"] = str(world)
    return dry_run_rank(_build(config), rank, world, gpu_spec(config.seq1f1b.dry_run_gpu),
                        holders=config.seq1f1b.dry_run_holders > 0)  # fmt: skip


def _rank_report_or_trace(argv: Sequence[str], rank: int) -> RankReport | str:
    """:func:`rank_report`, or its traceback as text (what a process pool can send back)."""
    try:
        return rank_report(argv, rank)
    except Exception:
        return traceback.format_exc()


#: tries per rank: a rank's process that dies (a signal sends no traceback) is run again,
#: saying so. Torch 2.15's fake tensors corrupted the heap in 4 builds of 6 of a two-stage
#: rank until the swapped-out parameters were kept (``seq1f1b._runtime.swapped_out_kept``)
DRY_RUN_ATTEMPTS = 3


def _run_rank(argv: list[str], rank: int) -> RankReport:
    """One rank's report from a fresh process, run again (saying so) when it dies or fails:
    its last failure is raised after :data:`DRY_RUN_ATTEMPTS` tries."""
    context = multiprocessing.get_context("spawn")
    for attempt in range(1, DRY_RUN_ATTEMPTS + 1):
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            try:
                report = pool.submit(_rank_report_or_trace, argv, rank).result()
            except BrokenProcessPool as err:  # killed by a signal: no traceback to send
                report = f"its process died ({err})"
        if not isinstance(report, str):
            return report
        failure = f"the dry run of rank {rank} failed (try {attempt} of {DRY_RUN_ATTEMPTS}):"
        print(f"{failure}\n{report}", flush=True)
    raise RuntimeError(f"{failure}\n{report}")


def dry_run(argv: Sequence[str], ranks: Sequence[int] | None = None) -> list[RankReport]:
    """Dry-run the configuration ``argv`` names (the train entry's command line) on each of
    ``ranks`` (default: one per pipeline coordinate), each in a fresh process, and print the
    per-rank table (and the picture ``[seq1f1b] dry_run_picture`` names)."""
    from .train import parse

    config = parse(list(argv))
    par = config.parallelism
    world = world_size_of(par)
    chosen = list(ranks) if ranks is not None else representative_ranks(
        max(par.pipeline_parallel_degree, 1), world, config.seq1f1b.dry_run_ranks)  # fmt: skip
    reports = [_run_rank(list(argv), rank) for rank in chosen]
    entry = lookup(par.pipeline_parallel_schedule)
    k = config.seq1f1b.seq_chunks if entry.seq_chunked else 1
    print(format_reports(reports, f"dry run: {config.model_spec.name} "
                         f"{config.model_spec.flavor}, {config.training.seq_len} tokens, world "
                         f"{world}, pp {par.pipeline_parallel_degree} tp "
                         f"{par.tensor_parallel_degree} cp {par.context_parallel_degree}, "
                         f"{entry.name} K {k}"), flush=True)  # fmt: skip
    pp = max(par.pipeline_parallel_degree, 1)
    peaks = {r.rank // (world // pp): r.peak.total for r in reports}
    print("\n".join(planner_lines(config, world, peaks)), flush=True)
    for report in reports if config.seq1f1b.dry_run_holders > 0 else ():
        print(format_holders(report, config.seq1f1b.dry_run_holders), flush=True)
    if config.seq1f1b.dry_run_picture:
        print("picture:", plot_memory({entry.name: reports}, config.seq1f1b.dry_run_picture))
    return reports
