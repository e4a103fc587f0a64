"""Recurrent state over context parallelism: what passing Gated DeltaNet's state and
convolution tail over the CP ranks adds to a training step.

Why: under CP a segment's positions are spread over the CP ranks, so a recurrent layer's state
must cross them inside every segment, forward and backward. The library does it by a scan
(:mod:`seq1f1b.attention.carried_cp`): each rank computes its runs as affine maps of their
start state (the delta rule with ``dk`` extra value columns, the transition) and two small
collectives per layer and unit pass the maps. This measures that price against the same step
with nothing passed (each rank's runs start from zeros: wrong numbers, every other cost the
same), at the quick preset's shape made a Qwen3.5-style hybrid (three Gated DeltaNet layers,
then attention; dim 128, 2 heads of 64, 4096 tokens), Seq1F1B K=4, M=2, pp=1, cp = 2 and 4.

``python -m benchmarks.cp.recurrent_state [--cp 2 4] [--seq-len 4096] [--rounds 5]
[--out DIR]``. One process per CP rank, one thread each, pinned to core ``rank % cores``; the
variants alternate round by round, a step's time is the slowest rank's, the median is
reported, and beside it the compute: the CPU time of each rank's main thread (not gloo's
threads, not the time a rank waits in a collective), summed over the ranks (median, and the
fastest round's). With more ranks
than cores (cp = 4 on 2 cores), or other load on the machine, the wall times include waiting
for descheduled ranks at every collective; the CPU times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ContextParallelConfig, ScheduleSeq1F1B
from seq1f1b.attention import gated_deltanet
from seq1f1b.attention.carried import CarriedState
from seq1f1b.attention.carried_cp import scan_layout
from seq1f1b.attention.causal_conv import causal_conv1d
from seq1f1b.attention.gated_delta import gated_delta_rule_pieces
from seq1f1b.testing import TinyConfig, build_stages

from ..harness.presets import PRESETS

__all__ = ["measure_recurrent_cp"]

#: the quick preset's model, Qwen3.5's stack: layers 0-2 Gated DeltaNet, layer 3 attention
HYBRID = TinyConfig(**{**PRESETS["quick"].model.__dict__, "full_attention_every": 4})
VARIANTS = ("scan", "no passing")


def _no_passing(
    carry: CarriedState,
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    head_dims: Sequence[int],
    tail: torch.Tensor | None,
    state: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """The baseline layer core: each of this rank's runs from a zero state and tail, nothing
    exchanged (the scan's signature; the numbers are wrong, the other costs the same)."""
    del tail, state
    assert carry.unit is not None
    layout = scan_layout(carry.unit.info)
    b = qkv.shape[0]
    outs, last = [], (None, None)
    for j in layout.mine:
        run = layout.runs[j]
        sl = (slice(None), slice(run.lo, run.lo + run.length))
        pieces = layout.pieces(j, b, carry.unit.info.documents)
        mixed, new_tail = causal_conv1d(qkv[sl], conv_weight, None, pieces)
        q, k, v = gated_deltanet._split_heads(mixed, head_dims)
        out, final = gated_delta_rule_pieces(
            q, k, v, g[sl], beta[sl], None, pieces, backend=backend
        )
        outs.append(out)
        last = (new_tail, final)
    return carry.keep(torch.cat(outs, 1), *last)


def _rank(rank: int, cp: int, store: str, out: str, seq_len: int, rounds: int) -> None:
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (1, cp), mesh_dim_names=("pp", "cp"))
    torch.manual_seed(0)
    mods = build_stages(HYBRID, 1)
    stage = PipelineStage(mods[0], 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    group = mesh["cp"].get_group()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    sched = ScheduleSeq1F1B([stage], 2, 4, loss_fn, context_parallel=ContextParallelConfig(group))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, HYBRID.vocab, (2, seq_len + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    scan = gated_deltanet._core_cp
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds + 1):  # round 0: the warm-up of each variant
        for variant in VARIANTS:
            gated_deltanet._core_cp = scan if variant == "scan" else _no_passing
            mods[0].zero_grad(set_to_none=True)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            sched.step(x, target=y)
            span = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            work = torch.tensor([time.thread_time() - start_cpu], dtype=torch.float64)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            dist.all_reduce(work)
            if r:
                times[variant].append(span.item())
                cpu[variant].append(work.item())
    gated_deltanet._core_cp = scan
    if rank == 0:
        Path(out).write_text(json.dumps({"wall": times, "cpu": cpu}))
    dist.destroy_process_group()


def measure_recurrent_cp(
    cps: Sequence[int] = (2, 4), seq_len: int = 4096, rounds: int = 5
) -> list[dict[str, Any]]:
    """One row per CP degree: the median step with the scan and with nothing passed, the
    difference, and the difference as a share of the step."""
    rows = []
    for cp in cps:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            mp.spawn(_rank, args=(cp, str(Path(tmp) / "store"), str(out), seq_len, rounds),
                     nprocs=cp)  # fmt: skip
            times = json.loads(out.read_text())
        wall, cpu = times["wall"], times["cpu"]
        scan, base = (statistics.median(wall[v]) for v in VARIANTS)
        scan_cpu, base_cpu = (statistics.median(cpu[v]) for v in VARIANTS)
        rows.append({
            "cp": cp, "seq_len": seq_len, "seq_chunks": 4, "microbatches": 2,
            "step_scan_s": scan, "step_no_passing_s": base, "extra_s": scan - base,
            "extra_share": (scan - base) / scan,
            "cpu_scan_s": scan_cpu, "cpu_no_passing_s": base_cpu,
            "cpu_extra_share": (scan_cpu - base_cpu) / scan_cpu,
            "cpu_extra_share_min": 1 - min(cpu["no passing"]) / min(cpu["scan"]),
            "rounds": rounds, "cores": os.cpu_count(), "load_average": os.getloadavg(),
            "steps_s": wall, "cpu_s": cpu,
        })  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| cp | step, scan (s) | step, nothing passed (s) | extra / step | CPU, scan (s) "
        "| CPU, nothing passed (s) | extra CPU / step's CPU (median; fastest) | load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cp']} | {r['step_scan_s']:.3f} | {r['step_no_passing_s']:.3f} | "
            f"{100 * r['extra_share']:+.1f}% | {r['cpu_scan_s']:.2f} | "
            f"{r['cpu_no_passing_s']:.2f} | {100 * r['cpu_extra_share']:+.1f}%; "
            f"{100 * r['cpu_extra_share_min']:+.1f}% | "
            f"{r['load_average'][0]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    rows = measure_recurrent_cp(a.cp, a.seq_len, a.rounds)
    text = table(rows)
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "recurrent_cp.json").write_text(json.dumps(rows, indent=1))
        (a.out / "recurrent_cp.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
