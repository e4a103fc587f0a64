"""The dry run's per-rank table and its picture (memory along each rank's order)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from .step import RankReport

__all__ = ["UNSEEN", "format_holders", "format_reports", "plot_memory"]

GIB = 2.0**30

#: what a dry run cannot see, and how large it may be (printed under every table)
UNSEEN = (
    "not seen: compiled graphs (inductor fuses elementwise ops: eager activations and "
    "temporaries are an upper bound, often 10-30% above compiled), the caching allocator's "
    "fragmentation (reserved 5-15% above allocated), NCCL buffers and the CUDA context (1-3 "
    "GB; the planner's reserve), communication time (the planner prices it)"
)


def format_reports(reports: Sequence[RankReport], title: str = "") -> str:
    """One row per rank: peak memory by kind (GiB; MiB at debug sizes), whether it fits the
    GPU less the planner's
    reserve, estimated device time per step and per unit, and host time per unit here."""
    if not reports:
        return "(no ranks)"
    gpu = reports[0].gpu
    kinds = [name for name, _ in reports[0].peak.items()]
    small = max(r.peak.total for r in reports) < GIB  # a debug size: MiB
    unit, scale = ("MiB", 2.0**20) if small else ("GiB", GIB)
    head = ["rank", "schedule", *kinds, f"peak {unit}", f"fits {gpu.name}", "device ms/step",
            "device ms/unit", "host ms/unit"]  # fmt: skip
    rows = []
    for r in reports:
        units = max(r.n_units, 1)
        fwd_bwd = [a for a in r.actions if a.label.split()[-1][0] in "FBW"]
        host_unit = sum(a.host_s for a in fwd_bwd) / units
        rows.append([f"rank {r.rank}", r.schedule,
                     *(f"{v / scale:.2f}" for _, v in r.peak.items()),
                     f"{r.peak.total / scale:.2f}",
                     "yes" if r.fits else "NO", f"{r.device_s * 1e3:.1f}",
                     f"{r.device_s * 1e3 / units:.2f}", f"{host_unit * 1e3:.1f}"])  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    out = [title] if title else []
    out += [line(head), *(line(r) for r in rows),
            f"(reserve {gpu.profile.reserve_gb:g} GB of {gpu.profile.memory_gb:g} GB; host time: "
            "this CPU running fake kernels, a bound on the Python per unit)", UNSEEN]  # fmt: skip
    return "\n".join(out)


_LAYER = re.compile(r"\.\d+(?=[. ]|$)")


def format_holders(report: RankReport, top: int = 15) -> str:
    """What held ``report``'s rank's memory at its peak (``dry_run_rank(holders=True)``): the
    ``top`` largest groups of live storages, one kind, maker, shape and dtype each, a layer's
    number read as ``*`` so that the same tensor of every layer is one row."""
    if report.holders is None:
        raise ValueError("this report holds no holders: dry_run_rank(..., holders=True)")
    held, holders = report.holders
    groups: dict[tuple, list[int]] = {}
    for h in holders:
        key = (h.kind, _LAYER.sub(".*", h.made_by), h.shape, h.dtype)
        group = groups.setdefault(key, [0, 0])
        group[0] += h.count
        group[1] += h.nbytes
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    small = held < GIB
    unit, scale = ("MiB", 2.0**20) if small else ("GiB", GIB)
    out = [f"rank {report.rank}: what held {held / scale:.2f} {unit} on the way to its peak "
           f"({report.peak.total / scale:.2f} {unit}), the {len(rows)} largest groups:"]
    for (kind, made_by, shape, dtype), (count, nbytes) in rows:
        what = made_by or "(tracked from outside: the model's and the optimizer's tensors)"
        out.append(f"  {nbytes / scale:9.2f} {unit}  {kind:<10} {count:5d} x "
                   f"{tuple(shape)} {dtype}  {what}")  # fmt: skip
    return "\n".join(out)


def plot_memory(runs: Mapping[str, Sequence[RankReport]], path: str) -> str:
    """Each rank's memory at the end of every action, along its own order, one panel per rank
    with one line per schedule (``runs``: schedule label -> its reports). Needs matplotlib (the
    ``bench`` extra); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r.rank for reports in runs.values() for r in reports})
    fig, axes = plt.subplots(len(ranks), 1, figsize=(9, 2.4 * len(ranks)), squeeze=False)
    for ax, rank in zip(axes[:, 0], ranks, strict=True):
        for label, reports in runs.items():
            for r in reports:
                if r.rank == rank:
                    xs = [i / max(len(r.actions) - 1, 1) for i in range(len(r.actions))]
                    ax.step(xs, [a.memory / GIB for a in r.actions], where="post",
                            label=f"{label} (peak {r.peak.total / GIB:.1f} GiB)")  # fmt: skip
        ax.set_title(f"rank {rank}", fontsize=9)
        ax.set_ylabel("GiB held")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("position in the rank's order (each action's end)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
