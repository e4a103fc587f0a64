"""The planner's price of a torchtitan 0.3 configuration, per pipeline rank, to print beside
its dry run (``--seq1f1b.dry_run``).

Why: the planner's memory formulas were checked against the dry run on the direct API's Llama
(``benchmarks/dry_run/planner_check.py``); a torchtitan configuration is every other family
(MoE, MLA, the hybrid, sinks), FSDP, CP and torchtitan's own trainer. Pricing the same setting
the dry run runs puts the two side by side for whatever a user dry-runs.

The setting is read from the configuration as the trainer runs it: the degrees, the schedule
and its stages per rank, K and the split, the AC mode, the latent K/V cache. It is priced by
:func:`seq1f1b.planning.search.search` restricted to that one setting, for torchtitan 0.3's
trainer with the saved-tensor profile of the dry run's own kernels (``torch-eager-cpu``, eager
ops under fake CPU tensors), on the dry run's GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from seq1f1b.planning.plan_types import Candidate
from seq1f1b.planning.profiles import profile
from seq1f1b.planning.saved import TORCH_EAGER_CPU
from seq1f1b.planning.search import search
from seq1f1b.registry import lookup

from ..pipeline import stages_per_rank
from ..planner import TORCHTITAN_03
from .models import family_of

__all__ = ["planned", "planner_lines"]


def _ac_mode(policy: Any) -> str | None:
    """The planner's AC mode of 0.3's ``activation_checkpoint`` policy config (None: another
    policy, e.g. a memory budget)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if policy is None:
        return "none"
    if isinstance(policy, SelectiveAC.Config):
        return "selective"
    return "full" if isinstance(policy, FullAC.Config) else None


def planned(config: Any, world: int) -> Candidate | str:
    """The planner's candidate for ``config`` on ``world`` GPUs, or why it has none."""
    par = config.parallelism
    if max(getattr(par, "expert_parallel_degree", 1), 1) > 1:
        return "expert parallelism is not priced by the planner"
    if max(par.data_parallel_replicate_degree, 1) > 1:
        return "DP replicate is not priced by the planner"
    family = family_of(config.model_spec, config.seq1f1b.kv_cache)
    shape = family.shape(config.model_spec.model)
    entry = lookup(par.pipeline_parallel_schedule)
    pp, tp = max(par.pipeline_parallel_degree, 1), max(par.tensor_parallel_degree, 1)
    cp = max(par.context_parallel_degree, 1)
    v = stages_per_rank(config, shape.n_layers, pp) if pp > 1 else 1
    k = config.seq1f1b.seq_chunks if entry.seq_chunked else 1
    mode = _ac_mode(config.activation_checkpoint)
    if mode is None:
        return f"{type(config.activation_checkpoint).__qualname__}: not priced"
    chunks = config.seq1f1b.loss_chunks or TORCHTITAN_03.loss_chunks
    trainer = replace(TORCHTITAN_03, saved=TORCH_EAGER_CPU, loss_chunks=chunks)
    gpu = profile(config.seq1f1b.dry_run_gpu)
    split = config.seq1f1b.seq_split if k > 1 else "uniform"
    if split not in ("uniform", "compute"):
        return f"seq_split = {split!r}: the planner prices 'uniform' and 'compute'"
    training = config.training
    batch = training.global_batch_size  # -1: the local batch on every data-parallel rank
    batch = batch if batch > 0 else training.local_batch_size * (world // (pp * tp * cp))
    plan = search(shape, training.seq_len, gpu.hardware(world), batch,
                  pp=[pp], tp=[tp], cp=[cp], chunks=[k],
                  splits=(split,), recompute=(mode == "full",), selective=mode == "selective",
                  min_segment=1, trainer=trainer, schedules=[entry.name],
                  actions=gpu.action_costs())  # fmt: skip
    latent = config.seq1f1b.kv_cache == "latent"
    for cand in plan.candidates:
        s = cand.setting
        if s.stages_per_rank == v and s.latent_kv == latent and s.ac == mode:
            return cand
    why = "; ".join(plan.skipped[:3]) or "no candidate matched"
    return f"the planner priced no such setting ({why})"


def planner_lines(config: Any, world: int, peaks: dict[int, int]) -> list[str]:
    """Lines to print under the dry run's table: each dry-run pipeline rank's peak (``peaks``,
    bytes by pipeline coordinate) beside the planner's, and their ratio."""
    cand = planned(config, world)
    head = f"planner ({TORCHTITAN_03.name} trainer, saved tensors '{TORCH_EAGER_CPU.name}'):"
    if isinstance(cand, str):
        return [f"{head} not priced: {cand}"]
    small = max(peaks.values(), default=0) < 2**31  # a debug model: MiB
    unit, scale = ("MiB", 2.0**20) if small else ("GiB", 2.0**30)
    lines = [head]
    for p, dry in sorted(peaks.items()):
        plan = cand.peak_bytes[p]
        lines.append(f"  pipeline rank {p}: planner {plan / scale:.2f} {unit}, dry run "
                     f"{dry / scale:.2f} {unit}, planner / dry run {plan / dry:.3f}")  # fmt: skip
    return lines
