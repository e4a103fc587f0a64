"""The planner's command line: its arguments (:func:`build_parser`), the search they describe
(:func:`problem_from_args`) and the command's flow (:class:`PlannerCommand`), which a
framework's command extends with its own arguments and report
(``python -m torchtitan_integration.planner`` adds the TOML).

The top of the planner's parts: it imports the search and the reporting; nothing imports it but
the façade (:mod:`seq1f1b.planning.planner`, whose ``python -m`` runs :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace

from ..registry import REGISTRY, lookup
from ..schedules.partition import ModelShape
from .calibration import load_action_costs, load_calibration
from .costmodel import PRESETS, ActionCosts, Hardware
from .fitting import cpu_profile, held_out_errors, largest_error
from .plan_types import BF16, Plan, Trainer
from .profiles import (
    CPU_NOMINAL_TFLOPS,
    PROFILES,
    GpuProfile,
    calibrated_profile,
    machine_spec,
    profile,
)
from .reporting import print_table
from .saved import PROFILES as PROFILES_SAVED
from .search import DEFAULT_CHUNKS, search

__all__ = [
    "PROG",
    "PlannerCommand",
    "build_parser",
    "collection_paused",
    "main",
    "problem_from_args",
]

#: the command's name (the façade's ``python -m`` runs it)
PROG = "python -m seq1f1b.planning.planner"


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored after), for the command line
    only (a library call leaves the process's collector alone): the search
    (:func:`~seq1f1b.planning.search.search`) builds millions of actions, tuples the
    collector tracks (they hold an enum), and a full collection, due every ~10^5 new ones,
    walks every live object of torch's import (two fifths of the paper-7B search's time). The
    search makes no cycles to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_parser(
    prog: str = PROG, trainers: Sequence[Trainer] = (BF16,)
) -> argparse.ArgumentParser:
    """The planner's arguments (shared with ``python -m torchtitan_integration.planner``);
    ``--precision`` names one of ``trainers``, the first by default."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Search pipeline / tensor-parallel / FSDP degrees, seq_chunks K, "
        "microbatches, split and activation checkpointing for a model, sequence length and "
        "GPUs; prints the ranked settings with the reason for each.",
    )
    ap.add_argument("--model", choices=sorted(PRESETS), help="a preset shape (or give the widths)")
    ap.add_argument("--hidden", type=int, help="model width H")
    ap.add_argument("--heads", type=int, help="attention heads")
    ap.add_argument(
        "--kv-heads", type=int, help="KV heads (grouped-query attention; default: heads)"
    )
    ap.add_argument("--layers", type=int, help="transformer blocks")
    ap.add_argument("--vocab", type=int, help="vocabulary size")
    ap.add_argument("--ffn-hidden", type=int, help="FFN width (default 4*hidden)")
    ap.add_argument("--gated-ffn", action="store_true", help="SwiGLU FFN (three matrices)")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in total")
    ap.add_argument(
        "--gpu",
        choices=[*sorted(PROFILES), "cpu"],
        help="GPU profile (seq1f1b/planning/profiles.py): specifications and fitted efficiencies "
        "for the time model, the GPU's memory; replaces --tflops and --tp-gbps. 'cpu': the "
        "machine measured in --calibration FILE (the same as --calibration alone)",
    )
    ap.add_argument(
        "--gpu-memory-gb", type=float, help="memory per GPU (1e9 B); required without --gpu"
    )
    ap.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default 2 x GPUs)"
    )
    ap.add_argument("--pp", help="comma-separated pipeline degrees to consider (default: all)")
    ap.add_argument("--tp", help="comma-separated tensor-parallel degrees (default: all)")
    ap.add_argument(
        "--cp",
        default="1",
        help="comma-separated context-parallel degrees, or 'all' (default: 1, no CP)",
    )
    ap.add_argument(
        "--schedules",
        help="comma-separated registry schedules to consider (default: every one: "
        + ", ".join(e.name for e in REGISTRY)
        + ")",
    )
    ap.add_argument(
        "--calibration",
        help="JSON of measured actions and per-action constants (python -m "
        "benchmarks.planner_models.time_costs) replacing the --tflops time model",
    )
    ap.add_argument(
        "--calibration-model",
        choices=("efficiency", "per-action"),
        default="efficiency",
        help="with --calibration (no GPU profile): 'efficiency' fits the measured machine's "
        "profile (linear and attention efficiencies of a nominal --tflops, overhead per action) "
        "to its measured actions, as the GPU profiles are fitted; 'per-action' prices with the "
        "file's separate forward/backward least-squares constants",
    )
    ap.add_argument(
        "--chunks",
        default=",".join(map(str, DEFAULT_CHUNKS)),
        help="comma-separated seq_chunks K to consider (segments per sequence)",
    )
    ap.add_argument("--split", choices=("compute", "uniform", "both"), default="both")
    ap.add_argument(
        "--ac",
        choices=("none", "selective", "full", "both", "all"),
        default="both",
        help="activation checkpointing to consider: both = none and full; all adds torchtitan's "
        "selective (op-level) AC (not with K > 1 and cp > 1)",
    )
    ap.add_argument(
        "--min-segment",
        type=int,
        default=4096,
        help="shortest average segment (tokens) to consider",
    )
    ap.add_argument(
        "--reserve-gb", type=float, help="memory kept free per GPU (default: the profile's, or 4)"
    )
    ap.add_argument(
        "--tflops",
        type=float,
        help="achieved bf16 TFLOP/s per GPU (assumed-constants time model; default 400)",
    )
    ap.add_argument(
        "--tp-gbps",
        type=float,
        help="achieved TP collective bandwidth, GB/s (assumed-constants time model; default 300)",
    )
    ap.add_argument(
        "--fp32-tflops",
        type=float,
        help="achieved fp32 TFLOP/s per GPU, for settings that run in fp32 (default: --tflops / "
        "15, the bf16-to-fp32 peak ratio of H100 and A100 with TF32 off, torch's default)",
    )
    ap.add_argument(
        "--precision",
        choices=[t.name for t in trainers],
        default=trainers[0].name,
        help="the trainer, for what runs in bf16: "
        + ", ".join(f"'{t.name}' ({t.summary})" for t in trainers),
    )
    ap.add_argument(
        "--saved-tensors",
        choices=sorted(PROFILES_SAVED),
        help="what the trainer's blocks save for the backward where trainers differ "
        "(seq1f1b/planning/saved.py; default: the trainer's own, 'fused' for all shipped): "
        "'torch-eager-cuda' (torch's eager ops with torchtitan's TP plan: the all-gathered "
        "sequence-parallel matmul inputs, the backward's temporaries), 'torch-compiled' "
        "(compiled blocks), 'torch-eager-cpu' (what the dry run sees)",
    )
    ap.add_argument(
        "--p2p",
        choices=("posted", "blocking"),
        default="posted",
        help="pipeline sends and receives: 'posted' (torch.distributed.pipelining posts each "
        "receive ahead of the action that needs it) or 'blocking' (Megatron-LM's batched "
        "send/receive that waits for both neighbours, as the Seq1F1B paper ran; F/B orders only)",
    )
    ap.add_argument("--top", type=int, default=12, help="rows to print")
    ap.add_argument("--json", action="store_true", help="print the ranked settings as JSON")
    return ap


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers (got {text!r})") from None


