"""Packed real documents: the three compute splits, simulated at the 8B shape.

The shipped corpus (Python standard library files, ``torchtitan_integration.assets``) is
tokenized with the shipped tokenizer, its documents shuffled and packed end to end into rows
of the sequence length (as torchtitan's text datasets pack: a document that does not fit
continues on the next row, where it counts as a document of its own). For each packing the
pipeline is simulated with each unit costing what its own row's mask costs (one row per sample)
with the uniform split, the causal compute split (``split="compute"`` without documents) and
the mask-aware split (``split="compute"`` with the step's ``document_ids``,
:func:`seq1f1b.schedules.mask_split.mask_balanced_split`). Also: synthetic documents of ~2k tokens
and a long-tailed (log-normal) distribution, and the split's own cost per step at 128k tokens.

    python -m benchmarks.documents.packed [--quick]
    python -m benchmarks.documents.packed --measured quick|full [--steps 10]
    python -m benchmarks.documents.packed --snap

``--snap``: what moving each mask-aware cut, within 2% of a segment, to a document boundary
would save (K/V tokens that later segments see across the cut) and cost (simulated step time).
``--measured``: the corpus packed into 4096-token rows, run for real (CPU, gloo, pp=2, M=2,
K=4): the three splits' step times against torch's Schedule1F1B (which cannot take the
documents: it attends causally over the whole row), and each split's ratio to uniform
measured against the simulator's at the measured model's shape, with FLOPs costs and with
this CPU's per-action costs fitted on the uniform runs (the others held out).
With CP (simulated): each CP rank's work under the causal head-tail layout and under the
document-balanced one (:func:`seq1f1b.attention.kv.document_cp_layout`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from seq1f1b.attention.kv import CP_CHUNKS_PER_RANK, document_cp_layout, zigzag_runs
from seq1f1b.attention.masks import document_runs
from seq1f1b.orders.order import OrderSpec, build_orders
from seq1f1b.planning.simulate import simulate
from seq1f1b.schedules.mask_split import (
    MaskSplitCache,
    attended_keys_per_position,
    mask_balanced_split,
)
from seq1f1b.schedules.partition import (
    ModelShape,
    compute_balanced_split,
    token_cost,
    uniform_split,
)
from torchtitan_integration.balanced_packing import balance_rows

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


def row_prefix_flops(docs: torch.Tensor, shape: ModelShape) -> list[list[float]]:
    """Per row (one sample each): prefix sums of the per-position FLOPs under its own mask."""
    base, per_key = token_cost(shape)
    out = []
    for row in range(docs.shape[0]):
        flops = base + per_key * attended_keys_per_position(docs[row : row + 1])
        out.append([0.0, *torch.cumsum(flops, 0).tolist()])
    return out


def step_time(
    order: Any, prefixes: list[list[float]], lengths: list[list[int]], stages: int
) -> float:
    """Simulated makespan when sample ``m`` (row ``m``) is cut into ``lengths[m]``: every unit
    costs what its own positions cost under its own row's mask (backward = 2 forwards)."""
    costs = []
    for prefix, ls in zip(prefixes, lengths, strict=True):
        bounds = [sum(ls[:j]) for j in range(len(ls) + 1)]
        costs += [(prefix[b] - prefix[a]) / stages for a, b in pairwise(bounds)]

    def cost(action: Any) -> float:
        f = costs[action.microbatch_index or 0]
        return f if str(action.computation_type) == "F" else 2 * f

    return simulate(order, cost).makespan


def positions_of(docs: torch.Tensor) -> torch.Tensor:
    """Per-document positions (0 at each run of one document id in a row), as torchtitan
    yields them for packed rows."""
    idx = torch.arange(docs.shape[1]).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


def balanced_documents(docs: torch.Tensor) -> torch.Tensor:
    """``docs`` (rows of document ids) with the documents reassigned among the rows by
    :func:`balance_rows`; every piece gets an id of its own."""
    pos = positions_of(docs)
    _, _, new_pos = balance_rows(docs, docs, pos)
    assert new_pos is not None
    return (new_pos == 0).long().cumsum(dim=1) + docs.shape[1] * torch.arange(
        docs.shape[0]
    ).unsqueeze(1)


