"""The direct API's model of the dry-run commands (``python -m benchmarks.dry_run``, and its
``paper``): shapes, this rank's stages and schedule under fake tensors (:func:`build_rank`),
torchtitan's tensor-parallel plan for it (:func:`tensor_parallel`), and a fresh process per
rank (:func:`dry_run_isolated`)."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from seq1f1b import ChunkedLoss
from seq1f1b import _runtime as rt
from seq1f1b.planning.dryrun import RankReport, RankStep, dry_run_rank, static_stage
from seq1f1b.registry import lookup
from seq1f1b.schedules.options import SequenceSplit
from seq1f1b.schedules.partition import ModelShape, resolve_split
from seq1f1b.testing import TinyConfig, TinyStage

__all__ = ["AC_MODES", "SHAPES", "ParallelLoss", "build_rank", "dry_run_isolated", "full_ac",
           "model_shape", "selective_ac", "tensor_parallel"]  # fmt: skip


#: Llama 3's shapes (Meta's model cards), and the paper's 7B as a Llama (REFERENCE.md: 32
#: layers, 4096 wide, 32 heads, the GPT-2 vocabulary padded to 51200; SwiGLU in place of GELU)
SHAPES = {
    "llama3-8b": TinyConfig(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, n_layers=32,
                            ffn=14336, rope_theta=500000.0),
    "llama3-70b": TinyConfig(vocab=128256, dim=8192, n_heads=64, n_kv_heads=8, n_layers=80,
                             ffn=28672, rope_theta=500000.0),
    "paper-7b": TinyConfig(vocab=51200, dim=4096, n_heads=32, n_kv_heads=32, n_layers=32,
                           ffn=11008),
    # the paper's 30B (64 layers, 6144 wide, 64 heads; SwiGLU of 8H/3 in place of GELU's 4H)
    "paper-30b": TinyConfig(vocab=51200, dim=6144, n_heads=64, n_kv_heads=64, n_layers=64,
                            ffn=16384),
}  # fmt: skip


def _stage_modules(cfg: TinyConfig, n_stages: int, mine: Sequence[int],
                   checkpointing: bool = False) -> dict[int, TinyStage]:  # fmt: skip
    per = cfg.n_layers // n_stages
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 (a fake tensor cannot be cast in place)
    try:
        return {s: TinyStage(cfg, s == 0, s == n_stages - 1, per, checkpointing, s * per)
                for s in mine}  # fmt: skip
    finally:
        torch.set_default_dtype(before)


def model_shape(cfg: TinyConfig) -> ModelShape:
    """``cfg`` as the planner's (and the compute split's) shape: a SwiGLU FFN."""
    return ModelShape(cfg.dim, cfg.n_heads, cfg.n_layers, cfg.vocab, ffn_hidden=cfg.ffn,
                      n_kv_heads=cfg.n_kv_heads, gated_ffn=True)  # fmt: skip


def _gathered(norm: torch.nn.Module, mesh: DeviceMesh) -> None:
    """A sequence-parallel norm whose output is all-gathered once for the matmuls after it
    (torchtitan's ``PrepareModuleInput`` on its attention and FFN modules, which this model
    does not have), handed on as a local tensor of the whole sequence."""
    parallelize_module(norm, mesh, SequenceParallel())
    gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                 use_local_output=True)  # fmt: skip
    parallelize_module(norm, mesh, gather)


def tensor_parallel(mod: TinyStage, mesh: DeviceMesh) -> None:
    """torchtitan's tensor- and sequence-parallel plan for its Llama, applied to a stage of
    :class:`~seq1f1b.testing.TinyStage` over the 1-D ``mesh``: the embedding row-wise into
    sequence shards; per block the norms sequence-parallel, the Q/K/V and FFN input
    projections column-wise with local outputs (the chunk-aware attention sees this rank's
    heads), the output projections row-wise back into sequence shards; the final norm's
    output gathered and the head column-wise over the vocabulary (the loss under torch's
    ``loss_parallel``, :class:`ParallelLoss`). Between stages: a local ``(b, s / tp, H)``."""
    if mod.embed is not None:
        parallelize_module(mod.embed, mesh, RowwiseParallel(input_layouts=Replicate(),
                                                            output_layouts=Shard(1)))  # fmt: skip
    for block in mod.layers:
        _gathered(block.norm1, mesh)
        _gathered(block.norm2, mesh)
        parallelize_module(block, mesh, {
            "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "wo": RowwiseParallel(output_layouts=Shard(1)),
            "w1": ColwiseParallel(), "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip
    if mod.norm is not None:
        _gathered(mod.norm, mesh)
        parallelize_module(mod.head, mesh, ColwiseParallel(output_layouts=Shard(-1),
                                                           use_local_output=False))  # fmt: skip


class ParallelLoss:
    """A :class:`~seq1f1b.ChunkedLoss` over a vocabulary-parallel head: each call (its chunks'
    backwards included) under torch's ``loss_parallel``. Takes the unit's weight, as the
    chunked loss does."""

    takes_unit_weight = True

    def __init__(self, inner: ChunkedLoss) -> None:
        self.inner = inner

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor, weight: float = 1.0,
                 **kwargs: Any) -> torch.Tensor:  # fmt: skip
        with loss_parallel():
            return self.inner(hidden, target, weight=weight, **kwargs)


def selective_ac(mod: TinyStage) -> None:
    """torchtitan's op-level selective activation checkpointing (its ``SelectiveAC`` policy:
    every compute-intensive op's and reduce-scatter's output saved, every second matmul and
    everything else recomputed) wrapped around each block of ``mod``, after tensor
    parallelism, as torchtitan applies it. Needs torchtitan installed."""
    try:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC
    except ImportError as e:
        raise RuntimeError("selective activation checkpointing is torchtitan's policy: "
                           "install torchtitan (the venv's titan extra)") from e  # fmt: skip
    SelectiveAC(SelectiveAC.Config()).apply(mod)  # each of ``mod.layers`` wrapped


def full_ac(mod: TinyStage) -> None:
    """Full activation checkpointing as torchtitan applies it: each block of ``mod`` wrapped in
    a ``CheckpointWrapper``, recomputed from its input (zero-bubble orders then run each
    backward whole, ``seq1f1b.schedules.sequence_schedule.unsplittable``)."""
    for i, block in enumerate(mod.layers):
        mod.layers[i] = rt.checkpoint_wrapper(block)


#: activation checkpointing of :func:`build_rank`: none; full (each block recomputed from its
#: input, wrapped as torchtitan's full mode wraps it); torchtitan's selective; or functional
#: (``torch.utils.checkpoint`` called in the stage's forward, as Hugging Face models do: the
#: runtime cannot see it, so zero-bubble orders split the backward)
AC_MODES = ("none", "full", "selective", "functional")


def build_rank(cfg: TinyConfig, name: str, pp: int, v: int, m: int, k: int, seq_len: int,
               batch: int, loss_chunks: int, tp: int = 1, seq_split: str = "uniform", *,
               ac: str = "none",
               return_outputs: bool = False) -> Callable[[int], RankStep]:  # fmt: skip
    """``build(rank)`` for :func:`~seq1f1b.planning.dryrun.dry_run_rank`: this rank's stages
    (looped placement, ``v`` per rank) of ``cfg`` under ``name``, one step of ``batch``.

    With ``tp`` > 1 the world is a ``(pp, tp)`` mesh, ``rank`` a global rank (pipeline rank
    ``rank // tp``) and each stage :func:`tensor_parallel` over its ``tp`` row; segment lengths
    are then multiples of ``tp`` (sequence parallelism shards them). ``seq_split``: the
    Seq1F1B family's ("uniform", or "compute" for equal-FLOPs segments of ``cfg``). ``ac``:
    activation checkpointing per block, one of :data:`AC_MODES`. ``return_outputs``: whether
    the step returns the last stage's outputs (the direct API's default keeps every unit's);
    False, as torchtitan steps and the planner prices."""
    if ac not in AC_MODES:
        raise ValueError(f"ac={ac!r}: use one of {', '.join(AC_MODES)}")
    n_stages = pp * v
    if cfg.n_layers % n_stages:
        raise ValueError(f"{cfg.n_layers} layers do not split into {n_stages} stages")
    entry = lookup(name)
    seq_family = entry.seq_chunked
    split = SequenceSplit(seq_split, model_shape(cfg), multiple_of=tp, seq_len=seq_len)
    # the first unit's length
    unit = resolve_split(seq_split, seq_len, k, shape=model_shape(cfg), multiple_of=tp)[0] \
        if seq_family else seq_len  # fmt: skip

    def build(rank: int) -> RankStep:
        mesh = None
        if tp > 1:
            with rt.outside_fake_mode():  # the mesh's rank table holds values
                mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        pp_rank = rank // tp
        mine = entry.stages_of(pp, pp_rank, v)  # looped, or V (ZBVSeq1F1B)
        mods = _stage_modules(cfg, n_stages, mine, checkpointing=ac == "functional")
        stages: list[PipelineStage] = []
        for s in mine:
            mods[s].skip_head = True  # the chunked loss runs the head
            if mesh is not None:
                tensor_parallel(mods[s], mesh["tp"])
            if ac == "selective":
                selective_ac(mods[s])
            elif ac == "full":
                full_ac(mods[s])
            if s == 0:  # the first unit of a sample: a view of it, as the schedule cuts it
                example = torch.zeros(batch // m, seq_len, dtype=torch.long)[:, :unit]
            else:  # a received activation (this rank's sequence shard): contiguous
                example = torch.zeros(batch // m, unit // tp, cfg.dim, dtype=torch.bfloat16)
            group = mesh["pp"].get_group() if mesh is not None else None
            stages.append(static_stage(mods[s], s, n_stages, example, group=group)[0])
        last = mods.get(n_stages - 1)
        # normalize="none": "mean" counts the targets, a value fake tensors do not hold
        loss: Any = ChunkedLoss(last.head if last is not None else torch.nn.Identity(),
                                num_chunks=loss_chunks, normalize="none")  # fmt: skip
        if mesh is not None:
            loss = ParallelLoss(loss)
        cls = entry.schedule_class()
        if seq_family:
            schedule = cls(stages, m, k, loss, seq_split=split)
        else:  # torch's: a single-stage class takes one stage
            schedule = cls(stages if entry.stages_per_rank > 1 else stages[0], m, loss_fn=loss)
        params = [p for mod in mods.values() for p in mod.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-4)
        tokens = torch.zeros(batch, seq_len, dtype=torch.long)
        return RankStep(schedule, stages, list(mods.values()), opt,
                        (tokens,) if 0 in mine else (),
                        tokens if n_stages - 1 in mine else None,
                        {"return_outputs": return_outputs}, seq_len=seq_len)  # fmt: skip

    return build


def _run_one(build_args: tuple, build_kwargs: dict, rank: int, world: int, gpu: str,
             holders: bool = False) -> RankReport:  # fmt: skip
    try:
        return dry_run_rank(build_rank(*build_args, **build_kwargs), rank, world, gpu, holders)
    except Exception as e:  # torch's exceptions do not all pickle: hand back the traceback
        raise RuntimeError(f"the dry run of rank {rank} failed:\n{traceback.format_exc()}") from e


def dry_run_isolated(jobs: Sequence[tuple],
                     workers: int = 1) -> list[RankReport]:  # fmt: skip
    """Each job ``(build_rank's args, its kwargs, rank, world, gpu[, holders])`` dry-run in a fresh
    process of its own (spawned; ``workers`` at a time), in order. Under tensor parallelism
    a process dry-runs one rank: DTensor's sharding caches keep the first fake world's device
    mesh, whose process groups are gone once the next rank's world is made."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                             max_tasks_per_child=1) as pool:  # fmt: skip
        futures = [pool.submit(_run_one, *job) for job in jobs]
        return [f.result() for f in futures]
