"""Start-up checks on a 0.3 ``Seq1F1BTrainer.Config``, before torchtitan builds anything."""

from __future__ import annotations

from typing import Any

from ..pipeline import check_config, check_schedule_name


def validate_before_start(config: Any) -> None:
    """Refuse settings that cannot run, naming the config key and the fix, on every rank."""
    from .pipeline import model_shape

    par = config.parallelism
    entry = check_schedule_name(par.pipeline_parallel_schedule)
    if par.pipeline_parallel_degree <= 1:
        return
    if entry.replicas == 2:
        raise ValueError(
            f"pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r} (BitPipe) is not "
            "available with torchtitan 0.3: BitPipe holds every stage twice (a V-shaped and a "
            "looped replica per rank), and 0.3's pipelining_fn contract returns one model part "
            "per stage that its optimizer, checkpointer and gradient clipping each see once. "
            "Use 'Seq1F1B', 'InterleavedSeq1F1B', 'ZBSeq1F1B' or 'ZBVSeq1F1B', or torchtitan "
            "0.2.2 (TORCHTITAN_VERSION=0.2.2 scripts/setup_env.sh)"
        )
    if not entry.seq_chunked:
        return
    shape = model_shape(config.model_spec.model)
    check_config(
        config,
        par.pipeline_parallel_degree,
        shape.n_layers,
        par.tensor_parallel_degree,
        shape,
        par.context_parallel_degree,
    )
