"""Markdown tables of the benchmark results (what the README shows).

Why: one place that turns ``results.json`` into the tables people read, so the README and the
command's own output never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seq1f1b.registry import BASELINE_NAME, is_baseline

__all__ = ["markdown_report"]

MIB = 1024 * 1024


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _mean(xs: Sequence[float] | None) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def measured_table(runs: Sequence[dict[str, Any]], timed: bool) -> list[str]:
    """Step time, tokens/s and per-rank peak saved activations, as ratios against 1F1B.

    Memory columns are per rank (= per stage for one stage per rank; interleaved schedules
    hold two stages per rank, BitPipe four, and per-stage numbers are in results.json).
    Weights: parameter bytes per rank, averaged over ranks (BitPipe holds two replicas).
    """
    base = next((r for r in runs if is_baseline(r["schedule"])), None)
    n_ranks = max(len(r["peak_activation_rank_bytes"]) for r in runs)
    rss = any(r.get("peak_rss_bytes") for r in runs)
    head = ["schedule"]
    if timed:
        head += ["step s (median)", "vs 1F1B", "replayed", "simulated", "tokens/s", "wall/CPU"]
    head += [f"rank {r} act. MiB (vs 1F1B)" for r in range(n_ranks)]
    head += ["weights MiB / rank (vs 1F1B)"]
    if rss:
        head += ["rank 0 peak RSS MiB"]
    rows = []
    for r in runs:
        row = [r["label"]]
        if timed:
            row += [
                _fmt(r["step_time_s"], ".2f"),
                _fmt(_ratio(r["step_time_s"], base and base["step_time_s"])),
                _fmt(_ratio(r["replay_step_time_s"], base and base["replay_step_time_s"])),
                _fmt(r.get("simulated_time_vs_1f1b")),
                _fmt(r["tokens_per_s"], ".0f"),
                _fmt(r.get("action_wall_over_cpu"), ".2f"),
            ]
        ref = base["peak_activation_rank_bytes"] if base else [None] * n_ranks
        for rank, b in enumerate(r["peak_activation_rank_bytes"]):
            row.append(f"{b / MIB:.1f} ({_fmt(_ratio(b, ref[rank]), '.2f')})")
        weights = _mean(r.get("param_bytes_rank"))
        ref_w = _mean(base.get("param_bytes_rank")) if base else None
        row.append(
            f"{_fmt(weights and weights / MIB, '.1f')} ({_fmt(_ratio(weights, ref_w), '.2f')})"
        )
        if rss:
            v = r.get("peak_rss_bytes")
            row.append(_fmt(v[0] / MIB if v else None, ".0f"))
        rows.append(row)
    return _table(head, rows)


def simulation_table(rows: Sequence[dict[str, Any]], pp: int, m: int, seq_len: int) -> list[str]:
    """One paper setting: simulated bubble and memory next to the closed forms."""
    head = [
        "schedule",
        "bubble (causal FLOPs)",
        "bubble (equal cost)",
        "formula",
        "time vs 1F1B",
        "rank-0 act. (A)",
        "formula",
    ]
    body = []
    for r in rows:
        if (r["pp"], r["microbatches"], r["seq_len"]) != (pp, m, seq_len):
            continue
        if "error" in r:
            body.append([r["label"], "n/a: " + r["error"][:60], "", "", "", "", ""])
            continue
        body.append(
            [
                r["label"],
                _fmt(r["bubble_ratio"]),
                _fmt(r["bubble_ratio_equal_cost"]),
                _fmt(r["formula_bubble_ratio"]),
                _fmt(r["time_vs_1f1b"]),
                _fmt(r["peak_activation_rank0"], ".2f"),
                _fmt(r["formula_peak_activation_rank0"], ".2f"),
            ]
        )
    return _table(head, body)


def budget_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    base = next((r for r in rows if r["label"] == BASELINE_NAME), None)
    head = [
        "schedule",
        "KiB / token (fit)",
        "longest seq_len",
        "vs 1F1B",
        "measured peak there (MiB)",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["label"],
                f"{r['bytes_per_token'] / 1024:.1f}",
                str(r["longest_seq_len"]),
                _fmt(_ratio(r["longest_seq_len"], base and base["longest_seq_len"]), ".2f"),
                _fmt(r.get("verified_peak_bytes") and r["verified_peak_bytes"] / MIB, ".1f"),
            ]
        )
    return _table(head, body)


def headline_table(rows: Sequence[dict[str, str]]) -> list[str]:
    """The headline measurements, one row each (their goals: docs/benchmarks.md, "Targets")."""
    return _table(["measured", "value"], [[r["name"], r["value"]] for r in rows])


def markdown_report(results: dict[str, Any]) -> str:
    """All tables, in the order the README uses them."""
    meta = results["meta"]
    out = [f"# Benchmarks ({meta['mode']})", "", f"`{meta['command']}` — {meta['summary']}", ""]
    out += ["## Headline ratios", "", *headline_table(results["headline"]), ""]
    for setting in results["measured"].values():
        out += [f"## Measured: {setting['title']}", "", setting["note"], ""]
        out += measured_table(setting["runs"], setting["timed"])
        out.append("")
    if results.get("memory_bounds"):
        out += ["## Units in flight per stage: formula vs measured", ""]
        out += [
            "Units (one sample's segment on one stage) held at once. Formula: "
            "`min(MK, p-s+K-1)` with one stage per rank, `min(MK, 2p-1-s+K)` in the V "
            "(program order). Measured: the stage's peak saved bytes over the median bytes one "
            "forward (with its loss) left saved; with the compute split units differ in size, "
            "so the measured count is approximate there.",
            "",
            "| schedule | stage | formula | measured | peak MiB |",
            "|---|---|---|---|---|",
        ]
        for b in results["memory_bounds"]:
            out.append(
                f"| {b['label']} | {b['stage']} | {b['formula_units']} | "
                f"{b['measured_units']} | {b['peak_bytes'] / MIB:.1f} |"
            )
        out.append("")
    if results.get("budget"):
        b = results["budget"]
        out += [f"## Longest sequence under {b['budget_bytes'] / MIB:.1f} MiB per rank", ""]
        out += [b["note"], "", *budget_table(b["rows"]), ""]
    for pp, m, seq in results["simulation_views"]:
        out += [f"## Simulated: 7B-like, pp={pp}, M={m}, {seq // 1024}k tokens", ""]
        out += simulation_table(results["simulation"], pp, m, seq)
        out.append("")
    if results.get("masks"):
        out += masks_tables(results["masks"])
    if results.get("context_parallel"):
        out += cp_tables(results["context_parallel"])
    if results.get("calibration"):
        out += calibration_section(results["calibration"])
    if results.get("planner_example"):
        out += ["## Planner vs the published 7B memory (32 GPUs of 80 GB, pp 8 x tp 4, M = 8)", ""]
        out += planner_table(results["planner_example"])
        out.append("")
    if results.get("memory_vs_published"):
        out += published_memory_table(results["memory_vs_published"])
    return "\n".join(out)


def calibration_section(cal: dict[str, Any]) -> list[str]:
    """The calibrated time model's predicted step time vs 1F1B next to the measured one."""
    from ..planner_models.time_costs import ratio_table, table

    f, b = cal["constants"]["forward"], cal["constants"]["backward"]
    return [
        "## Planner's time model, calibrated on the measured actions: predicted vs measured",
        "",
        f"Fitted on {cal['actions']} measured actions (CPU time per action; median error per "
        f"action {cal['action_error_median_abs']:.1%}). Forward: {f['linear'] * 1e12:.1f} ps "
        f"per linear FLOP, {f['attention'] * 1e12:.1f} ps per attention FLOP, "
        f"{f['per_module'] * 1e3:.2f} ms per module, {f['overhead'] * 1e3:.2f} ms per action; "
        f"backward: {b['linear'] * 1e12:.1f} ps, {b['attention'] * 1e12:.1f} ps, "
        f"{b['per_module'] * 1e3:.2f} ms, {b['overhead'] * 1e3:.2f} ms. `predicted`: "
        "`seq1f1b.planning.planner.price` (the schedule's order simulated with the fitted costs); "
        "`held out`: the same with constants fitted without that run's actions; `replayed`: the "
        "measured actions' CPU times replayed in their order; `wall`: the measured wall-clock "
        "median (inflated by other jobs when wall/CPU > 1).",
        "",
        table(cal),
        "",
        "The CPU profile (the planner's default `--calibration-model profile`: linear and "
        "attention efficiencies and an overhead per action, fitted on the same actions) against "
        "the per-kind constants, each schedule's ratio to 1F1B vs the replayed one:",
        "",
        ratio_table(cal),
        "",
    ]


