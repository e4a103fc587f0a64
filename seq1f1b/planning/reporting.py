"""The plan as text: the header naming the model and the assumptions (:func:`describe`), the
ranked table with the recommendation and what it beats (:func:`format_plan`); both printed
by :func:`print_table`."""

from __future__ import annotations

from collections.abc import Callable

from ..registry import is_baseline
from .costmodel import GB
from .plan_types import TIE_RULE, Plan, Setting

__all__ = ["describe", "format_plan", "print_table"]

_AC_COLUMN = {"full": "full", "selective": "sel", "none": "none"}


def _is_baseline(s: Setting) -> bool:
    return s.pp > 1 and is_baseline(s.schedule)


def _none_because(plan: Plan, kind: str, pred: Callable[[Setting], bool]) -> str:
    """Why no setting of a comparison's ``kind`` is shown: the filters left none to price
    (which says nothing about whether one fits), none was priced for another reason (the
    search's skipped list), or the priced ones do not fit (within the filters, if any)."""
    excluding = plan.filters.excluding(kind)
    if excluding:
        return f"excluded by your filters ({' '.join(excluding)}), not priced"
    if not any(pred(c.setting) for c in plan.candidates):
        return "none priced (every such setting was skipped: see the plan's skipped list)"
    given = plan.filters.given()
    return "none fits" + (f" within your filters ({' '.join(given)})" if given else "")


def format_plan(plan: Plan, top: int = 12) -> str:
    """Ranked table (fitting settings first), the recommendation and what it beats."""
    hw = plan.hardware
    tie = {id(c): i for i, g in enumerate(plan.groups, 1) for c in g}
    lines = [
        f"{'#':>3}  {'tie':>3} {'pp':>2} {'tp':>2} {'cp':>2} {'fsdp':>4} {'M':>3} "
        f"{'schedule':<34} {'AC':<4} {'step s':>7} {'tok/s/GPU':>9}  why"
    ]
    for i, c in enumerate(plan.candidates[:top], 1):
        s = c.setting
        sched = s.schedule_text() if s.pp > 1 else "none (FSDP/TP/CP)"
        mark = "*" if c is plan.best else " "
        group = str(tie[id(c)]) if id(c) in tie else "-"
        lines.append(
            f"{i:>2}{mark}  {group:>3} {s.pp:>2} {s.tp:>2} {s.cp:>2} {s.fsdp:>4} "
            f"{s.microbatches:>3} {sched:<34} "
            f"{_AC_COLUMN[s.ac]:<4} {c.step_seconds:>7.2f} "
            f"{c.tokens_per_second_per_gpu:>9.0f}  {c.why()}"
        )
    lines.append(
        f"tie: rows of one group are predicted within {plan.error:.0%} of its fastest, the "
        f"time model's error ({plan.error_source}); inside a group: {TIE_RULE}"
    )
    n_fit = sum(c.fits for c in plan.candidates)
    lines.append(
        f"({n_fit} of {len(plan.candidates)} settings fit {hw.memory_gb:g} GB minus "
        f"{hw.reserve_gb:g} GB reserve; shown: the top {min(top, len(plan.candidates))})"
    )
    best = plan.best
    lines.append("")
    if best is None:
        low = min(plan.candidates, key=lambda c: c.max_bytes, default=None)
        lines.append(
            "No setting fits."
            + (f" The lowest is {low.max_bytes / GB:.1f} GB: {low.setting.label()}." if low else "")
            + " Use more GPUs, a shorter sequence, or check --reserve-gb."
        )
        return "\n".join(lines)
    lines.append(f"Recommendation (*): {best.setting.label()}")
    group = plan.groups[0]
    if len(group) > 1:
        fastest = max(group, key=lambda c: c.tokens_per_second_per_gpu)
        gain = fastest.tokens_per_second_per_gpu / best.tokens_per_second_per_gpu - 1
        lines.append(
            f"  first of a tie group of {len(group)}, and the fastest predicted"
            if fastest is best
            else f"  first of a tie group of {len(group)} (the fastest predicted, "
            f"{fastest.setting.label()}, is {gain:.1%} faster: less than the model's error)"
        )
    lines.append(
        f"  predicted {best.step_seconds:.2f} s per step of {plan.global_batch} x "
        f"{plan.seq_len} tokens, {best.tokens_per_second_per_gpu:.0f} tokens/s per GPU; "
        f"{best.why()}"
    )
    if best.setting.seq_chunks > 1:
        lines.append(f"  segment lengths {best.segment_lengths}")
    b = best.setting
    for name, kind, pred, applies in (
        ("the best plain 1F1B", "plain-pp", _is_baseline, b.pp > 1 and not _is_baseline(b)),
        ("the best without pipelining", "no-pp", lambda s: s.pp == 1, b.pp > 1),
        ("the best without recomputation", "no-ac", lambda s: s.ac == "none", b.ac != "none"),
    ):
        if not applies:
            continue
        other = plan.best_where(pred)
        if other is None:
            lines.append(f"  {name}: {_none_because(plan, kind, pred)}")
        elif other is not best:
            speed = best.tokens_per_second_per_gpu / other.tokens_per_second_per_gpu
            lines.append(
                f"  vs {name} ({other.setting.label()}): {speed:.2f}x its throughput, "
                f"{best.max_bytes / GB:.1f} vs {other.max_bytes / GB:.1f} GB"
            )
    return "\n".join(lines)


def describe(preset: str | None, plan: Plan) -> str:
    """The header naming the model and the assumptions."""
    s, hw = plan.shape, plan.hardware
    return (
        f"model {preset or 'custom'}: H={s.hidden} heads={s.n_heads} kv_heads={s.n_kv_heads} "
        f"layers={s.n_layers} vocab={s.vocab} ffn={s.ffn_hidden}"
        f"{' (gated)' if s.gated_ffn else ''}; seq_len {plan.seq_len}, global batch "
        f"{plan.global_batch} sequences, {hw.gpus} GPUs x {hw.memory_gb:g} GB\n"
        + (
            f"time model: {hw.tflops:g} TFLOP/s per GPU in bf16, {hw.fp32_throughput:.3g} in fp32, "
            if plan.time_model == "hardware"
            else f"time model: {plan.time_model}, "
        )
        + f"TP collectives at {hw.tp_gbps:.3g} GB/s"
        + (
            f", across nodes {hw.inter_node_gbps:.3g} GB/s (pipeline sends "
            f"{hw.inter_node_gbps * hw.p2p_efficiency:.3g})"
            if hw.inter_node_gbps is not None
            else ""
        )
        + "; memory and time formulas: "
        "seq1f1b/planning/costmodel.py\n"
        f"precision: {plan.trainer.summary}\n"
    )


def print_table(preset: str | None, plan: Plan, top: int) -> None:
    """The header (:func:`describe`) and the ranked table (:func:`format_plan`), printed."""
    print(describe(preset, plan))
    print(format_plan(plan, top))
