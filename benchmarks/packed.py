"""Packed real documents: the three compute splits, simulated at the 8B shape.

The shipped corpus (Python standard library files, ``torchtitan_integration.assets``) is
tokenized with the shipped tokenizer, its documents shuffled and packed end to end into rows
of the sequence length (as torchtitan's text datasets pack: a document that does not fit
continues on the next row, where it counts as a document of its own). For each packing the
pipeline is simulated (FLOPs costs of the real mask, :class:`seq1f1b.simulate.FlopsCosts`)
with the uniform split, the causal compute split (``split="compute"`` without documents) and
the mask-aware split (``split="compute"`` with the step's ``document_ids``,
:func:`seq1f1b.mask_split.mask_balanced_split`). Also: synthetic documents of ~2k tokens and a
long-tailed (log-normal) distribution, and the split's own cost per step at 128k tokens.

    python -m benchmarks.packed [--quick]
    python -m benchmarks.packed --measured quick|full
    python -m benchmarks.packed --snap

``--snap``: what moving each mask-aware cut, within 2% of a segment, to a document boundary
would save (K/V tokens that later segments see across the cut) and cost (simulated step time).
``--measured``: the corpus packed into 4096-token rows, run for real (CPU, gloo, pp=2, M=2,
K=4): the three splits' step times against torch's Schedule1F1B (which cannot take the
documents: it attends causally over the whole row), and the mask-aware / uniform ratio
measured against the simulator's at the measured model's shape.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from seq1f1b.mask_split import MaskSplitCache, attended_keys_per_position, mask_balanced_split
from seq1f1b.order import OrderSpec, build_orders
from seq1f1b.partition import ModelShape, compute_balanced_split, token_cost, uniform_split
from seq1f1b.simulate import FlopsCosts, simulate

__all__ = ["corpus_document_lengths", "pack", "simulate_splits"]

SHAPE_8B = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=128256, ffn_hidden=14336,
                      n_kv_heads=8, gated_ffn=True)  # fmt: skip


def corpus_document_lengths() -> list[int]:
    """Tokens of every document of the shipped corpus (plus its end-of-text token)."""
    from tokenizers import Tokenizer

    from torchtitan_integration import assets

    root = assets.ensure_assets()
    tok = Tokenizer.from_file(str(Path(root) / "tokenizer" / "tokenizer.json"))
    with (Path(root) / "pycode" / "train.jsonl").open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return [len(e.ids) + 1 for e in tok.encode_batch(texts)]


def distribution(lengths: list[int]) -> dict[str, Any]:
    """Documents, tokens, median length, and the length of the document of a typical token
    (the token-weighted median)."""
    ordered = sorted(lengths)
    half, acc, typical = sum(ordered) / 2, 0, ordered[-1]
    for n in ordered:
        acc += n
        if acc >= half:
            typical = n
            break
    return {"documents": len(lengths), "tokens": sum(lengths),
            "median": statistics.median(lengths), "typical_token_document": typical}  # fmt: skip


def pack(lengths: list[int], rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(rows, seq_len) document ids: the documents shuffled and packed end to end."""
    rng = random.Random(seed)
    need = rows * seq_len
    stream: list[int] = []
    while sum(stream) < need:
        batch = list(lengths)
        rng.shuffle(batch)
        stream += batch
    ids = torch.repeat_interleave(torch.arange(len(stream)), torch.tensor(stream))[:need]
    return ids.reshape(rows, seq_len)


def synthetic(kind: str, n: int = 4000, seed: int = 0) -> list[int]:
    """Document lengths: ``"2k"`` (uniform 1k..3k) or ``"long_tail"`` (log-normal, median
    1k, a few of 100k+)."""
    rng = random.Random(seed)
    if kind == "2k":
        return [rng.randint(1024, 3072) for _ in range(n)]
    return [max(16, int(rng.lognormvariate(6.9, 1.6))) for _ in range(n)]


def simulate_splits(
    docs: torch.Tensor, shape: ModelShape, pp: int, microbatches: int, k: int
) -> dict[str, Any]:
    """Step time (FLOPs, simulated) of the three splits under ``docs``' mask."""
    seq_len = docs.shape[-1]
    keys = attended_keys_per_position(docs)
    base, per_key = token_cost(shape)
    flops = tuple((base + per_key * keys).tolist())
    order = build_orders(OrderSpec(pp, 1, microbatches, k))
    splits = {
        "uniform": uniform_split(seq_len, k),
        "causal": compute_balanced_split(seq_len, k, shape),
        "mask_aware": mask_balanced_split(docs, k, shape),
    }
    times = {}
    for name, lengths in splits.items():
        costs = FlopsCosts(shape, tuple(lengths), pp, pp, position_flops=flops)
        times[name] = simulate(order, costs.cost).makespan
    return {
        "pp": pp, "M": microbatches, "K": k, "seq_len": seq_len,
        "lengths": splits,
        "causal_vs_uniform": times["causal"] / times["uniform"],
        "mask_aware_vs_uniform": times["mask_aware"] / times["uniform"],
        "mask_aware_vs_causal": times["mask_aware"] / times["causal"],
    }  # fmt: skip


