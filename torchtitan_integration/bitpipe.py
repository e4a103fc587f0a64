"""``pipeline_parallel_schedule = "BitPipe"`` in torchtitan: stages, schedule, twin sync, clipping.

BitPipe keeps two copies of every layer chunk (one per replica, on partner ranks r and pp-1-r).
In torchtitan the model is built on the meta device and initialised (or loaded) after the
pipelining function returns, so the twins cannot be made identical at build time: the trainer
copies each chunk from its replica-A copy to its B copy once, before the first step
(:func:`sync_twins`). Gradient clipping must count each chunk once, not twice
(:func:`clip_counting_each_chunk_once`, which each version's patch list puts in place of
torchtitan's ``clip_grad_norm_`` for a BitPipe train step), so that grad_norm and clipping
match an unpipelined run. Each version's ``pipeline.py`` cuts the model its own way and hands
the chunks to :func:`build_bitpipe`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from seq1f1b import ScheduleBitPipe
from seq1f1b.bitpipe.layout import BitPipeLayout, BitPipeStage
from seq1f1b.bitpipe.sync import broadcast_twins, new_pair_group


def bitpipe_cp_error(cp: int) -> ValueError:
    """The refusal of BitPipe with context parallelism (both torchtitan releases): the
    library's CP is part of the sequence schedules' units, which BitPipe does not run."""
    return ValueError(
        f"[parallelism] context_parallel_degree = {cp} with BitPipe: BitPipe pipelines whole "
        "samples and does not shard them over the cp mesh (context parallelism here is the "
        "Seq1F1B schedules' ring attention, run inside their sequence units: each sample cut "
        "over the cp ranks, the ring, the loss weighted over the CP group; BitPipe's two "
        "replicas run each microbatch whole, with no unit to shard): set "
        "context_parallel_degree = 1, or use a Seq1F1B schedule with context parallelism "
        "(ZBVSeq1F1B for a V-shaped placement)"
    )


def check_bitpipe(parallel_dims: Any) -> None:
    """BitPipe's pairing needs an even PP degree, and it runs without context parallelism
    (names the TOML keys)."""
    if getattr(parallel_dims, "cp", 1) > 1:
        raise bitpipe_cp_error(parallel_dims.cp)
    if parallel_dims.pp % 2:
        raise ValueError(
            f"[parallelism] pipeline_parallel_degree = {parallel_dims.pp}: BitPipe pairs rank r "
            "with rank pp-1-r, so the PP degree must be even"
        )


def build_bitpipe(
    model: nn.Module,
    names: list[list[str]],
    *,
    group: Any,
    device: torch.device,
    split: Callable[[nn.Module, list[str]], nn.Module],
    parallelize: Callable[[nn.Module], nn.Module],
    n_microbatches: int,
    loss_fn: Any,
    stage_kwargs: dict[str, Any] | None = None,
    output_hook: Callable[..., Any] | None = None,
) -> tuple[ScheduleBitPipe, list[nn.Module], bool, bool]:
    """What a pipelining_fn returns for BitPipe, on either torchtitan version.

    ``names[c]`` are the module FQNs of layer chunk ``c`` (``2*pp`` chunks), ``split(model,
    fqns)`` makes one chunk (torchtitan's own split where it has one), ``parallelize`` applies
    TP / FSDP / AC / compile to it; ``output_hook`` is a forward hook on every stage but the
    last, registered before the schedule exists (it may infer the stages' shapes). The parts
    come back with the last stage's last (the rank holds at most one): torchtitan hands
    ``model_parts[-1].lm_head`` to a chunked loss.
    """
    pp = dist.get_world_size(group)
    layout = BitPipeLayout(pp)
    rank = dist.get_rank(group)
    stages: list[BitPipeStage] = []
    for g in layout.stages_of(rank):
        part = parallelize(split(model, names[layout.chunk(g)]))
        kwargs = stage_kwargs or {}
        stages.append(BitPipeStage(part, g, layout.num_stages, device, group=group, **kwargs))
        if output_hook is not None and not stages[-1].is_last:
            part.register_forward_hook(output_hook)
    pair_group = new_pair_group(group)
    schedule = ScheduleBitPipe(
        stages, n_microbatches, loss_fn, pair_group=pair_group, scale_grads=False
    )
    parts = [s.submod for s in sorted(stages, key=lambda s: s.is_last)]
    return schedule, parts, any(s.is_first for s in stages), any(s.is_last for s in stages)


def sync_twins(schedule: ScheduleBitPipe) -> None:
    """Make both replicas identical after torchtitan initialised or loaded the weights."""
    assert schedule.pair_group is not None
    broadcast_twins(schedule.local_stages, schedule.layout, schedule.pair_group)


def clip_counting_each_chunk_once(
    clip: Callable[..., torch.Tensor], schedule: ScheduleBitPipe
) -> Callable:
    """torchtitan's clip_grad_norm_ (``clip``), with the norm taken over replica A's chunks.

    Every chunk exists on two ranks with identical (summed) gradients; counting both would
    report and clip at sqrt(2) times the model's gradient norm.
    """
    layout = schedule.layout

    def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *args, **kwargs):
        # replica A's parameters as registered now (FSDP2 registers sharded or unsharded ones)
        a_params = {
            id(p)
            for s in schedule.local_stages
            if layout.replica(s.stage_index) == 0
            for p in s.submod.parameters()
        }
        params = list(parameters)
        norm = clip([p for p in params if id(p) in a_params], float("inf"), *args, **kwargs)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=kwargs.get("foreach"))
        return norm

    return clip_grad_norm_
