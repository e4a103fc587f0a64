"""Which pipeline / tensor-parallel / FSDP degrees, seq_chunks K, microbatches M, split and
activation checkpointing to use for a model, a sequence length and a set of GPUs.

    python -m seq1f1b.planning.planner --model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80

Why: K trades bubble and activation memory (both shrink with K) against kernel efficiency, and
it interacts with every other degree: more TP saves memory but pays collectives, more PP adds
bubble that K removes, recomputation buys memory with a third more compute. Each setting is
priced by running its real schedule order through the simulator (:mod:`seq1f1b.planning.simulate`)
with per-unit times and memory from :mod:`seq1f1b.planning.costmodel`, then the settings that fit
are ranked by predicted tokens per second per GPU.

Each setting is priced as its trainer runs it (:class:`Trainer`: what runs in bf16, whether
FSDP wraps at degree 1): bf16 needs something that casts, and a trainer that casts only through
FSDP's mixed-precision policy trains PP or TP without FSDP in fp32, with twice the activation
bytes and fp32 matmul throughput. This module's command prices for :data:`BF16` (bf16 weights,
FSDP only at degree > 1); the torchtitan releases' trainers, and the complete TOML of the top
plan, are the integration's (``python -m torchtitan_integration.planner``, same arguments).

The planner in its parts, each importing only those before it:
:mod:`~seq1f1b.planning.plan_types` (Trainer, Setting, Candidate, Filters, Plan, tie groups),
:mod:`~seq1f1b.planning.pricing` (one setting priced: :func:`price`),
:mod:`~seq1f1b.planning.search` (every setting, ranked: :func:`search`),
:mod:`~seq1f1b.planning.reporting` (the table: :func:`format_plan`) and
:mod:`~seq1f1b.planning.cli` (the arguments and the command's flow, which the integration's
command extends). This module names their public parts in one place, and runs the command.
"""

from __future__ import annotations

from .cli import (
    PROG,
    PlannerCommand,
    build_parser,
    collection_paused,
    main,
    problem_from_args,
)
from .plan_types import (
    BF16,
    LOSS_CHUNKS,
    TIE_RULE,
    Candidate,
    Filters,
    Plan,
    Setting,
    Trainer,
    tie_groups,
)
from .pricing import kv_grad_deltas, kv_prefix_deltas, price
from .reporting import _is_baseline, describe, format_plan, print_table
from .search import DEFAULT_CHUNKS, STAGES_PER_RANK, schedule_points, search

__all__ = [
    "BF16",
    "DEFAULT_CHUNKS",
    "LOSS_CHUNKS",
    "PROG",
    "STAGES_PER_RANK",
    "TIE_RULE",
    "Candidate",
    "Filters",
    "Plan",
    "PlannerCommand",
    "Setting",
    "Trainer",
    "_is_baseline",
    "build_parser",
    "collection_paused",
    "describe",
    "format_plan",
    "kv_grad_deltas",
    "kv_prefix_deltas",
    "main",
    "price",
    "print_table",
    "problem_from_args",
    "schedule_points",
    "search",
    "tie_groups",
]

if __name__ == "__main__":
    raise SystemExit(main())
