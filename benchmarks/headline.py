"""The run's headline measurements: one line each, the ratios the targets are about.

Why: the numbers a reader compares with the goals (docs/benchmarks.md, "Targets") are spread
over many tables; this collects them, measured values and ratios only. Whether a goal is met is read
against docs/benchmarks.md, not decided here.
"""

from __future__ import annotations

from typing import Any

from seq1f1b.registry import lookup

from .step_time.simtables import ZB_8B, zero_bubble_8b_ratios

__all__ = ["headline_rows"]


def _ratio(run: dict[str, Any], base: dict[str, Any], key: str) -> float | None:
    a, b = run.get(key), base.get(key)
    return a / b if a and b else None


def _formula_row(rows: list[dict[str, Any]], name: str) -> dict[str, str]:
    """Largest relative deviation of the equal-cost simulated bubble from the closed form."""
    dev = max(
        abs(r["bubble_ratio_equal_cost"] - r["formula_bubble_ratio"]) / r["formula_bubble_ratio"]
        for r in rows
    )
    return {"name": name, "value": f"max deviation {dev:.1%} over {len(rows)} settings"}


def _simulated(results: dict[str, Any]) -> list[dict[str, str]]:
    def rows(schedule: str) -> list[dict[str, Any]]:
        return [r for r in results["simulation"] if r["schedule"] == schedule and "error" not in r]

    sim = rows("Seq1F1B")
    out = [_formula_row(sim, "simulated Seq1F1B bubble, equal-cost segments, vs (p-1)/(K*M+p-1)")]
    if rows("BitPipe"):
        out.append(
            _formula_row(
                rows("BitPipe"), "simulated BitPipe bubble, t_b = t_f, vs (pp-2)/(4M+pp-2)"
            )
        )
    pairs: dict[tuple[int, int, int, int], dict[str, float]] = {}
    for r in sim:
        key = (r["pp"], r["microbatches"], r["seq_len"], r["seq_chunks"])
        pairs.setdefault(key, {})[r["split"]] = r["bubble_ratio"]
    wins = sum(p["compute"] < p["uniform"] for p in pairs.values())
    gaps = [p["uniform"] - p["compute"] for p in pairs.values()]
    out.append(
        {
            "name": "simulated bubble with causal costs: compute-balanced vs uniform split",
            "value": f"compute lower in {wins}/{len(pairs)} settings "
            f"(by {min(gaps):.3f} to {max(gaps):.3f})",
        }
    )
    pp, m, seq = ZB_8B
    ratios = zero_bubble_8b_ratios()
    out.append(
        {
            "name": f"simulated step time, 8B, pp={pp}, M={m}, {seq // 1024}k tokens, vs 1F1B",
            "value": f"ZBVSeq1F1B K=8 {ratios['ZBVSeq1F1B K=8']:.3f}x, K=16 "
            f"{ratios['ZBVSeq1F1B K=16']:.3f}x, ZBSeq1F1B K=8 {ratios['ZBSeq1F1B K=8']:.3f}x, "
            f"Seq1F1B K=8 {ratios['Seq1F1B K=8']:.3f}x, ZBV {ratios['ZBVZeroBubble']:.3f}x "
            f"(limit M/(M+p-1) = {m / (m + pp - 1):.3f}x)",
        }
    )
    return out


def _step_times(results: dict[str, Any]) -> list[dict[str, str]]:
    """Seq1F1B K=4 against 1F1B in every timed setting, wall, replayed and simulated."""
    out = []
    for key, setting in results["measured"].items():
        if not setting["timed"]:
            continue
        runs = {r["label"]: r for r in setting["runs"]}
        base = runs["1F1B"]
        for split in ("compute", "uniform"):
            r = runs.get(f"Seq1F1B K=4 {split}")
            if r:
                out.append(
                    {
                        "name": f"measured step time, {key}, Seq1F1B K=4 {split}, vs 1F1B",
                        "value": f"{_ratio(r, base, 'step_time_s'):.3f}x wall (replayed "
                        f"{_ratio(r, base, 'replay_step_time_s'):.3f}x, simulated "
                        f"{r['simulated_time_vs_1f1b']:.3f}x; wall/CPU "
                        f"{r['action_wall_over_cpu']:.2f}, load {setting['load_average']})",
                    }
                )
    return out


