"""The version-free half of the Seq1F1B pipelining functions: settings checks, the split,
stage placement and the schedule (no torchtitan import).

Each version's ``pipeline.py`` follows that torchtitan's ``pipeline_llm`` (same module split,
same per-part ``parallelize_fn``) but places stages the Seq1F1B way (one per rank, or
``stages_per_rank`` looped for the interleaved variant) and hands them here; the schedule is
built from the registry with the ``[seq1f1b]`` section. Every config read here has the same
field names in 0.2.2's JobConfig and 0.3's ``Trainer.Config``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from seq1f1b import (
    ContextParallelConfig,
    ModelShape,
    SequenceSplit,
    resolve_split,
    segment_multiple,
)
from seq1f1b.registry import ScheduleEntry, lookup, schedule_names

logger = logging.getLogger(__name__)


def check_schedule_name(name: str) -> ScheduleEntry:
    """The registry entry of a TOML schedule name; fails at start-up, naming the TOML key."""
    try:
        return lookup(name)
    except ValueError:
        raise ValueError(
            f"[parallelism] pipeline_parallel_schedule = {name!r} is unknown: use one of "
            f"{schedule_names(ours=True)} or torch's {schedule_names(ours=False)}"
        ) from None


def parse_split(split: str) -> str | list[int]:
    s = split.strip()
    if s in ("uniform", "compute"):
        return s
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(
            f"[seq1f1b] seq_split = {split!r} is not understood: use 'uniform', 'compute' or "
            "comma-separated segment lengths such as '1024,768,768,512'"
        ) from None


def stages_per_rank(job_config: Any, n_layers: int, pp: int) -> int:
    entry = check_schedule_name(job_config.parallelism.pipeline_parallel_schedule)
    if entry.max_stages_per_rank == 1:
        return 1
    layers_per_stage = job_config.parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is None and entry.min_stages_per_rank == 1:
        return 1  # e.g. ZBSeq1F1B: one stage per rank unless layers per stage say otherwise
    if layers_per_stage is not None:
        p = job_config.parallelism
        total = n_layers + p.pipeline_parallel_first_stage_less_layers
        total += p.pipeline_parallel_last_stage_less_layers
        n = math.ceil(total / layers_per_stage)
        if n % pp:
            raise ValueError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {layers_per_stage} gives "
                f"{n} stages, not divisible by pipeline_parallel_degree = {pp}: pick a value "
                "that gives a multiple of the PP degree"
            )
        return n // pp
    return job_config.seq1f1b.stages_per_rank


def split_style_schedule(entry: ScheduleEntry, v: int) -> str:
    """The torch schedule name that makes torchtitan's stage split place stages as ``entry``
    does: it only reads the name's style (``ZBVZeroBubble``: V, rank r holds stages r and
    2pp-1-r; ``1F1B``/``Interleaved1F1B``: looped, stage s on rank s % pp)."""
    if entry.placement == "v":
        return "ZBVZeroBubble"
    return "1F1B" if v == 1 else "Interleaved1F1B"


#: below this many tokens a segment's GEMMs are too small to keep a device busy
MIN_SEGMENT_TOKENS = 64
#: a model narrower than this is a debug shape (the debug flavors are 256 wide): each of its
#: GEMMs is launch-bound at any segment length, so short segments cost it nothing to fix
DEBUG_HIDDEN = 1024


def warn_short_segments(lengths: list[int], cfg: Any, shape: ModelShape | None = None) -> None:
    """Segments of a few tokens pass every check yet run many times slower (kernel launches
    and per-unit overhead dominate): say so, as the planner's ``--min-segment`` does. On a
    debug-sized model (``shape.hidden < DEBUG_HIDDEN``: the shipped debug configs) the same
    is logged at info level, saying why: there the segments are short by design."""
    if min(lengths) >= MIN_SEGMENT_TOKENS:
        return
    if shape is not None and shape.hidden < DEBUG_HIDDEN:
        logger.info(
            "[seq1f1b] segments as short as %d tokens (%s): fine for this debug-sized model "
            "(hidden %d < %d, launch-bound at any length); at real sizes keep segments of %d "
            "tokens or more",
            min(lengths),
            lengths,
            shape.hidden,
            DEBUG_HIDDEN,
            MIN_SEGMENT_TOKENS,
        )
        return
    logger.warning(
        "[seq1f1b] seq_chunks = %d gives segments as short as %d tokens (%s): below %d "
        "tokens per segment the per-segment overhead dominates and steps get much slower; "
        "lower seq_chunks",
        cfg.seq_chunks,
        min(lengths),
        lengths,
        MIN_SEGMENT_TOKENS,
    )


def check_world_size(parallelism: Any, world_size: int) -> None:
    """Refuse degrees the world cannot give, before torchtitan's bare ``assert dp_shard >= 1``.

    Works on 0.2.2's and 0.3's ``parallelism`` sections (the same field names).
    """
    p = parallelism
    fixed = {
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
    }
    shard = p.data_parallel_shard_degree
    if shard not in (-1, None):
        fixed["data_parallel_shard_degree"] = shard
    product = math.prod(fixed.values())
    what = " x ".join(f"{k} = {v}" for k, v in fixed.items() if v != 1) or "all degrees 1"
    if shard in (-1, None):
        ok = product <= world_size and world_size % product == 0
        rule = "must divide the world size (data_parallel_shard_degree = -1 takes the rest)"
    else:
        ok = product == world_size
        rule = "must equal the world size"
    if not ok:
        raise ValueError(
            f"[parallelism] {what}: their product {product} {rule}, but {world_size} "
            f"processes were launched: set NGPU (processes per node) x NNODES to {product} "
            "(or a multiple, with data_parallel_shard_degree = -1), or lower the degrees"
        )


def check_loss_chunks(loss_chunks: Any) -> None:
    """``[seq1f1b] loss_chunks``: a whole number >= 0."""
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 0:
        raise ValueError(
            f"[seq1f1b] loss_chunks = {loss_chunks!r} must be an integer >= 0: the chunks each "
            "sequence's output head and loss run in (8 as torchtitan 0.3's ChunkedLossWrapper; "
            "0 = the plain loss)"
        )


def check_config(
    job_config: Any,
    pp: int,
    n_layers: int,
    tp: int,
    shape: ModelShape | None = None,
    cp: int = 1,
    warn: bool = True,
) -> list[int]:
    """Validate the Seq1F1B settings at start-up; returns the segment lengths. ``warn``: log
    what runs but runs slowly (the start-up check does; the build, which checks again, not)."""
    cfg = job_config.seq1f1b
    entry = check_schedule_name(job_config.parallelism.pipeline_parallel_schedule)
    check_loss_chunks(cfg.loss_chunks)
    if isinstance(cfg.seq_chunks, bool) or cfg.seq_chunks < 1:
        raise ValueError(
            f"[seq1f1b] seq_chunks = {cfg.seq_chunks} must be >= 1 (1 = plain 1F1B over samples)"
        )
    v = stages_per_rank(job_config, n_layers, pp)
    try:
        entry.check_stages_per_rank(v)
    except ValueError as exc:
        raise ValueError(
            f"[seq1f1b] stages_per_rank = {v}: {exc}; use pipeline_parallel_schedule = "
            "'Seq1F1B' for one stage per rank"
        ) from None
    if pp * v > n_layers + 2:
        raise ValueError(
            f"{pp * v} pipeline stages (pipeline_parallel_degree = {pp} x {v} per rank) cannot be "
            f"placed on a model with {n_layers} layers: at most n_layers + 2 = {n_layers + 2} "
            "stages (one per layer, plus the embedding and the output head on stages of their "
            "own). Lower [seq1f1b] stages_per_rank or the PP degree"
        )
    seq_len = job_config.training.seq_len
    multiple = segment_multiple(tp, cp)
    try:
        lengths = resolve_split(
            parse_split(cfg.seq_split), seq_len, cfg.seq_chunks, shape=shape, multiple_of=multiple
        )
    except ValueError as exc:
        raise ValueError(
            f"[training] seq_len = {seq_len} cannot be split by [seq1f1b] seq_chunks = "
            f"{cfg.seq_chunks}, seq_split = {cfg.seq_split!r}"
            + (f" with tensor_parallel_degree = {tp}" if tp > 1 else "")
            + (
                f" and context_parallel_degree = {cp} (each segment a multiple of {multiple})"
                if cp > 1
                else ""
            )
            + f": {exc}"
        ) from None
    if warn:
        warn_short_segments(lengths, cfg, shape)
    return lengths


def build_schedule(
    entry: ScheduleEntry,
    stages: list[Any],
    config: Any,
    lengths: list[int],
    loss_fn: Any,
    cp_group: Any,
    shape: ModelShape,
    v: int,
) -> Any:
    """The registry's schedule class built from a torchtitan config (0.2.2's JobConfig or
    0.3's Trainer.Config: both have ``training``, ``parallelism`` and ``seq1f1b``)."""
    par = config.parallelism
    mb_size = par.pipeline_parallel_microbatch_size
    batch = config.training.local_batch_size
    if batch % mb_size:
        raise ValueError(
            f"[training] local_batch_size = {batch} is not divisible by [parallelism] "
            f"pipeline_parallel_microbatch_size = {mb_size}"
        )
    cls = entry.schedule_class()
    seq_len = config.training.seq_len
    if config.seq1f1b.seq_split == "compute":  # re-balanced per step for the batch's documents
        tp = max(par.tensor_parallel_degree, 1)
        split = SequenceSplit("compute", model_shape=shape, multiple_of=tp, seq_len=seq_len)
    else:
        split = SequenceSplit(tuple(lengths), seq_len=seq_len)
    schedule = cls(
        stages,
        batch // mb_size,
        config.seq1f1b.seq_chunks,
        loss_fn,
        seq_split=split,
        # context parallelism: our ring attention shards each segment over the cp mesh;
        # FSDP over the fsdp mesh (dp_shard x cp) sums the gradients, as torchtitan's own CP
        context_parallel=ContextParallelConfig(cp_group, reduce_grads=False),
        scale_grads=False,  # the loss divides by the global token count
        check_attention=config.seq1f1b.first_step_check,
        backward_send_waits=config.seq1f1b.backward_send_waits,
    )
    logger.info(
        "Seq1F1B: pp=%d stages/rank=%d M=%d K=%d cp=%d segments=%s (%s split, model %s)",
        par.pipeline_parallel_degree,
        v,
        batch // mb_size,
        config.seq1f1b.seq_chunks,
        1 if cp_group is None else torch.distributed.get_world_size(cp_group),
        lengths,
        config.seq1f1b.seq_split,
        shape,
    )
    return schedule


