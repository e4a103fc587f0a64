"""``python -m benchmarks.dry_run``: the real schedules at a real size without a GPU.

The direct API's Llama-style model (:mod:`seq1f1b.testing`: RMSNorm, RoPE, GQA, SwiGLU,
``ChunkAwareAttention``; the chunked loss on the last stage) at a named shape, its weights,
gradients and AdamW moments in bf16 (no fp32 master copy, no FSDP), with ``--tp`` torch's
tensor parallelism with sequence parallelism as torchtitan applies it to its Llama
(:func:`tensor_parallel`), is dry-run on each chosen pipeline rank: one step under fake
tensors and the fake process group (seq1f1b.planning.dryrun), every schedule named side by
side, so 1F1B against Seq1F1B is one command. Prints each rank's peak memory by kind against
the GPU and the estimated device time; ``--picture`` draws each rank's memory along its order.

    python -m benchmarks.dry_run --shape llama3-8b --seq-len 65536 --pp 4 --microbatches 4 \\
        --seq-chunks 4 --schedules 1F1B,Seq1F1B --ranks 0,3 --picture dry_run.png
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from seq1f1b.planning.dryrun import dry_run_rank
from seq1f1b.planning.dryrun.tables import format_holders, format_reports, plot_memory
from seq1f1b.registry import lookup

from .model_ranks import SHAPES, build_rank, dry_run_isolated


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dry_run",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1, help="tensor (and sequence) parallel degree")
    ap.add_argument("--seq-split", default="uniform", choices=("uniform", "compute"))
    ap.add_argument("--stages-per-rank", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default M)")
    ap.add_argument("--seq-chunks", type=int, default=4)
    ap.add_argument("--loss-chunks", type=int, default=16)
    ap.add_argument("--schedules", default="1F1B,Seq1F1B")
    ap.add_argument("--ranks", default="0", help="comma-separated pipeline ranks, or 'all'")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--picture", default=None, help="PNG of each rank's memory along its order")
    ap.add_argument("--holders", type=int, default=0,
                    help="under each table, this many of the largest groups of tensors alive "
                    "at each rank's peak, named by the op and module that made them")
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    ranks = range(args.pp) if args.ranks == "all" else [int(r) for r in args.ranks.split(",")]
    runs = {}
    for name in args.schedules.split(","):
        build_args = (cfg, name, args.pp, args.stages_per_rank, args.microbatches,
                      args.seq_chunks, args.seq_len, args.batch or args.microbatches,
                      args.loss_chunks, args.tp, args.seq_split)  # fmt: skip
        start = time.perf_counter()
        if args.tp > 1:  # one process per rank (see dry_run_isolated); reported as pp ranks
            reports = dry_run_isolated([(build_args, {}, r * args.tp, args.pp * args.tp,
                                         args.gpu, args.holders > 0) for r in ranks])  # fmt: skip
            for r, report in zip(ranks, reports, strict=True):
                report.rank = r
        else:
            build = build_rank(*build_args)
            reports = [dry_run_rank(build, r, args.pp, args.gpu, args.holders > 0) for r in ranks]
        runs[name] = reports
        k = args.seq_chunks if lookup(name).seq_chunked else 1
        print(format_reports(reports, f"{name}: {args.shape}, {args.seq_len} tokens, pp "
                             f"{args.pp} x v {args.stages_per_rank} x tp {args.tp}, M "
                             f"{args.microbatches}, K {k} (dry run "
                             f"{time.perf_counter() - start:.0f} s)"))  # fmt: skip
        for report in reports if args.holders else ():
            print(format_holders(report, args.holders))
        print()
    if args.picture:
        print("picture:", plot_memory(runs, args.picture))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