def simulate_splits(
    docs: torch.Tensor, shape: ModelShape, pp: int, microbatches: int, k: int
) -> dict[str, Any]:
    """Step time (FLOPs, simulated) of the splits under ``docs``' mask, one row per sample:
    uniform, causal compute, the mask-aware split of the whole step (one cut for every sample,
    balancing their average) and per sample (what ``split="compute"`` does with documents)."""
    rows, seq_len = docs.shape
    assert rows == microbatches, "one row per sample"
    order = build_orders(OrderSpec(pp, 1, microbatches, k))
    prefixes = row_prefix_flops(docs, shape)
    splits = {
        "uniform": [uniform_split(seq_len, k)] * rows,
        "causal": [compute_balanced_split(seq_len, k, shape)] * rows,
        "mask_step": [mask_balanced_split(docs, k, shape)] * rows,
        "mask_aware": [mask_balanced_split(docs[r : r + 1], k, shape) for r in range(rows)],
    }
    times = {name: step_time(order, prefixes, ls, pp) for name, ls in splits.items()}
    balanced = balanced_documents(docs)  # the same documents, rows balanced (WLB-LLM)
    times["balanced"] = step_time(
        order,
        row_prefix_flops(balanced, shape),
        [mask_balanced_split(balanced[r : r + 1], k, shape) for r in range(rows)],
        pp,
    )
    return {
        "pp": pp, "M": microbatches, "K": k, "seq_len": seq_len,
        "lengths": {name: ls[0] for name, ls in splits.items()},
        "causal_vs_uniform": times["causal"] / times["uniform"],
        "mask_step_vs_uniform": times["mask_step"] / times["uniform"],
        "mask_aware_vs_uniform": times["mask_aware"] / times["uniform"],
        "mask_aware_vs_causal": times["mask_aware"] / times["causal"],
        "balanced_vs_causal": times["balanced"] / times["causal"],
    }  # fmt: skip


def _rank_flops(prefix: list[float], layout: tuple) -> list[float]:
    return [sum(prefix[b] - prefix[a] for a, b in runs) for runs in layout]


def simulate_cp(
    docs: torch.Tensor, shape: ModelShape, pp: int, k: int, cp: int = 2
) -> dict[str, Any]:
    """Context parallelism over ``cp`` ranks with each split: a unit takes as long as its
    costliest CP rank. Per layout (the causal head-tail one, the document-balanced one): the
    max/mean attention work over the CP ranks (worst unit and mean over units) and the
    simulated step time (one row per sample)."""
    rows, seq_len = docs.shape
    base, per_key = token_cost(shape)
    multiple = 2 * cp * max(CP_CHUNKS_PER_RANK)
    splits = {
        "uniform": [uniform_split(seq_len, k, multiple)] * rows,
        "causal": [compute_balanced_split(seq_len, k, shape, multiple)] * rows,
        "mask_aware": [
            mask_balanced_split(docs[r : r + 1], k, shape, multiple_of=multiple)
            for r in range(rows)
        ],
    }
    samples = []
    for row in range(rows):
        keys = attended_keys_per_position(docs[row : row + 1])
        attn = [0.0, *torch.cumsum(per_key * keys, 0).tolist()]
        samples.append((document_runs(docs[row : row + 1]), attn))
    order = build_orders(OrderSpec(pp, 1, rows, k))
    out: dict[str, Any] = {"pp": pp, "K": k, "cp": cp, "seq_len": seq_len}
    for split, per_row in splits.items():
        for name in ("head_tail", "documents"):
            costs, ratios = [], []
            for (groups, attn), lengths in zip(samples, per_row, strict=True):
                bounds = [sum(lengths[:j]) for j in range(k + 1)]
                for a, b in pairwise(bounds):
                    layout = (
                        tuple(zigzag_runs(a, b, r, cp) for r in range(cp))
                        if name == "head_tail"
                        else document_cp_layout(a, b, cp, groups)
                    )
                    work = _rank_flops(attn, layout)
                    ratios.append(max(work) / (sum(work) / cp))
                    costs.append((base * (b - a) / cp + max(work)) / pp)

            def cost(action, costs=costs) -> float:
                f = costs[action.microbatch_index or 0]
                return f if str(action.computation_type) == "F" else 2 * f

            out[f"{split}/{name}"] = {
                "max_over_mean_worst": max(ratios),
                "max_over_mean_mean": statistics.fmean(ratios),
                "step": simulate(order, cost).makespan,
            }
    return out


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
    rows, seq_len = docs.shape
    reach = int(reach_fraction * seq_len / k)
    balanced, snapped, before, after = [], [], 0, 0
    for r in range(rows):  # each sample its own cuts, as seq_split="compute" cuts them
        row = docs[r : r + 1]
        lengths = mask_balanced_split(row, k, shape)
        cuts = [sum(lengths[:j]) for j in range(1, k)]
        moved = snapped_cuts(row, cuts, reach)
        balanced.append(lengths)
        snapped.append([b - a for a, b in zip([0, *moved], [*moved, seq_len], strict=True)])
        before += sum(cross_cut_tokens(row, c) for c in cuts)
        after += sum(cross_cut_tokens(row, c) for c in moved)
    order = build_orders(OrderSpec(pp, 1, rows, k))
    prefixes = row_prefix_flops(docs, shape)
    ratio = step_time(order, prefixes, snapped, pp) / step_time(order, prefixes, balanced, pp)
    return {"seq_len": seq_len, "K": k, "rows": rows, "cross_kv_before": before,
            "cross_kv_after": after, "time_snapped_vs_balanced": ratio}  # fmt: skip


