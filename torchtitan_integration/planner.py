"""The planner's top setting as a complete torchtitan TOML that ``run_train.sh`` runs as is.

    scripts/plan.sh --model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80 \\
        --output llama3_8b_32k.toml          # = .venv/bin/python -m torchtitan_integration.planner

Why here and not in :mod:`seq1f1b.planning.planner`: the search is framework-free; the TOML keys,
flavors and launcher are torchtitan's. The command is the library's
(:class:`~seq1f1b.planning.cli.PlannerCommand`) extended by :class:`TomlCommand`: the planner's
arguments plus where to write and what to train on; prints the ranked table, then the TOML (or
writes it to ``--output``).

The TOML states the precision the plan was priced in (``mixed_precision_param``): with
``--precision torchtitan-0.2`` a plan without FSDP but with PP or TP says ``"float32"``,
which is what torchtitan 0.2.2 runs it in whatever the TOML says (the default,
``torchtitan-0.3``, wraps FSDP at every degree, so bf16 holds there).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from seq1f1b.planning.planner import (
    BF16,
    Candidate,
    Plan,
    PlannerCommand,
    Trainer,
    print_table,
    problem_from_args,
)

__all__ = [
    "FLAVORS",
    "TORCHTITAN_022",
    "TORCHTITAN_03",
    "TRAINERS",
    "TomlCommand",
    "launch_lines",
    "main",
    "render_toml",
]

#: torchtitan 0.3: bf16 everywhere; FSDP with its mixed-precision policy wraps the model at
#: every degree, 1 included; its configs chunk the loss (ChunkedLossWrapper, 8 chunks a
#: sequence); its Llama fuses wq, wk and wv
TORCHTITAN_03 = Trainer(
    "torchtitan-0.3",
    "torchtitan 0.3: bf16 everywhere, FSDP's unsharded copies at every degree",
    fsdp_at_every_degree=True,
    loss_chunks=8,
)
#: torchtitan 0.2.2: ``maybe_enable_amp`` turns autocast off under TP or PP, and ``apply_fsdp``
#: only runs with ``data_parallel_shard_degree > 1`` (or context parallelism): PP or TP without
#: FSDP train in fp32 (the TOML's ``[seq1f1b] loss_chunks = 8`` chunks the loss under K > 1)
TORCHTITAN_022 = Trainer(
    "torchtitan-0.2",
    "torchtitan 0.2.2: bf16 where FSDP shards or nothing is parallel, fp32 with PP or TP alone "
    "(--precision torchtitan-0.3 or bf16 for other trainers)",
    fp32_without_fsdp=True,
    loss_chunks=8,
)
#: the trainers ``--precision`` names, the default first
TRAINERS = (TORCHTITAN_03, TORCHTITAN_022, BF16)

#: preset -> (torchtitan model name, flavor); presets without one get a placeholder flavor.
FLAVORS = {
    "llama3-8b": ("llama3", "8B"),
    "llama3-70b": ("llama3", "70B"),
    "qwen3-8b": ("qwen3", "8B"),
    "qwen3-32b": ("qwen3", "32B"),
    "qwen3-30b-a3b": ("qwen3", "30B-A3B"),
    "deepseek-v3-16b": ("deepseek_v3", "16B"),
    "deepseek-v3-671b": ("deepseek_v3", "671B"),
    "gpt-oss-120b": ("gpt_oss", "120b"),
}
GPUS_PER_NODE = 8
#: ``--hf-assets-path``'s default; a preset without a flavor gets ``./assets/tokenizer``
HF_ASSETS_PATH = "./assets/hf/Llama-3.1-8B"


def launch_lines(gpus: int, gpus_per_node: int = GPUS_PER_NODE) -> list[str]:
    """How to launch ``gpus`` processes with ``run_train.sh``: one command on one node, or the
    multi-node variables on each node (and the Slurm script that sets them).

    Nodes get equal shares: the most GPUs per node, at most ``gpus_per_node``, that divide
    ``gpus`` (12 GPUs on 8-GPU nodes: 2 nodes of 6).
    """
    if gpus < 1 or gpus_per_node < 1:
        raise ValueError(f"gpus={gpus} and gpus_per_node={gpus_per_node} must be >= 1")
    ngpu = max(d for d in range(1, min(gpus, gpus_per_node) + 1) if gpus % d == 0)
    nodes = gpus // ngpu
    if nodes == 1:
        return [f"# Launch: CONFIG_FILE=<this file> NGPU={ngpu} ./run_train.sh"]
    return [
        f"# Launch: {nodes} nodes x {ngpu} GPUs; on every node, the same rendezvous (node 0's "
        "host, a free port):",
        f"#   CONFIG_FILE=<this file> NGPU={ngpu} NNODES={nodes} NODE_RANK=<0..{nodes - 1}> "
        "RDZV_ENDPOINT=<node 0 host>:29500 RDZV_ID=<job id> ./run_train.sh",
        f"# or on Slurm: CONFIG_FILE=<this file> NGPU={ngpu} sbatch --nodes={nodes} "
        f"--gpus-per-node={ngpu} examples/slurm_run_train.sh",
    ]


def _precision_lines(plan: Plan, best: Candidate) -> list[str]:
    """``mixed_precision_param`` as the plan was priced, with why (Trainer.runs_in_bf16)."""
    s = best.setting
    if not s.bf16:
        return [
            'mixed_precision_param = "float32"   # torchtitan 0.2.2 casts to bf16 only through '
            "FSDP (or autocast with nothing parallel): PP/TP without FSDP run in fp32, priced so",
        ]
    line = 'mixed_precision_param = "bfloat16"'
    if s.fsdp == 1 and (s.pp > 1 or s.tp > 1):  # --precision torchtitan-0.3 or bf16
        line += (
            "   # bf16 without FSDP needs torchtitan 0.3 (FSDP at degree 1); "
            "0.2.2 would run this in fp32"
        )
    return [line]


def render_toml(
    plan: Plan,
    best: Candidate,
    preset: str | None,
    *,
    command: str,
    hf_assets_path: str,
    dataset: str,
    steps: int,
    gpus_per_node: int = GPUS_PER_NODE,
) -> str:
    """Every setting the plan assumed, in torchtitan's sections, with comments saying why."""
    s = best.setting
    hw = plan.hardware
    name, flavor = FLAVORS.get(preset or "", ("llama3", "CUSTOM"))
    lines = [
        f"# Written by: {command}",
        f"# Plan: {s.label()}",
        f"#   predicted {best.step_seconds:.2f} s per step, {best.tokens_per_second_per_gpu:.0f} "
        f"tokens/s per GPU; {best.why()}",
        f"#   priced for --precision {plan.trainer.name}",
        *launch_lines(hw.gpus, gpus_per_node),
        "",
        "[job]",
        'dump_folder = "./outputs"',
        f'description = "{preset or "custom model"}, {plan.seq_len} tokens, {s.label()}"',
        'custom_config_module = "torchtitan_integration.config"',
        "",
        "[metrics]",
        "log_freq = 10",
        "enable_tensorboard = true",
        "",
        "[model]",
        f'name = "{name}"',
        f'flavor = "{flavor}"'
        + ("" if preset in FLAVORS else "   # register a flavor with the planned widths"),
        f'hf_assets_path = "{hf_assets_path}"   # tokenizer.json + tokenizer_config.json',
        "",
        "[optimizer]",
        'name = "AdamW"',
        "lr = 3e-4",
        "eps = 1e-8",
        "",
        "[lr_scheduler]",
        "warmup_steps = 200",
        "",
        "[training]",
    ]
    if s.pp > 1:
        lines.append(
            f"local_batch_size = {s.microbatches}   # per data-parallel rank: M microbatches"
        )
    else:
        lines.append("local_batch_size = 1   # one sequence at a time, gradients accumulated")
    lines += [
        f"global_batch_size = {plan.global_batch}",
        f"seq_len = {plan.seq_len}",
        "max_norm = 1.0",
        f"steps = {steps}",
        f'dataset = "{dataset}"',
        *_precision_lines(plan, best),
        "",
        "[parallelism]",
        f"data_parallel_shard_degree = {s.fsdp}",
        f"tensor_parallel_degree = {s.tp}",
        f"pipeline_parallel_degree = {s.pp}",
    ]
    if s.cp > 1:
        lines.append(f"context_parallel_degree = {s.cp}")
    if s.pp > 1:
        lines += [
            f'pipeline_parallel_schedule = "{s.schedule}"',
            "pipeline_parallel_microbatch_size = 1",
            *(
                [
                    "pipeline_parallel_layers_per_stage = "
                    f"{plan.shape.n_layers // (s.entry.model_stages(s.pp, s.stages_per_rank))}"
                    f"   # {s.stages_per_rank} stages per rank"
                ]
                if s.entry is not None and s.stages_per_rank > 1 and s.entry.placement == "looped"
                else []
            ),
            "# the plan prices equal layers per stage, embedding and output on stages of them:",
            "pipeline_parallel_first_stage_less_layers = 0",
            "pipeline_parallel_last_stage_less_layers = 0",
        ]
    if s.seq_chunks > 1:
        lines += [
            "",
            "[seq1f1b]",
            f"seq_chunks = {s.seq_chunks}",
            f'seq_split = "{s.split}"   # lengths {best.segment_lengths}',
            f"loss_chunks = {plan.trainer.loss_chunks}   # head + loss in chunks "
            "(the plan prices it)",
            *(['kv_cache = "latent"   # MLA: earlier segments kept as the latent'] if s.latent_kv
              else []),
        ]  # fmt: skip
    lines += [
        "",
        "[activation_checkpoint]",
        f'mode = "{s.ac}"',
        *(['selective_ac_option = "op"'] if s.selective else []),
        "",
        "[checkpoint]",
        "enable = true",
        "interval = 500",
        "",
        "[compile]",
        "enable = true   # each block compiled, as torchtitan's 8B/70B configs",
        'components = ["model", "loss"]',
        "",
    ]
    return "\n".join(lines)