def _calibrated(a: argparse.Namespace) -> GpuProfile:
    """The measured machine's profile from ``--calibration``: efficiencies fitted to its
    measured actions by the GPU profiles' fit (:func:`~seq1f1b.planning.fitting.cpu_profile`),
    or with ``--calibration-model per-action`` the file's per-kind constants."""
    costs, samples = load_calibration(a.calibration)
    spec = machine_spec(
        a.gpu_memory_gb,
        tflops=CPU_NOMINAL_TFLOPS if a.tflops is None else a.tflops,
        tp_gbps=300.0 if a.tp_gbps is None else a.tp_gbps,
        reserve_gb=4.0 if a.reserve_gb is None else a.reserve_gb,
        source=costs.source,
    )
    if a.calibration_model == "per-action":
        prof = calibrated_profile(costs, spec)
        error, error_source = largest_error(held_out_errors(spec, samples, per_action=True))
        eff = replace(prof.efficiency, error=error, error_source=error_source)
        return prof.with_efficiency(eff)
    if not samples:
        raise ValueError(
            f"{a.calibration} holds no measured actions to fit a profile on: write it again "
            "with python -m benchmarks.planner_models.time_costs, or plan with its per-kind "
            "constants (--calibration-model per-action)"
        )
    return cpu_profile(samples, spec)