def split_cost(docs: torch.Tensor, k: int, shape: ModelShape, cp: int = 2) -> dict[str, float]:
    """Seconds to compute every sample's mask-aware split (one row per sample, as
    ``split="compute"`` does per step) for a new layout and from the cache, and the
    document-balanced CP layouts of those segments (``cp`` ranks)."""
    cache, rows = MaskSplitCache(), [docs[r : r + 1] for r in range(docs.shape[0])]
    t0 = time.perf_counter()
    lengths = [cache.lengths(row, k, shape, multiple_of=2 * cp) for row in rows]
    t1 = time.perf_counter()
    for row in rows:
        cache.lengths(row, k, shape, multiple_of=2 * cp)
    t2 = time.perf_counter()
    for row, ls in zip(rows, lengths, strict=True):
        groups = document_runs(row)
        for a, b in pairwise([sum(ls[:j]) for j in range(k + 1)]):
            document_cp_layout(a, b, cp, groups)
    t3 = time.perf_counter()
    return {"new_layout_s": t1 - t0, "cached_s": t2 - t1, "cp_layouts_s": t3 - t2,
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
    out["cp"] = [
        {"documents": name, **simulate_cp(pack(lengths, 2 * pp, seq_len, seed=seq_len), SHAPE_8B,
                                          pp, k)}
        for name, lengths in sources.items()
        for seq_len in seq_lens
        for pp in pps[:1]
        for k in (4, 8)
    ]  # fmt: skip
    docs = pack(synthetic("2k"), 8, 131072, seed=1)  # thousands of documents per step
    split_cost(docs[:1, :1024], 4, SHAPE_8B)  # warm up torch
    out["split_cost_128k"] = split_cost(docs, 4, SHAPE_8B)
    return out


def unit_works(
    docs: torch.Tensor, lengths: list[list[int]], cfg: Any, pp: int
) -> dict[tuple[int, int], Any]:
    """Forward work of every (stage, unit) of a Seq1F1B run (one row per sample, ``pp``
    stages), its attention counted under the row's document mask."""
    from seq1f1b.planning.costmodel import Work, action_work

    from ..harness.measured import model_shape

    shape = model_shape(cfg)
    layers = cfg.n_layers // pp
    d, h = shape.head_dim, shape.n_heads
    assert d is not None
    out = {}
    for m, ls in enumerate(lengths):
        keys = [0.0, *attended_keys_per_position(docs[m : m + 1]).cumsum(0).tolist()]
        bounds = [sum(ls[:j]) for j in range(len(ls) + 1)]
        for seg, (a, b) in enumerate(pairwise(bounds)):
            for stage in range(pp):
                w = action_work(shape, layers, stage == pp - 1, b - a, b)
                attention = layers * (keys[b] - keys[a]) * (4 * d + 3) * h
                out[stage, m * len(ls) + seg] = Work(w.linear, attention, w.elements, w.modules)
    return out


def calibrated_ratios(
    runs: dict[str, dict[str, Any]],
    works: dict[str, dict],
    fit_on: list[str],
    pp: int,
    m: int,
    k: int,
) -> dict[str, float]:
    """Each run's step time predicted by the simulator with this machine's per-action costs,
    fitted (:func:`seq1f1b.planning.calibration.fit_action_costs`) on the ``fit_on`` runs' fastest
    actions only: the other runs are held out."""
    from seq1f1b.planning.calibration import Sample, fit_action_costs

    from ..planner_models.time_costs import fastest_trace

    samples = [
        Sample(ev["kind"], works[label][ev["stage"], ev["mb"]], ev["cpu"])
        for label in fit_on
        for ev in fastest_trace(runs[label])
        if ev["cpu"] > 0
    ]
    costs = fit_action_costs(samples, "this CPU, fitted on the uniform runs")
    order = build_orders(OrderSpec(pp, 1, m, k))
    return {
        label: simulate(
            order,
            lambda a, w=w: costs.of(a.computation_type).seconds(
                w[a.stage_index, a.microbatch_index or 0]
            ),
        ).makespan
        for label, w in works.items()
    }  # fmt: skip


def measured(preset_name: str, steps: int = 3) -> None:
    """Measured step times of the three splits on packed rows, and of the mask-aware split on
    the same rows balanced (``balanced``), vs simulated (FLOPs, and this CPU's fitted action
    costs): the corpus, and documents of ~512 tokens (at 4096 tokens the corpus gives a row one
    to three documents)."""
    from ..harness.measured import RunSpec, Setting, measure, model_shape, packed_documents
    from ..harness.presets import PRESETS
    from ..planner_models.time_costs import replay_fastest

    preset = PRESETS[preset_name]
    shape = model_shape(preset.model)
    seq_len, m, k, pp = 4096, 2, 4, 2
    layouts = {
        "corpus": pack(corpus_document_lengths(), m, seq_len, seed=7),
        "~512-token documents": packed_documents(m, seq_len, 512),
    }
    causal_lengths = compute_balanced_split(seq_len, k, shape)
    causal = ",".join(map(str, causal_lengths))
    splits = {"uniform": "uniform", "causal": causal, "mask_aware": "compute"}
    specs: list[RunSpec] = [RunSpec("1F1B")]
    works: dict[str, dict] = {}
    for name, docs in layouts.items():
        rows = tuple(tuple(r) for r in docs.tolist())
        for what, split in splits.items():
            spec = RunSpec("Seq1F1B", k, split, document_ids=rows, tag=f"{name}, {what}")
            specs.append(spec)
            lengths = {
                "uniform": [uniform_split(seq_len, k)] * m,
                "causal": [causal_lengths] * m,
                "mask_aware": [mask_balanced_split(docs[r : r + 1], k, shape) for r in range(m)],
            }[what]
            works[spec.label] = unit_works(docs, lengths, preset.model, pp)
        # the same documents, the rows balanced (WLB-LLM), cut per sample
        balanced = balanced_documents(docs)
        rows = tuple(tuple(r) for r in balanced.tolist())
        spec = RunSpec("Seq1F1B", k, "compute", document_ids=rows, tag=f"{name}, balanced")
        specs.append(spec)
        lengths = [mask_balanced_split(balanced[r : r + 1], k, shape) for r in range(m)]
        works[spec.label] = unit_works(balanced, lengths, preset.model, pp)
    setting = Setting(pp, m, seq_len, preset.model, tuple(specs), steps, keep_trace=True)
    runs = {r["label"]: r for r in measure(setting)}
    labels = {(name, what): f"Seq1F1B K={k} {split}, {name}, {what}"
              for name in layouts for what, split in splits.items()}  # fmt: skip
    labels |= {(name, "balanced"): f"Seq1F1B K={k} compute, {name}, balanced" for name in layouts}
    fit_on = [labels[name, "uniform"] for name in layouts]
    predicted = calibrated_ratios(runs, works, fit_on, pp, m, k)
    base = runs["1F1B"]["step_time_s"]
    print(f"preset {preset_name}: pp={pp}, M={m}, K={k}, {seq_len} tokens, {steps} timed steps; "
          "ratios to the same layout's uniform split")  # fmt: skip
    print("| documents | split | lengths (sample 0) | vs 1F1B | measured | measured, replayed | "
          "simulated, FLOPs | simulated, fitted (held out) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, docs in layouts.items():
        sim = simulate_splits(docs, shape, pp, m, k)
        n_docs = int((docs[:, 1:] != docs[:, :-1]).sum()) + m
        uni = runs[labels[name, "uniform"]]
        sim["balanced_vs_uniform"] = sim["balanced_vs_causal"] * sim["causal_vs_uniform"]
        sim["lengths"]["balanced"] = mask_balanced_split(balanced_documents(docs)[:1], k, shape)
        for what in (*splits, "balanced"):
            run, label = runs[labels[name, what]], labels[name, what]
            flops = 1.0 if what == "uniform" else sim[f"{what}_vs_uniform"]
            fitted = predicted[label] / predicted[labels[name, "uniform"]]
            print(f"| {name} ({n_docs}) | {what} | {sim['lengths'][what]} | "
                  f"{run['step_time_s'] / base:.3f}x | "
                  f"{run['step_time_s'] / uni['step_time_s']:.3f} | "
                  f"{replay_fastest(run) / replay_fastest(uni):.3f} | {flops:.3f} | "
                  f"{fitted:.3f}{'' if what != 'uniform' else ' (fit)'} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32k and pp=4 only")
    parser.add_argument("--measured", choices=("smoke", "quick", "full"),
                        help="run the three splits for real at pp=2 instead")  # fmt: skip
    parser.add_argument("--snap", action="store_true",
                        help="what snapping cuts to document boundaries would save")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (--measured)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if args.measured:
        measured(args.measured, args.steps)
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
    print("| documents | seq_len | pp | K | causal / uniform | mask-aware per step / uniform | "
          "mask-aware per sample / uniform | per sample / causal | balanced rows, per sample / "
          "causal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["simulated"]:
        print(f"| {r['documents']} | {r['seq_len']} | {r['pp']} | {r['K']} | "
              f"{r['causal_vs_uniform']:.3f} | {r['mask_step_vs_uniform']:.3f} | "
              f"{r['mask_aware_vs_uniform']:.3f} | {r['mask_aware_vs_causal']:.3f} | "
              f"{r['balanced_vs_causal']:.3f} |")  # fmt: skip
    print(
        "\nCP=2: max/mean attention work over the CP ranks (worst unit / mean) and simulated "
        "step time, per split: causal head-tail layout vs document-balanced layout"
    )
    print("| documents | seq_len | pp | K | split | head-tail max/mean | documents max/mean | "
          "step, documents / head-tail | step vs uniform head-tail |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["cp"]:
        uni = r["uniform/head_tail"]["step"]
        for split in ("uniform", "causal", "mask_aware"):
            ht, dl = r[f"{split}/head_tail"], r[f"{split}/documents"]
            print(f"| {r['documents']} | {r['seq_len']} | {r['pp']} | {r['K']} | {split} | "
                  f"{ht['max_over_mean_worst']:.3f} / {ht['max_over_mean_mean']:.3f} | "
                  f"{dl['max_over_mean_worst']:.3f} / {dl['max_over_mean_mean']:.3f} | "
                  f"{dl['step'] / ht['step']:.3f} | {dl['step'] / uni:.3f} |")  # fmt: skip
    print(f"split cost at 128k x 8 rows: {out['split_cost_128k']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
