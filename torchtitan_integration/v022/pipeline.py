"""torchtitan 0.2.2's ``pipelining_fn`` for the Seq1F1B schedules and BitPipe; every other
schedule name goes to torchtitan's ``pipeline_llm``.

It follows ``pipeline_llm`` (same module split, same per-part ``parallelize_fn``) but places
stages the Seq1F1B way; the settings checks, the split and the schedule are the core's
(:mod:`torchtitan_integration.pipeline`), BitPipe's stages and schedule too
(:mod:`torchtitan_integration.bitpipe`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from seq1f1b import ChunkedLoss, ModelShape
from seq1f1b.bitpipe.layout import BitPipeLayout

from ..bitpipe import build_bitpipe, check_bitpipe
from ..pipeline import (
    check_config,
    check_schedule_name,
    pipelining_result,
    split_style_schedule,
    stages_per_rank,
)
from . import _titan
from .model import block_causal, make_chunk_aware, skip_output_head

logger = logging.getLogger(__name__)


def model_shape(model_args: Any, model: nn.Module | None = None) -> ModelShape:
    """The FLOPs-model shape of a torchtitan Llama3: grouped-query heads, SwiGLU FFN.

    The FFN width is read off the built module, or off a meta-device ``FeedForward`` built
    from the same arguments before the model exists, so torchtitan's rounding rule is its own.
    """
    layers = getattr(model, "layers", None)
    if layers is not None and len(layers):
        ffn = next(iter(layers.values())).feed_forward.w1.out_features
    else:
        from torchtitan.models.llama3.model.model import FeedForward

        with torch.device("meta"):
            ffn = FeedForward(
                model_args.dim,
                4 * model_args.dim,
                model_args.multiple_of,
                model_args.ffn_dim_multiplier,
            ).w1.out_features
    return ModelShape(
        hidden=model_args.dim,
        n_heads=model_args.n_heads,
        n_layers=model_args.n_layers,
        vocab=model_args.vocab_size,
        ffn_hidden=ffn,
        n_kv_heads=getattr(model_args, "n_kv_heads", None) or model_args.n_heads,
        gated_ffn=True,
    )


def chunked_head_loss(
    job_config: Any, stages: list[Any], parts: list[nn.Module], loss_fn: Any
) -> Any:
    """``[seq1f1b] loss_chunks = N``: the last stage's ``output`` head skipped in its forward
    and run by :class:`seq1f1b.ChunkedLoss` in chunks of ``ceil(seq_len / N)`` tokens over each
    segment (the chunk length of 0.3's ``ChunkedLossWrapper`` with ``num_chunks = N``).
    ``loss_fn`` as given otherwise."""
    n = job_config.seq1f1b.loss_chunks
    last = next((part for part, stage in zip(parts, stages, strict=True) if stage.is_last), None)
    if n <= 0 or last is None:
        return loss_fn
    chunk = -(-job_config.training.seq_len // n)
    logger.info(
        "Seq1F1B: output head + loss per segment in chunks of %d tokens (ChunkedLoss)", chunk
    )
    # the loss divides its token sum by global_valid_tokens itself: no normalisation here
    return ChunkedLoss(skip_output_head(last), loss_fn, chunk_tokens=chunk, normalize="none")


def _prune(model: nn.Module, keep: list[str]) -> nn.Module:
    """A copy of ``model`` holding only the modules named in ``keep`` (torchtitan's FQNs)."""
    part = copy.deepcopy(model)
    kept_layers = {n.split(".", 1)[1] for n in keep if n.startswith("layers.")}
    for name, child in list(part.named_children()):
        if name == "layers":
            for key in list(child.keys()):
                if key not in kept_layers:
                    del child[key]
        elif name not in keep:
            setattr(part, name, None)
    return part


def pipeline_bitpipe(
    model: nn.Module,
    parallel_dims: Any,
    job_config: Any,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Any,
    loss_fn: Any,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """BitPipe (two V-shaped replicas over the pp ranks) through 0.2.2's contract."""
    check_bitpipe(parallel_dims)
    par = job_config.parallelism
    names = _titan.FQNS_PER_PART.get()(
        BitPipeLayout(parallel_dims.pp).replica_stages,
        model_args.n_layers,
        par.pipeline_parallel_first_stage_less_layers,
        par.pipeline_parallel_last_stage_less_layers,
    )
    return build_bitpipe(
        model,
        names,
        group=parallel_dims.get_mesh("pp").get_group(),
        device=device,
        split=_prune,
        parallelize=lambda part: parallelize_fn(part, parallel_dims, job_config),
        n_microbatches=job_config.training.local_batch_size
        // par.pipeline_parallel_microbatch_size,
        loss_fn=loss_fn,
    )


def pipeline_seq1f1b(
    model: nn.Module,
    parallel_dims: Any,
    job_config: Any,
    device: torch.device,
    model_args: Any,
    parallelize_fn: Any,
    loss_fn: Any,
) -> tuple[Any, list[nn.Module], bool, bool]:
    """torchtitan pipelining_fn: Seq1F1B for our schedule names, torchtitan's otherwise."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    entry = check_schedule_name(job_config.parallelism.pipeline_parallel_schedule)
    if entry.replicas == 2:
        return pipeline_bitpipe(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn
        )
    if not entry.seq_chunked:
        return pipeline_llm(
            model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn
        )

    pp, tp, cp = parallel_dims.pp, parallel_dims.tp, parallel_dims.cp
    n_layers = model_args.n_layers
    shape = model_shape(model_args, model)
    lengths = check_config(job_config, pp, n_layers, tp, shape, cp, warn=False)
    v = stages_per_rank(job_config, n_layers, pp)
    par = job_config.parallelism
    names = par.module_fqns_per_model_part or _titan.FQNS_PER_PART.get()(
        pp * v,
        n_layers,
        par.pipeline_parallel_first_stage_less_layers,
        par.pipeline_parallel_last_stage_less_layers,
    )
    make_chunk_aware(model, block_causal(model_args))
    stages, parts = _titan.MODULE_SPLIT.get()(
        model, parallel_dims.get_mesh("pp"), split_style_schedule(entry, v), device, names
    )
    for i, part in enumerate(parts):
        parts[i] = parallelize_fn(part, parallel_dims, job_config)
        stages[i].submod = parts[i]
    loss_fn = chunked_head_loss(job_config, stages, parts, loss_fn)
    return pipelining_result(
        entry, stages, parts, job_config, lengths, loss_fn, parallel_dims, shape, v
    )