def pipelining_result(
    entry: ScheduleEntry,
    stages: list[Any],
    parts: list[nn.Module],
    config: Any,
    lengths: list[int],
    loss_fn: Any,
    parallel_dims: Any,
    shape: ModelShape,
    v: int,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """What a torchtitan ``pipelining_fn`` returns (both versions): the schedule, the model
    parts, whether this rank holds the first / the last stage."""
    cp = parallel_dims.cp
    cp_group = parallel_dims.get_mesh("cp").get_group() if cp > 1 else None
    schedule = build_schedule(entry, stages, config, lengths, loss_fn, cp_group, shape, v)
    if parallel_dims.tp > 1:  # where the strided input gradients come from
        schedule.register_action_context(contiguous_input_grads)
    return (
        schedule,
        parts,
        any(s.is_first for s in stages),
        any(s.is_last for s in stages),
    )


@contextlib.contextmanager
def contiguous_input_grads(stage: Any, action: Any) -> Iterator[None]:
    """After a backward, the gradients a stage sends to the previous one made contiguous:
    under tensor parallelism a split backward's input gradient can be a DTensor whose local
    shard is a strided view (seen with Qwen3 under ZBVSeq1F1B x TP), which gloo and NCCL sends
    reject, and torch's stage sends the local shard of ``bwd_cache[chunk]`` as it is (the
    forward's outputs: each version's pipeline module). Upstream: make the local tensor
    contiguous in ``PipelineStage.get_bwd_send_ops``."""
    yield
    grads = getattr(stage, "bwd_cache", {}).get(action.microbatch_index)
    if grads and any(_strided(g) for g in grads):
        stage.bwd_cache[action.microbatch_index] = tuple(_contiguous(g) for g in grads)


def contiguous_output(_module: nn.Module, _args: Any, output: Any) -> Any:
    """Forward hook: a stage's outputs with contiguous (local) tensors. 0.3's sequence-parallel
    blocks can return strided views, or DTensors whose local shard is one (DeepSeek-V3 under
    TP), which gloo and NCCL point-to-point sends reject, and torch's stage sizes the gradient
    receive buffers from them."""
    if isinstance(output, tuple):
        return tuple(_contiguous(o) for o in output)
    return _contiguous(output)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _strided(g: Any) -> bool:
    return isinstance(g, torch.Tensor) and not _local(g).is_contiguous()


def _contiguous(g: Any) -> Any:
    """``g`` with a contiguous local tensor (a DTensor keeps its mesh, placements and shape)."""
    if not _strided(g):
        return g
    if not hasattr(g, "to_local"):
        return g.contiguous()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        g.to_local().contiguous(), g.device_mesh, g.placements, run_check=False,
        shape=g.shape, stride=g.stride(),
    )  # fmt: skip
