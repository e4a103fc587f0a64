"""Start-up checks on a 0.3 ``Seq1F1BTrainer.Config``, before torchtitan builds anything;
``seq1f1b.verify`` runs the core's self-check (:mod:`torchtitan_integration.verify`) on 0.3's
Llama3."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..bitpipe import bitpipe_cp_error
from ..pipeline import check_config, check_loss_chunks, check_schedule_name, stages_per_rank
from ..verify import run_start_check
from . import _titan
from .models import ModelFamily, NoBf16Casts, family_of

logger = logging.getLogger(__name__)

#: torchtitan 0.3's FSDP and TP (its full-DTensor ``fully_shard(..., dp_mesh_dims=...)``) need
#: torch 2.15: torch 2.13's fully_shard rejects the plain-tensor parameters 0.3 hands it
SPMD_TORCH = (2, 15)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_for_parallelism(par: Any, world: int | None = None) -> None:
    """Refuse TP / FSDP / CP on a torch older than 0.3 needs, naming both versions and the fix
    (before torchtitan's own error from deep inside ``fully_shard``)."""
    if _torch_release() >= SPMD_TORCH:
        return
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    pp, tp = max(par.pipeline_parallel_degree, 1), max(par.tensor_parallel_degree, 1)
    cp, rep = max(par.context_parallel_degree, 1), max(par.data_parallel_replicate_degree, 1)
    shard = par.data_parallel_shard_degree
    if shard == -1:
        shard = max(world // (pp * tp * cp * rep), 1)
    used = [f"{name} = {deg}" for name, deg in (
        ("tensor_parallel_degree", tp), ("data_parallel_shard_degree", shard),
        ("context_parallel_degree", cp)) if deg > 1]  # fmt: skip
    if used:
        need = ".".join(map(str, SPMD_TORCH))
        raise ValueError(
            f"{', '.join(used)} needs torch >= {need} with torchtitan 0.3 (its FSDP / TP shard "
            f"full-DTensor models), but this environment has torch {torch.__version__}: run "
            f"./run_train.sh from its default environment (torch {need}; bash "
            "scripts/setup_env.sh .venv sets it up), or pip install 'torch>=2.15', or train "
            "with pipeline parallelism alone"
        )


def _check_rope_length(config: Any) -> None:
    """torchtitan's own check (the model's ``update_from_config``), made before any rank
    builds: a ``seq_len`` past the RoPE table the flavor fixes, with the key that lengthens it."""
    rope_len = getattr(config.model_spec.model, "max_seq_len", None)
    seq_len = config.training.seq_len
    if isinstance(rope_len, int) and seq_len > rope_len:
        raise ValueError(
            f"[training] seq_len = {seq_len} exceeds the RoPE table of {config.model_spec.name} "
            f"{config.model_spec.flavor} ({rope_len} positions): set [model] max_seq_len = "
            f"{seq_len} (a longer table of the same frequencies) or a shorter seq_len"
        )


def validate_before_start(config: Any) -> None:
    """Refuse settings that cannot run, naming the config key and the fix, on every rank."""
    par = config.parallelism
    entry = check_schedule_name(par.pipeline_parallel_schedule)
    cp, ep = par.context_parallel_degree, getattr(par, "expert_parallel_degree", 1)
    if ep > 1 and par.spmd_backend == "spmd_types" and not torch.cuda.is_available():
        raise ValueError(
            f"expert_parallel_degree = {ep} with spmd_backend = 'spmd_types' on CPU: "
            "torchtitan's expert-parallel token exchange is then a list all_to_all of unequal "
            "sizes, which gloo does not run (ProcessGroupGloo::alltoall: invalid tensor size), "
            "with or without pipelining. Set --parallelism.spmd_backend partial_dtensor (its "
            "all_to_all_single runs on gloo), or expert_parallel_degree = 1"
        )
    _warn_tensor_parallel(config)
    _check_rope_length(config)
    if par.pipeline_parallel_degree <= 1:
        if cp > 1:
            raise ValueError(
                f"context_parallel_degree = {cp} with pipeline_parallel_degree = "
                f"{par.pipeline_parallel_degree}: the Seq1F1B trainer's context parallelism "
                "is the Seq1F1B schedules' ring attention, so it needs pipeline parallelism. "
                "Set context_parallel_degree = 1 (or pipeline_parallel_degree >= 2 with a "
                "Seq1F1B schedule); stock torchtitan runs CP without PP"
            )
        return
    if entry.replicas == 2:
        check_bitpipe_settings(par, config.training)
        return
    if not entry.seq_chunked:
        return
    # an unknown family is refused here, and a latent K/V cache of a family without one
    model_family = family_of(config.model_spec, config.seq1f1b.kv_cache)
    if cp > 1 and model_family.no_context_parallel:
        raise ValueError(
            f"context_parallel_degree = {cp} with {model_family.name}: not supported yet, "
            f"{model_family.no_context_parallel}. Set context_parallel_degree = 1"
        )
    shape = model_family.shape(config.model_spec.model)
    check_config(
        config,  # (the whole config: check_config also reads [compile])
        par.pipeline_parallel_degree,
        shape.n_layers,
        par.tensor_parallel_degree,
        shape,
        par.context_parallel_degree,
    )
    if config.seq1f1b.verify:
        pp = par.pipeline_parallel_degree
        check_titan03(config, pp * stages_per_rank(config, shape.n_layers, pp), model_family,
                      model_family.check_flavor(config.model_spec.model))  # fmt: skip


def loss_with_chunks(loss: Any, chunks: Any) -> Any:
    """The ``loss`` config with ``seq1f1b.loss_chunks`` applied: 0 keeps it; N > 0 sets the
    ``num_chunks`` of 0.3's ``ChunkedLossWrapper`` (which Seq1F1B runs per segment as
    :class:`seq1f1b.ChunkedLoss`), and is refused for any other loss."""
    check_loss_chunks(chunks)
    if chunks == 0:
        return loss
    from torchtitan.components.loss import ChunkedLossWrapper

    if not isinstance(loss, ChunkedLossWrapper.Config):
        raise ValueError(
            f"seq1f1b.loss_chunks = {chunks} sets the chunks of torchtitan 0.3's "
            f"ChunkedLossWrapper, but this config's loss is {type(loss).__qualname__}: wrap it "
            "(loss=ChunkedLossWrapper.Config(loss_fn=...)) in the config function, or set "
            "loss_chunks = 0"
        )
    return dataclasses.replace(loss, num_chunks=chunks)


def _warn_tensor_parallel(config: Any) -> None:
    """Say on every rank what torchtitan's own tensor parallelism gets wrong in the model's
    family (:attr:`ModelFamily.tensor_parallel_note`), where it is known."""
    par = config.parallelism
    if par.tensor_parallel_degree <= 1 or par.spmd_backend != "spmd_types":
        return
    try:
        note = family_of(config.model_spec).tensor_parallel_note
    except ValueError:  # a family we do not know: refused where it matters, with the list
        return
    if note:
        logger.warning("Seq1F1B: %s with tensor_parallel_degree = %d: %s",
                       config.model_spec.name, par.tensor_parallel_degree, note)  # fmt: skip


def check_bitpipe_settings(par: Any, training: Any) -> None:
    """BitPipe pairs rank r with pp-1-r and gives each of its two replicas half of the
    microbatches: pp and M even, naming the keys; it runs without context parallelism."""
    pp = par.pipeline_parallel_degree
    if getattr(par, "context_parallel_degree", 1) > 1:
        raise bitpipe_cp_error(par.context_parallel_degree)
    if pp % 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {pp}: BitPipe pairs rank r with rank "
            "pp-1-r (the two replicas' copies of the same layers), so it needs an even degree"
        )
    mb = par.pipeline_parallel_microbatch_size
    m = training.local_batch_size // mb if mb > 0 else 0
    if m < 2 or m % 2 or training.local_batch_size % mb:
        raise ValueError(
            f"training.local_batch_size = {training.local_batch_size} with "
            f"parallelism.pipeline_parallel_microbatch_size = {mb} gives {m} microbatches: "
            "BitPipe runs half of them on each replica, so it needs an even number >= 2 "
            f"(a multiple of pp = {pp} gives the published bubble)"
        )


def titan03_debug_model(
    model_family: ModelFamily, flavor: str = "debugmodel"
) -> tuple[Callable[[], nn.Module], int]:
    """The family's debug ``flavor``, chunk-aware the family's way: a builder, its layer
    count."""
    spec = model_family.model_spec(flavor)

    def build() -> nn.Module:
        model = spec.model.build()
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model_family.make_chunk_aware(model)
        return model

    return build, len(spec.model.layers)


def check_titan03(
    config: Any, num_stages: int, model_family: ModelFamily, flavor: str = "debugmodel"
) -> None:
    """The start-up check on the model family's debug ``flavor`` (``Decoder``; packed
    documents always), adapted as the run adapts its model."""
    build, n_layers = titan03_debug_model(model_family, flavor)
    names = _titan.FQNS_PER_PART.get()(min(num_stages, n_layers), n_layers)
    with NoBf16Casts():  # the check's bound is fp32's (models/base.py)
        run_start_check(build, names, config.seq1f1b.seq_chunks, True, positions_kwarg=True,
                        model_name=model_family.name)  # fmt: skip