def cross_cut_tokens(docs: torch.Tensor, cut: int) -> int:
    """K/V tokens before ``cut`` that positions after it can see (one layer, every row): the
    earlier part of the document each row has straddling the cut."""
    if cut <= 0 or cut >= docs.shape[-1]:
        return 0
    total = 0
    for row in docs:
        doc = row[cut]
        if row[cut - 1] != doc:
            continue
        start = int((row[:cut] != doc).nonzero().max()) + 1 if (row[:cut] != doc).any() else 0
        total += cut - start
    return total


def snapped_cuts(docs: torch.Tensor, cuts: list[int], reach: int) -> list[int]:
    """Each cut moved, within ``reach`` tokens, to the position that leaves the fewest
    cross-cut K/V tokens (a document start in as many rows as possible)."""
    starts = sorted({int(p) for row in docs for p in (row[1:] != row[:-1]).nonzero().flatten() + 1})
    out = []
    for cut in cuts:
        near = [p for p in starts if abs(p - cut) <= reach] + [cut]
        out.append(min(near, key=lambda p: (cross_cut_tokens(docs, p), abs(p - cut))))
    return out


def snap_savings(
    docs: torch.Tensor, shape: ModelShape, pp: int, k: int, reach_fraction: float = 0.02
) -> dict[str, Any]:
    """What snapping the mask-aware cuts to document boundaries saves (cross-segment K/V,
    summed over cuts and rows, one layer) and costs (simulated step time), at a reach of
    ``reach_fraction`` of a segment."""
    seq_len = docs.shape[-1]
    lengths = mask_balanced_split(docs, k, shape)
    cuts = [sum(lengths[:j]) for j in range(1, k)]
    snapped = snapped_cuts(docs, cuts, int(reach_fraction * seq_len / k))
    snapped_lengths = [b - a for a, b in zip([0, *snapped], [*snapped, seq_len], strict=True)]
    keys = attended_keys_per_position(docs)
    base, per_key = token_cost(shape)
    flops = tuple((base + per_key * keys).tolist())
    order = build_orders(OrderSpec(pp, 1, docs.shape[0], k))
    times = {}
    for name, ls in (("balanced", lengths), ("snapped", snapped_lengths)):
        costs = FlopsCosts(shape, tuple(ls), pp, pp, position_flops=flops)
        times[name] = simulate(order, costs.cost).makespan
    before = sum(cross_cut_tokens(docs, c) for c in cuts)
    after = sum(cross_cut_tokens(docs, c) for c in snapped)
    return {"seq_len": seq_len, "K": k, "rows": docs.shape[0], "cross_kv_before": before,
            "cross_kv_after": after,
            "time_snapped_vs_balanced": times["snapped"] / times["balanced"]}  # fmt: skip


def split_cost(docs: torch.Tensor, k: int, shape: ModelShape) -> dict[str, float]:
    """Seconds to compute the mask-aware split once (a new layout) and from the cache."""
    cache = MaskSplitCache()
    t0 = time.perf_counter()
    cache.lengths(docs, k, shape)
    t1 = time.perf_counter()
    cache.lengths(docs, k, shape)
    t2 = time.perf_counter()
    return {"new_layout_s": t1 - t0, "cached_s": t2 - t1,
            "documents": int((docs[:, 1:] != docs[:, :-1]).sum()) + docs.shape[0]}  # fmt: skip


def run(quick: bool = False) -> dict[str, Any]:
    corpus = corpus_document_lengths()
    sources = {"corpus": corpus, "synthetic ~2k": synthetic("2k"),
               "long tail": synthetic("long_tail")}  # fmt: skip
    seq_lens = (32768,) if quick else (32768, 131072)
    pps = (4,) if quick else (4, 8)
    out: dict[str, Any] = {"distributions": {n: distribution(v) for n, v in sources.items()}}
    rows = []
    for name, lengths in sources.items():
        for seq_len in seq_lens:
            for pp in pps:
                m = 2 * pp
                docs = pack(lengths, m, seq_len, seed=seq_len + pp)
                for k in (4, 8):
                    rows.append({"documents": name, **simulate_splits(docs, SHAPE_8B, pp, m, k)})
    out["simulated"] = rows
    docs = pack(synthetic("2k"), 8, 131072, seed=1)  # thousands of documents per step
    split_cost(docs[:1, :1024], 4, SHAPE_8B)  # warm up torch
    out["split_cost_128k"] = split_cost(docs, 4, SHAPE_8B)
    return out


