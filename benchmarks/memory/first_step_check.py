"""What the first-step check costs: its share of the first step, and that step against one
without it.

    python -m benchmarks.memory.first_step_check [--seq-len 2048] [--k 4] [--m 2] [--runs 5]

A Llama-style model (``seq1f1b.testing``, 8 layers of width 256) cut into two stages, both on
this one process (looped placement, as ``verify_model`` runs them), stepped under
``ScheduleSeq1F1B``. Each run builds a fresh schedule (so its first step is a checked one) and
times that first step with ``check_attention`` on and off, alternately, and, inside the checked
step, the check itself (its forwards and comparisons), so its share does not depend on a quiet
machine; medians are printed, and on CUDA the peak allocation of each step. On CPU the memory
is stated, not measured: what the check keeps through the step is sample 0's stage inputs of
two segments and 8 fp32 numbers per output position, and its forward runs after the step's
activations are freed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ScheduleSeq1F1B
from seq1f1b.testing import TinyConfig, build_stages
from seq1f1b.verify import _single_process_group


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def first_step(cfg: TinyConfig, seq_len: int, k: int, m: int, check: bool, device: str) -> tuple:
    """(seconds, the check's seconds, peak bytes or None) of a fresh schedule's first step."""
    torch.manual_seed(0)
    mods = [s.to(device) for s in build_stages(cfg, 2)]
    x = torch.randint(0, cfg.vocab, (m, seq_len), device=device)
    y = torch.randint(0, cfg.vocab, (m, seq_len), device=device)
    with _single_process_group() as group:
        stages = [PipelineStage(s, i, 2, torch.device(device), group=group)
                  for i, s in enumerate(mods)]  # fmt: skip
        schedule = ScheduleSeq1F1B(stages, m, k, _loss, check_attention=check)
        checking = [0.0]
        compare = schedule.unit_actions.compare_outputs

        def timed() -> None:
            start = time.perf_counter()
            compare()
            checking[0] += time.perf_counter() - start

        schedule.unit_actions.compare_outputs = timed  # type: ignore[method-assign]
        if device == "cuda":  # pragma: no cover - GPU only
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        schedule.step(x, target=y)
        if device == "cuda":  # pragma: no cover - GPU only
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        return time.perf_counter() - start, checking[0], peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--m", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = TinyConfig(vocab=4096, dim=256, n_heads=8, n_kv_heads=4, n_layers=8, ffn=768)
    first_step(cfg, 256, 2, 2, True, device)  # warm-up (kernels, allocator)
    times: dict[bool, list[float]] = {True: [], False: []}
    shares: list[float] = []
    peaks: dict[bool, int | None] = {}
    for _ in range(args.runs):
        for check in (False, True):
            seconds, checking, peak = first_step(cfg, args.seq_len, args.k, args.m, check, device)
            times[check].append(seconds)
            peaks[check] = peak
            if check:
                shares.append(checking / seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"first step, {args.m} x {args.seq_len} tokens, K={args.k}, 2 stages, {device}: "
          f"the check is {100 * statistics.median(shares):.1f}% of the checked step; check off "
          f"{off:.3f} s, on {on:.3f} s, ratio {on / off:.3f} (medians of {args.runs})")  # fmt: skip
    if device == "cuda":  # pragma: no cover - GPU only
        mib = {c: (peaks[c] or 0) / 2**20 for c in (False, True)}
        print(f"peak allocated: off {mib[False]:.1f} MiB, on {mib[True]:.1f} MiB")


if __name__ == "__main__":
    main()
