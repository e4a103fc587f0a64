"""``ModelSpec.pipelining_fn`` for torchtitan 0.3.0: Seq1F1B stages and schedules.

0.3 builds its schedule by name through torch's ``get_schedule_class`` (unknown names raise)
and has no schedule registry, so the trainer wraps the model spec's ``pipelining_fn`` with
:func:`pipeline_seq1f1b`, bound to the ``seq1f1b`` config section. Our names build stages the
Seq1F1B way with torchtitan's own split and ``parallelize_fn``; every other name goes to the
spec's original function (``pipeline_llm``). The settings checks, split and schedule
construction are the core's (:mod:`torchtitan_integration.pipeline`), BitPipe's stages and
schedule too (:mod:`torchtitan_integration.bitpipe`). The stage split is torchtitan's private
one, through the seam (:mod:`._titan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from seq1f1b import ChunkedLoss
from seq1f1b.bitpipe.layout import BitPipeLayout

from ..bitpipe import build_bitpipe, check_bitpipe
from ..pipeline import (
    check_config,
    check_schedule_name,
    contiguous_input_grads,
    contiguous_output,
    pipelining_result,
    split_style_schedule,
    stages_per_rank,
)
from . import _titan
from .models import family_of


def with_sections(trainer_config: Any, parallelism: Any = None, training: Any = None) -> Any:
    """0.3's trainer config as 0.3 writes it (the shared core reads its ``parallelism``,
    ``training`` and ``seq1f1b`` sections by their 0.3 names), with the parallelism/training
    sections torchtitan passed in where those are replaced copies (``pipeline_vlm``'s): then
    a copy of the config holding them, checked by 0.3's own ``__post_init__``."""
    parallelism = parallelism or trainer_config.parallelism
    training = training or trainer_config.training
    if parallelism is trainer_config.parallelism and training is trainer_config.training:
        return trainer_config
    return dataclasses.replace(trainer_config, parallelism=parallelism, training=training)


def pipeline_seq1f1b(
    model: nn.Module,
    *,
    trainer_config: Any,
    base_pipelining_fn: Any,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    device: torch.device,
    model_config: Any,
    parallelize_fn: Any,
    loss_fn: Any,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """0.3's pipelining_fn contract, plus the bound ``trainer_config`` and base function."""
    entry = check_schedule_name(parallelism.pipeline_parallel_schedule)
    spmd = {  # what torchtitan hands every parallelize_fn call
        "parallel_dims": parallel_dims,
        "training": training,
        "parallelism": parallelism,
        "compile_config": compile_config,
        "ac_config": ac_config,
        "dump_folder": dump_folder,
    }
    if entry.replicas == 2:
        family_of(trainer_config.model_spec, trainer_config.seq1f1b.kv_cache).make_chunk_aware(
            model
        )
        return _pipeline_bitpipe(
            model, spmd, device, model_config, parallelize_fn, unit_loss(loss_fn, training.seq_len)
        )
    if not entry.seq_chunked:
        return base_pipelining_fn(
            model,
            **spmd,
            device=device,
            model_config=model_config,
            parallelize_fn=parallelize_fn,
            loss_fn=loss_fn,
        )
    config = with_sections(trainer_config, parallelism, training)
    pp, tp, cp = parallel_dims.pp, parallel_dims.tp, parallel_dims.cp
    n_layers = len(model_config.layers)
    model_family = family_of(trainer_config.model_spec)
    shape = model_family.shape(model_config)
    lengths = check_config(config, pp, n_layers, tp, shape, cp, warn=False)
    v = stages_per_rank(config, n_layers, pp)
    names = parallelism.module_fqns_per_model_part or _titan.FQNS_PER_PART.get()(
        pp * v,
        n_layers,
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )
    model_family.make_chunk_aware(model)
    stages, parts = _titan.MODULE_SPLIT.get()(
        model,
        parallel_dims.get_mesh("pp"),
        split_style_schedule(entry, v),
        device,
        names,
        get_mesh=_titan.MESH_CALLBACK.get()(parallel_dims),
    )
    for i, part in enumerate(parts):
        parts[i] = parallelize_fn(part, **spmd)
        stages[i].submod = parts[i]
        if not stages[i].is_last:
            parts[i].register_forward_hook(contiguous_output)

    return pipelining_result(
        entry, stages, parts, config, lengths, unit_loss(loss_fn, training.seq_len),
        parallel_dims, shape, v,
    )  # fmt: skip


def _pipeline_bitpipe(
    model: nn.Module,
    spmd: dict[str, Any],
    device: torch.device,
    model_config: Any,
    parallelize_fn: Any,
    loss_fn: Any,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """BitPipe through 0.3's contract: every model part this rank holds (both replicas'),
    split by torchtitan's own ``_split_module`` from the chunk-aware model, each parallelized
    by 0.3."""
    parallel_dims, parallelism = spmd["parallel_dims"], spmd["parallelism"]
    check_bitpipe(parallel_dims)
    names = parallelism.module_fqns_per_model_part or _titan.FQNS_PER_PART.get()(
        BitPipeLayout(parallel_dims.pp).replica_stages,
        len(model_config.layers),
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )
    training = spmd["training"]
    schedule, parts, has_first, has_last = build_bitpipe(
        model,
        names,
        group=parallel_dims.get_mesh("pp").get_group(),
        device=device,
        split=_titan.SPLIT_MODULE.get(),
        parallelize=lambda part: parallelize_fn(part, **spmd),
        n_microbatches=training.local_batch_size // parallelism.pipeline_parallel_microbatch_size,
        loss_fn=loss_fn,
        stage_kwargs={"get_mesh": _titan.MESH_CALLBACK.get()(parallel_dims)},
        output_hook=contiguous_output,
    )
    if parallel_dims.tp > 1:  # where the strided input gradients come from
        schedule.register_action_context(contiguous_input_grads)
    return schedule, parts, has_first, has_last


def unit_loss(loss_fn: Any, seq_len: int) -> Any:
    """The schedule's per-unit loss from 0.3's: a ``ChunkedLossWrapper`` becomes
    :class:`seq1f1b.ChunkedLoss` over the last stage's ``lm_head`` (which torchtitan sets on
    the wrapper and skips in the model) with the wrapper's chunk length, ``seq_len /
    num_chunks``, so a unit keeps hidden-wide state for backward, never vocabulary-wide; any
    other loss is called as it is (0.3 losses return ``(loss, metrics)``)."""
    from torchtitan.components.loss import ChunkedLossWrapper

    if isinstance(loss_fn, ChunkedLossWrapper):
        from torchtitan.tools.logging import logger

        chunk = -(-seq_len // loss_fn.num_chunks)
        logger.info("Seq1F1B: head + loss per segment in chunks of %d tokens (ChunkedLoss)", chunk)
        return ChunkedLoss(
            lambda: loss_fn.lm_head,
            loss_fn.loss_fn,
            chunk_tokens=chunk,
            normalize="none",  # the inner loss divides by global_valid_tokens itself
        )

    def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss, _ = loss_fn(*args, **kwargs)
        return loss

    return scalar_loss