def measured(preset_name: str, steps: int = 3) -> None:
    """Measured step times of the three splits on packed rows, vs simulated: the corpus, and
    documents of ~512 tokens (at 4096 tokens the corpus gives a row one to three documents)."""
    from .measured import RunSpec, Setting, measure, model_shape, packed_documents
    from .presets import PRESETS

    preset = PRESETS[preset_name]
    shape = model_shape(preset.model)
    seq_len, m, k = 4096, 2, 4
    layouts = {
        "corpus": pack(corpus_document_lengths(), m, seq_len, seed=7),
        "~512-token documents": packed_documents(m, seq_len, 512),
    }
    causal = ",".join(map(str, compute_balanced_split(seq_len, k, shape)))
    specs: list[RunSpec] = [RunSpec("1F1B")]
    for name, docs in layouts.items():
        rows = tuple(tuple(r) for r in docs.tolist())
        specs += [RunSpec("Seq1F1B", k, split, document_ids=rows, tag=f"{name}, {what}")
                  for split, what in (("uniform", "uniform"), (causal, "causal"),
                                      ("compute", "mask_aware"))]  # fmt: skip
    setting = Setting(2, m, seq_len, preset.model, tuple(specs), steps, keep_trace=False)
    runs = {r["label"]: r for r in measure(setting)}
    base = runs["1F1B"]["step_time_s"]
    print(f"preset {preset_name}: pp=2, M={m}, K={k}, {seq_len} tokens, {steps} timed steps")
    print("| documents | split | lengths | vs 1F1B | vs uniform, measured | "
          "vs uniform, simulated |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, docs in layouts.items():
        sim = simulate_splits(docs, shape, 2, m, k)
        n_docs = int((docs[:, 1:] != docs[:, :-1]).sum()) + m
        uni = runs[f"Seq1F1B K={k} uniform, {name}, uniform"]["step_time_s"]
        for what in ("uniform", "causal", "mask_aware"):
            split = {"uniform": "uniform", "causal": causal, "mask_aware": "compute"}[what]
            t = runs[f"Seq1F1B K={k} {split}, {name}, {what}"]["step_time_s"]
            simulated = 1.0 if what == "uniform" else sim[f"{what}_vs_uniform"]
            print(f"| {name} ({n_docs}) | {what} | {sim['lengths'][what]} | {t / base:.3f}x | "
                  f"{t / uni:.3f} | {simulated:.3f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32k and pp=4 only")
    parser.add_argument("--measured", choices=("smoke", "quick", "full"),
                        help="run the three splits for real at pp=2 instead")  # fmt: skip
    parser.add_argument("--snap", action="store_true",
                        help="what snapping cuts to document boundaries would save")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if args.measured:
        measured(args.measured)
        return
    if args.snap:
        sources = {"corpus": corpus_document_lengths(), "synthetic ~2k": synthetic("2k"),
                   "long tail": synthetic("long_tail")}  # fmt: skip
        print("| documents | seq_len | K | cross-segment K/V tokens, balanced | snapped | "
              "snapped step time / balanced |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, lengths in sources.items():
            for seq_len in (32768, 131072):
                docs = pack(lengths, 8, seq_len, seed=seq_len + 4)
                for k in (4, 8):
                    r = snap_savings(docs, SHAPE_8B, 4, k)
                    print(f"| {name} | {seq_len} | {k} | {r['cross_kv_before']} | "
                          f"{r['cross_kv_after']} | "
                          f"{r['time_snapped_vs_balanced']:.4f} |")  # fmt: skip
        return
    out = run(args.quick)
    for name, d in out["distributions"].items():
        print(f"{name}: {d}")
    print("documents        seq_len  pp  K  causal/uniform  mask/uniform  mask/causal")
    for r in out["simulated"]:
        print(f"{r['documents']:<16} {r['seq_len']:>7} {r['pp']:>3} {r['K']:>2}"
              f"  {r['causal_vs_uniform']:>14.3f}  {r['mask_aware_vs_uniform']:>12.3f}"
              f"  {r['mask_aware_vs_causal']:>11.3f}")  # fmt: skip
    print(f"split cost at 128k x 8 rows: {out['split_cost_128k']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