def _hardware_from_args(
    a: argparse.Namespace,
) -> tuple[Hardware, ActionCosts | None, tuple[float, str] | None]:
    """The GPUs the arguments describe: a profile's (``--gpu``), or the assumed constants."""
    if a.gpu == "cpu" and not a.calibration:
        raise ValueError("--gpu cpu is the machine a calibration measured: give --calibration")
    if a.gpu in (None, "cpu") and a.calibration:
        if a.gpu_memory_gb is None:
            raise ValueError("--calibration needs --gpu-memory-gb (the measured machine's)")
        prof = _calibrated(a)
        hw = replace(prof.hardware(a.gpus), fp32_tflops=a.fp32_tflops)
        actions = replace(prof.action_costs(), source=f"calibrated ({prof.efficiency.source})")
        return hw, actions, (prof.efficiency.error, prof.efficiency.error_source)
    if a.gpu is None:
        if a.gpu_memory_gb is None:
            raise ValueError("give --gpu (one of " + ", ".join(sorted(PROFILES)) + ") or "
                             "--gpu-memory-gb with the assumed --tflops / --tp-gbps")  # fmt: skip
        reserve = 4.0 if a.reserve_gb is None else a.reserve_gb
        tflops = 400.0 if a.tflops is None else a.tflops
        tp_gbps = 300.0 if a.tp_gbps is None else a.tp_gbps
        return (
            Hardware(a.gpus, a.gpu_memory_gb, reserve, tflops, tp_gbps, a.fp32_tflops),
            None,
            None,
        )
    if a.tflops is not None or a.tp_gbps is not None:
        raise ValueError("--gpu sets the time model: drop --tflops / --tp-gbps, or drop --gpu")
    prof = profile(a.gpu)
    hw = prof.hardware(a.gpus, a.reserve_gb)
    if a.gpu_memory_gb is not None:
        hw = replace(hw, memory_gb=a.gpu_memory_gb)
    if a.fp32_tflops is not None:
        hw = replace(hw, fp32_tflops=a.fp32_tflops)
    eff = prof.efficiency
    return hw, prof.action_costs(), (eff.error, eff.error_source)


def problem_from_args(
    a: argparse.Namespace, trainers: Sequence[Trainer] = (BF16,)
) -> tuple[str | None, Plan]:
    """Run the search the arguments describe (``--precision`` one of ``trainers``); returns
    (preset name or None, plan)."""
    widths = (a.hidden, a.heads, a.layers, a.vocab)
    if a.model:
        if any(w is not None for w in (*widths, a.kv_heads, a.ffn_hidden)):
            raise ValueError("give either --model or the widths (--hidden ...), not both")
        shape = PRESETS[a.model]
    elif None in widths:
        raise ValueError(
            "give --model (one of " + ", ".join(sorted(PRESETS)) + ") or all of --hidden, "
            "--heads, --layers and --vocab"
        )
    else:
        shape = ModelShape(
            a.hidden,
            a.heads,
            a.layers,
            a.vocab,
            ffn_hidden=a.ffn_hidden,
            n_kv_heads=a.kv_heads,
            gated_ffn=a.gated_ffn,
        )
    hw, actions, error = _hardware_from_args(a)
    if a.calibration and a.gpu not in (None, "cpu"):  # a GPU's specifications, measured constants
        costs = load_action_costs(a.calibration)
        actions = replace(costs, source=f"calibrated ({costs.source})")
        error = None
    schedules = [x.strip() for x in a.schedules.split(",") if x.strip()] if a.schedules else None
    for name in schedules or ():
        lookup(name)  # an unknown name fails with the known ones listed
    plan = search(
        shape,
        a.seq_len,
        hw,
        a.global_batch or 2 * a.gpus,
        pp=_ints(a.pp, "--pp"),
        tp=_ints(a.tp, "--tp"),
        cp=None if a.cp == "all" else _ints(a.cp, "--cp"),
        schedules=schedules,
        actions=actions,
        chunks=_ints(a.chunks, "--chunks") or [1],
        splits=("compute", "uniform") if a.split == "both" else (a.split,),
        recompute={"none": (False,), "full": (True,), "selective": ()}.get(a.ac, (False, True)),
        selective=a.ac in ("selective", "all"),
        min_segment=a.min_segment,
        trainer=_trainer_with(a, trainers),
        error=error,
        blocking_p2p=a.p2p == "blocking",
    )
    if not plan.candidates:
        raise ValueError(
            "no setting to price: " + ("; ".join(plan.skipped) or "check --pp/--tp/--chunks")
        )
    return a.model, plan