def _first_pp2(results: dict[str, Any]) -> list[dict[str, str]]:
    """The first pp=2 setting (the budget's): the fastest Seq1F1B-family run, ZBSeq1F1B K=4,
    and every schedule's longest sequence in 1F1B's activation budget with its step time."""
    key = next((k for k in results["measured"] if k.startswith("pp2_")), None)
    if key is None:
        return []
    setting = results["measured"][key]
    where = f"pp=2, M=2, {setting['seq_len']} tokens"
    limit = "limit M/(M+p-1) = 0.667x"
    runs = {r["label"]: r for r in setting["runs"]}
    base = runs["1F1B"]
    ours = [r for r in setting["runs"] if lookup(r["schedule"]).seq_chunked]
    wall = {r["label"]: _ratio(r, base, "step_time_s") for r in ours}
    replay = {r["label"]: _ratio(r, base, "replay_step_time_s") for r in ours}
    out = []
    timed = [lbl for lbl in wall if wall[lbl]]
    if timed:
        best = min(timed, key=lambda lbl: wall[lbl] or 0.0)
        out.append(
            {
                "name": f"fastest Seq1F1B-family step time vs 1F1B ({where})",
                "value": f"{best}: {wall[best]:.3f}x wall, {replay[best] or 0.0:.3f}x replayed "
                f"({limit})",
            }
        )
    zb = runs.get("ZBSeq1F1B K=4 compute")
    if zb:
        seq = runs.get("Seq1F1B K=4 compute")
        plain = f"; Seq1F1B K=4 {_ratio(seq, base, 'step_time_s'):.3f}x" if seq else ""
        out.append(
            {
                "name": f"measured step time, {where}, ZBSeq1F1B K=4 compute vs 1F1B",
                "value": f"{_ratio(zb, base, 'step_time_s'):.3f}x wall (replayed "
                f"{_ratio(zb, base, 'replay_step_time_s'):.3f}x{plain}; {limit})",
            }
        )
    budget = results.get("budget")
    fits = {row["label"]: row["longest_seq_len"] for row in budget["rows"]} if budget else {}
    one = fits.get("1F1B") or 0
    both = sorted(
        ((fits[lbl] / one, wall[lbl], lbl) for lbl in fits if one and wall.get(lbl)),
        reverse=True,
    )
    if both:
        out.append(
            {
                "name": f"longest sequence in 1F1B's activation budget and step time ({where})",
                "value": "; ".join(
                    f"{lbl}: {n:.2f}x of 1F1B's length at {t:.3f}x step time" for n, t, lbl in both
                ),
            }
        )
    return out


def _units_in_flight(results: dict[str, Any]) -> list[dict[str, str]]:
    """Largest measured / formula units in flight over the split-backward, uniform-split runs
    (there every unit leaves the same bytes, so peak / one unit counts units exactly)."""
    split = [
        b
        for b in results.get("memory_bounds") or []
        if lookup(b["label"].split()[0]).split_backward and b["label"].endswith(" uniform")
    ]
    if not split:
        return []
    worst = max(split, key=lambda b: (b["measured_units"] or 0) / b["formula_units"])
    over = (worst["measured_units"] or 0) / worst["formula_units"]
    return [
        {
            "name": "units in flight per stage, measured vs the formula (ZBSeq1F1B, ZBVSeq1F1B, "
            "uniform split; every stage)",
            "value": f"largest measured/formula {over:.2f} ({worst['label']}, stage "
            f"{worst['stage']}: {worst['measured_units']} vs {worst['formula_units']})",
        }
    ]


def _pp4_memory(results: dict[str, Any]) -> list[dict[str, str]]:
    pp4 = results["measured"].get("pp4")
    if not pp4:
        return []
    runs = {r["label"]: r for r in pp4["runs"]}
    base = runs["1F1B"]["peak_activation_bytes"][0]
    out = []
    for split in ("uniform", "compute"):
        r = runs.get(f"Seq1F1B K=4 {split}")
        if r:
            out.append(
                {
                    "name": f"measured stage-0 peak activations, pp=4, K=4 {split}, vs 1F1B",
                    "value": f"{r['peak_activation_bytes'][0] / base:.3f}x",
                }
            )
    return out


def headline_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """``{"name", "value"}`` per headline measurement of one run's ``results``."""
    return [
        *_simulated(results),
        *_pp4_memory(results),
        *_step_times(results),
        *_first_pp2(results),
        *_units_in_flight(results),
    ]
