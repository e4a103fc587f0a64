"""What the last stage keeps for backward per unit: the plain loss vs seq1f1b.ChunkedLoss.

Under Seq1F1B the last stage holds every segment of a sample between its forward and its
backward, so the bytes one unit keeps, times K, is what the loss costs that stage. Counted with
the saved-activation meter (benchmarks/probe.py: storages saved for backward, parameters
excluded), on a head of ``hidden x vocab`` over one segment, at vocabularies of 32k and 128k
(a small hidden size, so it runs on a CPU):

    python -m benchmarks.chunked_loss [--hidden 64] [--tokens 1024] [--chunk-tokens 128]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from seq1f1b import ChunkedLoss

from .probe import SavedTensorMeter


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of one segment (unit)")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    args = ap.parse_args(argv)
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
