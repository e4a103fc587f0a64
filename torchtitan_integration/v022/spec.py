"""torchtitan 0.2.2: the ``llama3`` train spec with Seq1F1B pipelining, a PP-correct loss
and gloo-safe FSDP.

Registered under torchtitan's own name ``llama3`` (extra specs are looked up before built-in
models), so existing TOML files keep ``[model] name = "llama3"``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from ..common import fsdp_reductions_for_gloo
from ..patches import applied
from . import _titan, patches
from .model import block_causal, make_chunk_aware
from .pipeline import pipeline_seq1f1b
from .validate import validate_before_start


def validated_metrics_processor(
    job_config: Any, parallel_dims: Any, model_args: Any = None, tag: str | None = None
) -> Any:
    """torchtitan's metrics processor, created only once the pipeline settings are valid (so a
    config error leaves no empty TensorBoard run)."""
    from torchtitan.components.metrics import build_metrics_processor

    if model_args is not None:
        validate_before_start(job_config, parallel_dims, model_args)
    return build_metrics_processor(job_config, parallel_dims, model_args, tag)


def build_loss_fn(job_config: Any, **kwargs: Any) -> Any:
    """Token-sum cross entropy, divided by the global token count when the schedule passes it.

    torchtitan 0.2.2 backpropagates the raw token sum under PP and divides only the logged
    loss (its issue 2972), so PP gradients come out ``global_valid_tokens`` times too large.
    Our trainer passes ``global_valid_tokens`` as a loss kwarg, so every pipeline schedule
    backpropagates exactly what the unpipelined trainer does.
    """
    from torchtitan.components.loss import build_cross_entropy_loss

    base = build_cross_entropy_loss(job_config, **kwargs)

    def loss_fn(
        pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: Any = None
    ) -> torch.Tensor:
        loss = base(pred, labels)
        return loss if global_valid_tokens is None else loss / global_valid_tokens

    return loss_fn


def _replicate(model: nn.Module, mesh: Any) -> None:
    """FSDP2-style replicate (what the pipelining runtime knows how to reduce) per block + root."""
    from seq1f1b._runtime import fsdp_replicate

    replicate = fsdp_replicate()

    layers = getattr(model, "layers", None)
    for block in layers.values() if layers is not None else ():
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)


def schedule_shards_cp(parallel_dims: Any, job_config: Any) -> bool:
    """Context parallelism is done by the Seq1F1B schedule's ring attention (PP with one of
    our seq-chunked schedules), not by torch's ``context_parallel``."""
    from seq1f1b.registry import lookup

    if not (parallel_dims.cp_enabled and parallel_dims.pp_enabled):
        return False
    return lookup(job_config.parallelism.pipeline_parallel_schedule).seq_chunked


def parallelize_with_pp_replicate(parallelize_fn: Any) -> Any:
    """Wrap torchtitan's parallelize_fn for two compositions it lacks in 0.2.2.

    * DP replicate with PP/TP: torchtitan only has 1-D DDP ("DDP has not supported > 1D
      parallelism"). We let it apply everything but DP, then apply torch's FSDP2-based
      ``replicate`` on the ``dp_replicate`` mesh, which the pipelining runtime reduces in its
      REDUCE_GRAD action like FSDP.
    * gloo: torchtitan sets a gradient divide factor of 1.0, which FSDP turns into
      ``ReduceOp.PREMUL_SUM`` — not in gloo. Forcing sum reduction gives the same numbers with
      an op gloo has.

    Gradients are summed over data-parallel ranks in both cases: the loss is already divided by
    the global token count, exactly as torchtitan's FSDP path expects.
    """

    def wrapped(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        # flex / varlen flavors train through chunk-aware attention (with PP, the pipelining
        # function converted the model before splitting it; this covers PP = 1)
        make_chunk_aware(model, block_causal(getattr(model, "model_args", None)))
        own_replicate = (
            parallel_dims.dp_replicate_enabled
            and not parallel_dims.fsdp_enabled
            and parallel_dims.world_size != parallel_dims.dp_replicate
        )
        our_cp = schedule_shards_cp(parallel_dims, job_config)
        # patch 6: torchtitan's CP step only checks the attention (the schedule shards);
        # patch 8: its selective AC saves the chunk-aware attention
        scope = patches.SAC_SAVES_ATTENTION + (patches.PARALLELIZE_WITHOUT_CP if our_cp else ())
        with applied(scope):
            if own_replicate:
                without_dp = copy.copy(parallel_dims)
                without_dp.dp_replicate = 1
                model = parallelize_fn(model, without_dp, job_config)
                _replicate(model, parallel_dims.get_mesh("dp_replicate"))
            else:
                model = parallelize_fn(model, parallel_dims, job_config)
        fsdp_reductions_for_gloo(model, sum_only=own_replicate)
        return model

    return wrapped


def register() -> None:
    """Install the spec (idempotent)."""
    from torchtitan.protocols import train_spec as ts

    if "llama3" in _titan.EXTRA_TRAIN_SPECS.get():
        return
    base = ts.get_train_spec("llama3")
    ts.register_train_spec(
        "llama3",
        dataclasses.replace(
            base,
            pipelining_fn=pipeline_seq1f1b,
            parallelize_fn=parallelize_with_pp_replicate(base.parallelize_fn),
            build_loss_fn=build_loss_fn,
            build_metrics_processor_fn=validated_metrics_processor,
        ),
    )
