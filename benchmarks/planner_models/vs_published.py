"""The planner against the Seq1F1B paper's published 7B table: predicted vs published.

    python -m benchmarks.planner_models.vs_published [--gpu a100-80gb] [--refit]

Prints every TFLOPS cell (absolute, and as a ratio to the same length's 1F1B) with the
planner's prediction on the GPU profile and its error, marking the cells the profile's
efficiencies were fitted on; then which settings fit in memory (the published OOM cells), and
the 64k memory row. ``--refit`` fits the efficiencies again on the same cells first (about
half a minute) and prints them. The tables, the fit and the comparison live in
:mod:`benchmarks.planner_models.published`; this only prints them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.planner_models.published import (
    FIT_CELLS,
    claim_30b_rows,
    fit,
    fits_rows,
    memory_rows,
    memory_vs_published,
    tflops_rows,
)
from benchmarks.planner_models.published_titan import (
    SLACK_CELL,
    allocator_slack,
    fit_h100,
    titan_rows,
)
from seq1f1b.planning.profiles import PROFILES, GpuProfile, profile

__all__ = ["main", "memory_vs_published"]


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m benchmarks.planner_models.vs_published"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--gpu", default="a100-80gb", choices=sorted(PROFILES))
    ap.add_argument("--refit", action="store_true", help="fit the efficiencies again first")
    ap.add_argument(
        "--titan", action="store_true",
        help="torchtitan's published H100 runs instead (the h100-80gb profile's fit)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.titan:
        return _titan(a.refit)
    prof = profile(a.gpu)
    if a.refit:
        prof = prof.with_efficiency(fit(prof))
    _print_profile(prof)
    print(f"{'cell':<28} {'published':>9} {'predicted':>9} {'error':>7}")
    held = []
    for r in tflops_rows(prof, FIT_CELLS):
        mark = "  (fitted)" if r["fitted"] else ""
        print(
            f"{r['cell']:<28} {r['published']:>9.3f} {r['predicted']:>9.3f} "
            f"{r['error']:>+7.1%}{mark}"
        )
        if not r["fitted"] and r["ratio_to"]:
            held.append(abs(r["error"]))
    print(f"largest held-out ratio error: {max(held):.1%} (target 5%)\n")
    print(f"{'length':>7} {'schedule':<10} {'published':>9} {'predicted':>16}")
    for r in fits_rows(prof):
        pub = "runs" if r["published_runs"] else "OOM"
        pred = f"{r['predicted_gb']:.1f}/{r['budget_gb']:.0f} GB " + (
            "fits" if r["predicted_fits"] else "OOM"
        )
        print(f"{r['seq_len']:>7} {r['schedule']:<10} {pub:>9} {pred:>16}")
    rows = memory_rows(prof)
    print(
        "\n64k memory, GiB per GPU (the fork's torch.cuda.max_memory_reserved): the worst "
        "rank's state and activations (base), what each Megatron item adds to its peak, the "
        "sequence-parallel gather buffer, a layer's backward transient, the caching "
        f"allocator's slack ({allocator_slack():.0%} of the activations, read from torchtitan's "
        f"{SLACK_CELL.label} H100 cell); nothing fitted to these cells"
    )
    print(f"{'':<28}" + "".join(f"{r['schedule']:>10}" for r in rows))
    print(f"{'published':<28}" + "".join(f"{r['published_gib']:>10.1f}" for r in rows))
    print(f"{'base':<28}" + "".join(f"{r['base_gib']:>10.2f}" for r in rows))
    for item in rows[0]["items_gib"]:
        print(f"{'+ ' + item:<28}" + "".join(f"{r['items_gib'][item]:>10.2f}" for r in rows))
    print(f"{'+ gather buffer':<28}" + "".join(f"{r['gather_gib']:>10.2f}" for r in rows))
    print(f"{'+ backward transient':<28}" + "".join(f"{r['transient_gib']:>10.2f}" for r in rows))
    print(f"{'+ allocator slack':<28}" + "".join(f"{r['allocator_gib']:>10.2f}" for r in rows))
    print(f"{'= total':<28}" + "".join(f"{r['total_gib']:>10.1f}" for r in rows))
    print(f"{'error':<28}" + "".join(f"{r['error']:>+10.1%}" for r in rows))
    print(f"{'not attributed':<28}" + "".join(f"{r['unattributed_gib']:>10.1f}" for r in rows))
    print("\n30B at 64k on 64 GPUs, tp 8 x pp 8, M = 16, K = 4, no recomputation (paper's claim)")
    for r in claim_30b_rows(prof):
        pred = f"{r['predicted_gb']:.1f}/{r['budget_gb']:.0f} GB " + (
            "fits" if r["predicted_fits"] else "OOM"
        )
        print(f"{r['schedule']:<10} claim {r['claim']:<13} predicted {pred}")
    print(
        "\nMindSpeed Qwen3-4B (PP 8, 16k, K = 4: 1.14x, 46.2 -> 26.9 GB): not compared; its 36 "
        "layers do not cut into 8 equal stages (the only cut the planner prices) and it ran "
        "on Ascend NPUs, which have no profile"
    )
    return 0


def _print_profile(prof: GpuProfile) -> None:
    e = prof.efficiency
    print(f"profile {prof.name}: {prof.source}")
    print(
        f"efficiencies: linear {e.linear:.3g}, attention {e.attention:.3g} of "
        f"{prof.peak_tflops:g} TFLOP/s, {e.overhead_s * 1e3:.3g} ms per action, collectives "
        f"{e.collectives:.3g} and pipeline sends {e.p2p:.3g} of the links' peak; {e.source}"
    )
    print(f"checked: {prof.checked}\n")


def _titan(refit: bool) -> int:
    """torchtitan's published H100 runs against the h100-80gb profile (fitted on two)."""
    prof = profile("h100-80gb")
    if refit:
        prof = prof.with_efficiency(fit_h100(prof))
    _print_profile(prof)
    print(
        f"{'cell':<38} {'tok/s/GPU':>9} {'predicted':>9} {'error':>7}   "
        f"{'GiB':>5} {'alloc':>6} {'+slack':>6} {'error':>7}"
    )
    for r in titan_rows(prof):
        mark = "tok/s fitted" if r["fitted"] else ("held out" if r["compiled"] else "eager")
        mem = "" if r["published_gib"] is None else (
            f"{r['published_gib']:>5.1f} {r['predicted_gib']:>6.1f} {r['reserved_gib']:>6.1f} "
            f"{r['reserved_error']:>+7.1%}" + ("  (slack read here)" if r["slack_fitted"] else "")
        )  # fmt: skip
        print(
            f"{r['cell']:<38} {r['published_tps']:>9.1f} {r['predicted_tps']:>9.1f} "
            f"{r['tps_error']:>+7.1%}   {mem:<40} {mark}"
        )
    print(f"\nallocator slack: {allocator_slack():.1%} of the activations ({SLACK_CELL.label})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
