"""What the last stage keeps for backward per unit: the plain loss vs seq1f1b.ChunkedLoss.

Under Seq1F1B the last stage holds every segment of a sample between its forward and its
backward, so the bytes one unit keeps, times K, is what the loss costs that stage. Counted with
the saved-activation meter (benchmarks/harness/probe.py: storages saved for backward, parameters
excluded), on a head of ``hidden x vocab`` over one segment, at vocabularies of 32k and 128k
(a small hidden size, so it runs on a CPU):

    python -m benchmarks.memory.loss_memory [--hidden 64] [--tokens 1024] [--chunk-tokens 128]

``--budget [quick|full]`` measures what that buys a whole pipeline (pp=2, M=2, gloo ranks):
the longest sequence each schedule fits in 1F1B's activation budget and its step time, with
the plain loss on both sides and with the chunked loss on both sides (chunks of seq_len / 8,
as torchtitan 0.3's ``ChunkedLossWrapper``), each against its own 1F1B in the same run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from seq1f1b import ChunkedLoss

from ..harness.measured import RunSpec
from ..harness.presets import PRESETS
from ..harness.probe import SavedTensorMeter

#: the schedules of the budget comparison (the best of README's pp=2 table, and 1F1B)
BUDGET_SPECS = (
    RunSpec("1F1B"),
    RunSpec("Seq1F1B", 8, "uniform"),
    RunSpec("ZBSeq1F1B", 8, "uniform"),
    RunSpec("ZBVSeq1F1B", 4, "compute"),
)


def unit_bytes(vocab: int, hidden: int, tokens: int, chunk_tokens: int | None) -> tuple[int, int]:
    """(bytes kept after one unit's forward, peak bytes during it) for one segment."""
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    target = torch.randint(0, vocab, (1, tokens))
    meter = SavedTensorMeter(exclude=list(head.parameters()))
    meter.stage = 0
    with meter.active():
        if chunk_tokens is None:
            logits = head(h)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        else:
            loss = ChunkedLoss(head, chunk_tokens=chunk_tokens)(h, target)
    kept, peak = meter.live_total, meter.peak_total
    loss.backward()  # the unit's backward releases what it kept
    return kept, peak


def budget_table(preset_name: str) -> None:
    """Longest sequence in 1F1B's budget and step time vs 1F1B, plain vs chunked loss."""
    from dataclasses import replace

    from ..run import _budget, _measure_pp2

    preset = PRESETS[preset_name]
    seq_len = preset.seq_lens[0]
    chunked = tuple(replace(s, loss_chunk_tokens=seq_len // 8) for s in BUDGET_SPECS)
    both = replace(preset, pp2_specs=BUDGET_SPECS + chunked, budget_specs=BUDGET_SPECS + chunked,
                   timed_steps=min(preset.timed_steps, 3))  # fmt: skip
    runs = _measure_pp2(both, seq_len, with_fits=True)
    main_runs = {r["label"]: r for r in runs if "@" not in r["label"]}
    print(f"preset {preset_name}: pp=2, M=2, {seq_len} tokens; loss chunks of {seq_len // 8}")
    print("| schedule | loss | step time vs its 1F1B | peak per rank vs its 1F1B's budget | "
          "longest sequence in the budget | vs 1F1B |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for specs, base in ((BUDGET_SPECS, "1F1B"), (chunked, "1F1B, chunked loss")):
        result = _budget(replace(both, budget_specs=specs), runs, None, baseline=base)
        rows = {r["label"]: r for r in result["rows"]}
        ref = main_runs[base]
        budget = result["budget_bytes"]
        for spec in specs:
            run, row = main_runs[spec.label], rows[spec.label]
            time = run["step_time_s"] / ref["step_time_s"]
            peaks = " / ".join(f"{b / budget:.2f}" for b in run["peak_activation_rank_bytes"])
            longest = row["longest_seq_len"] / rows[base]["longest_seq_len"]
            loss = "chunked" if spec.loss_chunk_tokens else "plain"
            name = spec.label.replace(", chunked loss", "")
            print(f"| {name} | {loss} | {time:.3f}x | {peaks} | {row['longest_seq_len']} | "
                  f"{longest:.2f}x |")  # fmt: skip
        print(f"| ({base}: budget {budget / 2**20:.1f} MiB) | | | | | |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", choices=tuple(PRESETS), help="the pipeline budget comparison")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of one segment (unit)")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    args = ap.parse_args(argv)
    if args.budget:
        budget_table(args.budget)
        return
    print(f"hidden {args.hidden}, {args.tokens} tokens per unit, chunks of {args.chunk_tokens}")
    print("| vocab | plain loss: kept per unit | ChunkedLoss: kept | ratio | ChunkedLoss peak |")
    print("|---|---|---|---|---|")
    for vocab in args.vocab:
        plain, _ = unit_bytes(vocab, args.hidden, args.tokens, None)
        kept, peak = unit_bytes(vocab, args.hidden, args.tokens, args.chunk_tokens)
        mib = 1 << 20
        print(f"| {vocab} | {plain / mib:.1f} MiB | {kept / mib:.2f} MiB | "
              f"{kept / plain:.4f} | {peak / mib:.1f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
