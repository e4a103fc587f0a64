"""Timeline pictures: one row per rank, one block per F/B/I/W labelled ``microbatch.segment``.

Why: a bubble ratio is one number; the picture shows where the idle time sits (warm-up,
drain, waiting on a costlier segment), as in the paper's schedule figure. The same drawing
serves simulated timelines (cost units) and measured ones (seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from seq1f1b.planning.simulate import SimResult

__all__ = ["Block", "Panel", "draw_panels", "measured_blocks", "simulated_blocks"]

_COLORS = {  # one shade per local stage (BitPipe has four: A's two, then B's two)
    "F": ("#9ecae1", "#4292c6", "#c6dbef", "#08519c"),
    "B": ("#fdae6b", "#e6550d", "#fdd0a2", "#a63603"),
    "I": ("#fdd0a2", "#fd8d3c", "#feedde", "#d94801"),
    "W": ("#c7e9c0", "#74c476", "#e5f5e0", "#238b45"),
}


@dataclass(frozen=True)
class Block:
    """One action drawn on row ``rank``; ``chunk`` = which of the rank's stages (0, 1, ...)."""

    rank: int
    start: float
    end: float
    kind: str
    label: str
    chunk: int = 0


@dataclass(frozen=True)
class Panel:
    """One schedule's timeline with its title."""

    title: str
    blocks: list[Block]
    n_ranks: int


def _unit_label(u: int, k: int) -> str:
    m, seg = divmod(u, k)
    return f"{m}.{seg}" if k > 1 else str(m)


def simulated_blocks(res: SimResult, seq_chunks: int = 1) -> list[Block]:
    """Blocks of a simulated timeline; units ``u`` are shown as ``m.k`` when K > 1."""
    ranks = sorted(res.timelines)
    out = []
    for r in ranks:
        local = sorted({iv.action.stage_index for iv in res.timelines[r]})
        for iv in res.timelines[r]:
            a = iv.action
            out.append(
                Block(
                    r,
                    iv.start,
                    iv.end,
                    a.computation_type.value,
                    _unit_label(a.microbatch_index or 0, seq_chunks),
                    local.index(a.stage_index),
                )
            )
    return out


def measured_blocks(trace: Sequence[dict[str, Any]]) -> list[Block]:
    """Blocks of a measured trace (see :mod:`benchmarks.harness.measured`), time from the first
    start."""
    if not trace:
        return []
    t0 = min(ev["start"] for ev in trace)
    stages: dict[int, list[int]] = {}
    for ev in trace:
        stages.setdefault(ev["rank"], [])
        if ev["stage"] not in stages[ev["rank"]]:
            stages[ev["rank"]].append(ev["stage"])
    return [
        Block(
            ev["rank"],
            ev["start"] - t0,
            ev["end"] - t0,
            ev["kind"],
            ev["unit"],
            sorted(stages[ev["rank"]]).index(ev["stage"]),
        )
        for ev in trace
    ]


def draw_panels(panels: Sequence[Panel], path: str, xlabel: str, width: float = 12.0) -> None:
    """Draw ``panels`` stacked, on one shared time axis, into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.45 + 0.3 * p.n_ranks for p in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, sum(heights) + 0.5),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    xmax = max((b.end for p in panels for b in p.blocks), default=1.0)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for b in panel.blocks:
            shades = _COLORS.get(b.kind, ("#cccccc", "#969696"))
            color = shades[min(b.chunk, len(shades) - 1)]
            ax.barh(
                b.rank,
                b.end - b.start,
                left=b.start,
                height=0.8,
                color=color,
                edgecolor="#333333",
                linewidth=0.3,
            )
            if (b.end - b.start) / xmax * width * 72 * 0.85 > 3.6 * len(b.label) + 3:
                ax.text(
                    (b.start + b.end) / 2,
                    b.rank,
                    b.label,
                    ha="center",
                    va="center",
                    fontsize=5.5,
                )
        ax.set_ylim(panel.n_ranks - 0.5, -0.5)
        ax.set_yticks(range(panel.n_ranks))
        ax.set_yticklabels([f"rank {r}" for r in range(panel.n_ranks)], fontsize=7)
        ax.set_title(panel.title, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, xmax * 1.01)
    axes[-1, 0].set_xlabel(xlabel, fontsize=8)
    kinds = {b.kind for p in panels for b in p.blocks}
    names = {"F": "forward", "B": "backward", "I": "backward input", "W": "backward weight"}
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=_COLORS[k][0], label=name)
        for k, name in names.items()
        if k in kinds
    ]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
