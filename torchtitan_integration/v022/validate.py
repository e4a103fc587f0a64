"""Start-up checks on a torchtitan 0.2.2 JobConfig, before torchtitan builds anything.

Uses the model's configured widths (the same shape the build uses), so it refuses exactly the
settings that cannot run; ``[seq1f1b] verify`` runs the core's self-check
(:mod:`torchtitan_integration.verify`) on 0.2.2's Llama3.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from ..bitpipe import check_bitpipe
from ..pipeline import check_config, check_loss_chunks, check_schedule_name, stages_per_rank
from ..verify import run_start_check
from . import _titan
from .model import block_causal, make_chunk_aware
from .pipeline import model_shape

logger = logging.getLogger(__name__)


def check_model_name(name: str) -> None:
    """0.2.2's integration adapts torchtitan's llama3 only (the other decoders: 0.3's)."""
    if name != "llama3":
        raise ValueError(
            f"[model] name = {name!r}: on torchtitan 0.2.2 the Seq1F1B integration trains "
            "llama3; qwen3 runs on torchtitan 0.3 (the default environment, .venv: "
            "./run_train.sh uses it)"
        )


def validate_before_start(job_config: Any, parallel_dims: Any, model_args: Any) -> None:
    """Refuse settings that cannot run, naming the config key and the fix, on every rank."""
    check_model_name(job_config.model.name)
    entry = check_schedule_name(job_config.parallelism.pipeline_parallel_schedule)
    check_loss_chunks(job_config.seq1f1b.loss_chunks)
    if job_config.seq1f1b.kv_cache != "expanded":
        raise ValueError(
            f"[seq1f1b] kv_cache = {job_config.seq1f1b.kv_cache!r}: torchtitan 0.2.2's Llama3 "
            "caches expanded K/V only (the latent cache is DeepSeek-V3's, on torchtitan 0.3): "
            "use 'expanded'"
        )
    if job_config.seq1f1b.loss_chunks and not (parallel_dims.pp_enabled and entry.seq_chunked):
        logger.warning(
            "[seq1f1b] loss_chunks = %d applies under the Seq1F1B schedules only: this run "
            "(%s) computes the plain loss on torchtitan 0.2.2",
            job_config.seq1f1b.loss_chunks,
            job_config.parallelism.pipeline_parallel_schedule
            if parallel_dims.pp_enabled
            else "no pipeline parallelism",
        )
    if not parallel_dims.pp_enabled:
        return
    if block_causal(model_args) and not entry.seq_chunked:
        raise ValueError(
            f"[model] flavor {job_config.model.flavor!r} masks attention by document "
            f"(block_causal), which [parallelism] pipeline_parallel_schedule = "
            f"{job_config.parallelism.pipeline_parallel_schedule!r} cannot pass to its stages "
            "here: use pipeline_parallel_schedule = 'Seq1F1B' (or 'InterleavedSeq1F1B'), or an "
            "sdpa flavor"
        )
    if parallel_dims.cp_enabled and not entry.seq_chunked and not torch.cuda.is_available():
        raise ValueError(
            f"[parallelism] context_parallel_degree = {parallel_dims.cp} with "
            f"pipeline_parallel_schedule = "
            f"{job_config.parallelism.pipeline_parallel_schedule!r}: torch's context_parallel "
            "(which torch's schedules use) has no CPU attention kernels; on CPU, context "
            "parallelism runs with the Seq1F1B schedules' own ring attention: use 'Seq1F1B', "
            "'InterleavedSeq1F1B', 'ZBSeq1F1B' or 'ZBVSeq1F1B'"
        )
    if entry.replicas == 2:
        check_bitpipe(parallel_dims)
    elif entry.seq_chunked:
        shape = model_shape(model_args)
        pd = parallel_dims
        check_config(job_config, pd.pp, model_args.n_layers, pd.tp, shape, pd.cp)
        if job_config.seq1f1b.verify:
            v = stages_per_rank(job_config, model_args.n_layers, pd.pp)
            check_titan022(job_config, pd.pp * v, block_causal(model_args))


def check_titan022(job_config: Any, num_stages: int, documents: bool) -> None:
    """The start-up check on torchtitan 0.2.2's Llama3 (``Transformer``)."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = copy.deepcopy(llama3_args["debugmodel_flex_attn" if documents else "debugmodel"])

    def build() -> nn.Module:
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        make_chunk_aware(model, documents)
        return model

    stages = min(num_stages, args.n_layers)
    names = _titan.FQNS_PER_PART.get()(stages, args.n_layers)
    run_start_check(build, names, job_config.seq1f1b.seq_chunks, documents, positions_kwarg=False)