def published_memory_table(mem: dict[str, Any]) -> list[str]:
    """The memory model against the paper's 7B table, with the common offset explained."""
    splits = mem["splits"]
    rows = [
        [
            r["schedule"],
            r["planner"],
            f"{r['published_gb']:.1f}",
            *(f"{r[s]:.1f}" for s in splits),
            f"{r['diff_vs_1f1b_published']:+.1f} / {r['diff_vs_1f1b_model']:+.1f}",
            f"{r['model_plus_offset_gb']:.1f}",
            f"{r['error']:+.1%}",
        ]
        for r in mem["rows"]
    ]
    head = [
        "paper",
        "planner schedule",
        "paper GB",
        *(f"model {s}" for s in splits),
        "vs 1F1B: paper / model",
        f"model {splits[0]} + {mem['offset_gb']:.1f}",
        "error",
    ]
    return [
        "## Memory model vs the published 7B table (32 GPUs, 64k tokens, M = 8, no AC)",
        "",
        "The published 1F1B figure implies tp = 8 (at tp = 4 one microbatch of all layers "
        "alone exceeds it); the differences between schedules cancel every term that does not "
        "depend on activations and match; the common offset (fitted on 1F1B) is memory the "
        "model does not count (allocator reserve, CUDA/NCCL context, Megatron's bf16 weight "
        "copy). See benchmarks/planner_models/vs_published.py.",
        "",
        *_table(head, rows),
        "",
    ]