class TomlCommand(PlannerCommand):
    """The library's command (:class:`~seq1f1b.planning.cli.PlannerCommand`: its arguments,
    checks and search) with what torchtitan adds: the torchtitan trainers, where to write the
    TOML and what to train on, and the TOML after the table."""

    def __init__(self) -> None:
        super().__init__("python -m torchtitan_integration.planner", TRAINERS)

    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        """Where the TOML goes, what it trains on, and the nodes its launch line spans."""
        ap.add_argument("--output", help="write the TOML here (default: print it)")
        ap.add_argument("--hf-assets-path", default=HF_ASSETS_PATH, help="tokenizer directory")
        ap.add_argument("--dataset", default="c4", help="torchtitan dataset name")
        ap.add_argument("--steps", type=int, default=1000)
        ap.add_argument(
            "--gpus-per-node",
            type=int,
            default=GPUS_PER_NODE,
            help="GPUs per node, for the launch command in the TOML",
        )

    def check(self, a: argparse.Namespace) -> str | None:
        """A launch line needs at least one GPU per node."""
        if a.gpus_per_node < 1:
            return f"--gpus-per-node {a.gpus_per_node} must be >= 1"
        return None

    def report(
        self, a: argparse.Namespace, argv: Sequence[str], preset: str | None, plan: Plan
    ) -> int:
        """The table (always: the TOML is this command's output), then the top plan's TOML;
        exit status 1 where no setting fits."""
        print_table(preset, plan, a.top)
        best = plan.best
        if best is None:
            print("\nNo TOML written: no setting fits.", file=sys.stderr)
            return 1
        if preset not in FLAVORS and a.hf_assets_path == HF_ASSETS_PATH:
            a.hf_assets_path = "./assets/tokenizer"
        command = f"{self.prog} " + shlex.join(argv)
        text = render_toml(
            plan,
            best,
            preset,
            command=command,
            hf_assets_path=a.hf_assets_path,
            dataset=a.dataset,
            steps=a.steps,
            gpus_per_node=a.gpus_per_node,
        )
        if a.output:
            Path(a.output).write_text(text)
            print(f"\nTOML written to {a.output}")
        else:
            print("\nTOML:\n" + text)
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command: the library's table for torchtitan's trainers, then the TOML. The search
    is this module's ``problem_from_args``, looked up at each call (a caller may wrap it)."""
    return TomlCommand().run(argv, problem=problem_from_args)


if __name__ == "__main__":
    raise SystemExit(main())