def _trainer_with(a: argparse.Namespace, trainers: Sequence[Trainer]) -> Trainer:
    """The trainer ``--precision`` names, with the saved tensors ``--saved-tensors`` names."""
    trainer = _trainer_named(a.precision, trainers)
    if a.saved_tensors is not None:
        trainer = replace(trainer, saved=PROFILES_SAVED[a.saved_tensors])
    return trainer


def _trainer_named(name: str, trainers: Sequence[Trainer]) -> Trainer:
    for trainer in trainers:
        if trainer.name == name:
            return trainer
    raise ValueError(f"--precision {name!r}: use one of {', '.join(t.name for t in trainers)}")


#: how the search is asked for: the parsed arguments and the trainers -> (preset, plan)
Problem = Callable[[argparse.Namespace, Sequence[Trainer]], tuple[str | None, Plan]]


class PlannerCommand:
    """The command's flow: parse, check, search, report. A framework's command subclasses it
    for what it adds (:meth:`add_arguments`, :meth:`check`, :meth:`report`) and keeps the rest,
    so that both commands take the same arguments, search alike and fail with the same errors.

    Args:
        prog: the command's name in its usage line.
        trainers: the trainers ``--precision`` names, the default first.
    """

    def __init__(self, prog: str = PROG, trainers: Sequence[Trainer] = (BF16,)) -> None:
        self.prog = prog
        self.trainers = tuple(trainers)

    def parser(self) -> argparse.ArgumentParser:
        """The planner's arguments (:func:`build_parser`) and the command's own."""
        ap = build_parser(self.prog, self.trainers)
        self.add_arguments(ap)
        return ap

    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        """The command's own arguments: none for the planner's."""

    def check(self, a: argparse.Namespace) -> str | None:
        """What is wrong with the command's own arguments before the search (None: nothing)."""
        return None

    def report(
        self, a: argparse.Namespace, argv: Sequence[str], preset: str | None, plan: Plan
    ) -> int:
        """Print the plan and return the exit status: the ranked table, or ``--json``."""
        if a.json:
            best = plan.best
            doc = {
                "recommended": {**asdict(best), "fits": True} if best else None,
                "candidates": [{**asdict(c), "fits": c.fits} for c in plan.candidates[: a.top]],
            }
            print(json.dumps(doc, indent=2))
            return 0
        print_table(preset, plan, a.top)
        return 0

    def run(self, argv: Sequence[str] | None = None, problem: Problem = problem_from_args) -> int:
        """The command on ``argv`` (default: the process's); ``problem``: the search the
        arguments describe, :func:`problem_from_args` unless a caller wraps it. Exit status 2
        for arguments :meth:`check` or the search refuses, else :meth:`report`'s."""
        argv = list(sys.argv[1:] if argv is None else argv)
        a = self.parser().parse_args(argv)
        wrong = self.check(a)
        if wrong is not None:
            print(f"error: {wrong}", file=sys.stderr)
            return 2
        try:
            with collection_paused():
                preset, plan = problem(a, self.trainers)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return self.report(a, argv, preset, plan)


def main(argv: Sequence[str] | None = None, trainers: Sequence[Trainer] = (BF16,)) -> int:
    """The command: the ranked table (or ``--json``) for the trainers ``--precision`` names."""
    return PlannerCommand(trainers=trainers).run(argv)