def planner_table(example: dict[str, Any]) -> list[str]:
    """Predicted peak GB per GPU for each K next to the paper's measured memory."""
    published = example["published_gb"]
    rows = []
    for seq in ("65536", "131072"):
        for k, v in example[seq].items():
            paper = published.get(seq, {}).get("1F1B" if k == "K=1" else "Seq1F1B", "")
            rows.append([seq, k, f"{v['gb']:.1f}", "yes" if v["fits"] else "no", str(paper)])
    return [
        f"`python -m seq1f1b.planning.planner {example['args']} --seq-len <tokens>`",
        "",
        *_table(["tokens", "K", "planner GB", "fits", "paper GB (K not stated)"], rows),
    ]


def cp_tables(cp: dict[str, Any]) -> list[str]:
    """CP x Seq1F1B: per-rank memory and ring bytes (measured), longest sequence (simulated)."""
    m = cp["measured"]
    rows = []
    for r in m["runs"]:
        sent = r["cp_sent_bytes_rank"][0] or {}
        formula = r.get("cp_formula_bytes") or {}
        rows.append(
            [
                r["label"],
                f"{r['pp']} x {r['cp']}",
                _fmt(r["step_time_s"]),
                f"{r['peak_activation_bytes'][0] / MIB:.2f}",
                f"{r['kv_peak_bytes_rank'][0] / MIB:.2f}",
                f"{sent.get('own_kv', 0) / MIB:.2f}",
                f"{sent.get('prefix', 0) / MIB:.2f}",
                "-" if r["cp"] == 1 else ("yes" if sent == formula else "no"),
            ]
        )
    out = [
        f"## Context parallelism: pp x cp, M={m['microbatches']}, {m['seq_len']} tokens "
        "(stage 0, per rank)",
        "",
        "Ring traffic is what one rank sends per step (K/V of the own segment; the cached "
        "prefix by pass-Q or pass-KV), checked against the formula in benchmarks/"
        "context_parallel.py. Step times with 4 ranks on 2 cores are contended.",
        "",
        *_table(
            [
                "schedule",
                "pp x cp",
                "step s",
                "activations MiB",
                "K/V cache MiB",
                "own K/V ring MiB",
                "prefix MiB",
                "= formula",
            ],
            rows,
        ),
        "",
        "## Simulated: longest sequence per GPU budget, Llama 3 8B, 8 x 80 GB",
        "",
        *_table(
            ["setting", "no AC: tokens", "full AC: tokens"],
            [
                [
                    r["label"],
                    f"{r['longest_tokens']:,}",
                    f"{other['longest_tokens']:,}",
                ]
                for r, other in zip(cp["simulated"][::2], cp["simulated"][1::2], strict=True)
            ],
        ),
        "",
    ]
    return out


def masks_tables(masks: dict[str, Any]) -> list[str]:
    """Skipping invisible blocks (measured) and the mask-aware split (simulated)."""
    m = masks["measured"]
    runs = m["runs"]
    base = runs[-1]  # the mask-alone baseline
    rows = []
    for r in runs:
        rows.append(
            [
                r["label"],
                _fmt(r["step_time_s"]),
                _fmt(_ratio(r["step_time_s"], base["step_time_s"]), ".2f"),
                _fmt(_ratio(r["replay_step_time_s"], base["replay_step_time_s"]), ".2f"),
                f"{r['kv_peak_bytes_rank'][0] / MIB:.2f}",
                f"{r['peak_activation_bytes'][0] / MIB:.1f}",
            ]
        )
    out = [
        f"## Packed documents: pp=2, M=2, K=4, {m['seq_len']} tokens, documents of "
        f"~{m['document_tokens']} tokens",
        "",
        "Skipping blocks that share no document and caching only what later segments see, "
        "against the mask alone (every block computed under the mask, every segment cached).",
        "",
        *_table(
            [
                "schedule",
                "step s",
                "vs mask only",
                "replayed vs mask only",
                "stage-0 K/V cache MiB",
                "stage-0 activations MiB",
            ],
            rows,
        ),
        "",
    ]
    sim = masks["simulated"]
    if sim:
        first = sim[0]
        out += [
            f"## Simulated: mask-aware split, 7B-like, pp={first['pp']}, "
            f"M={first['microbatches']}, 32k tokens",
            "",
            "Every split costed with the masked attention; the causal compute split shortens "
            "later segments for attention the mask removes.",
            "",
            *_table(
                ["mask", "K", "split", "max/mean segment cost", "bubble", "time vs uniform"],
                [
                    [
                        r["mask"],
                        str(r["seq_chunks"]),
                        r["split"],
                        _fmt(r["segment_cost_max_over_mean"], ".3f"),
                        _fmt(r["bubble_ratio"], ".3f"),
                        _fmt(r["time_vs_uniform"], ".3f"),
                    ]
                    for r in sim
                ],
            ),
            "",
        ]
    return out
