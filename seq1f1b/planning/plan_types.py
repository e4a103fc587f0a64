"""The planner's types: the trainer a plan is priced for, a setting of the search, what the
models predict for it, the search's filters and the plan, with the tie groups that rank it.

The bottom of the planner's parts (:mod:`seq1f1b.planning.planner` re-exports them): pricing,
search, reporting and the command line all speak these types, so they import nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..registry import ScheduleEntry, is_baseline, lookup
from ..schedules.partition import ModelShape
from .costmodel import GB, Hardware
from .saved import FUSED, SavedTensors

__all__ = [
    "BF16",
    "LOSS_CHUNKS",
    "TIE_RULE",
    "Candidate",
    "Filters",
    "Plan",
    "Setting",
    "Trainer",
    "tie_groups",
]

#: the chunks of a sequence the loss runs in by default (:attr:`Trainer.loss_chunks`)
LOSS_CHUNKS = 8


@dataclass(frozen=True)
class Trainer:
    """What the trainer that runs a plan does that its prices depend on.

    Args:
        name: how ``--precision`` names it.
        summary: the plan header's line about it.
        fp32_without_fsdp: bf16 only where FSDP shards the parameters (its mixed-precision
            policy casts them) or nothing is parallel (autocast); PP or TP without FSDP train
            in fp32.
        fsdp_at_every_degree: FSDP with its mixed-precision policy wraps the model at degree 1
            too (its unsharded copies, priced by :class:`~seq1f1b.planning.costmodel.MemoryModel`),
            the loss always runs in chunks, and the attention's Q, K and V projections are
            one fused matmul.
        loss_chunks: the chunks of a sequence the loss runs in (e.g. :class:`seq1f1b.ChunkedLoss`
            with ``num_chunks``): under K > 1, and always with ``fsdp_at_every_degree``.
        saved: what its blocks save for the backward where trainers differ (norms, gathered
            matmul inputs, the backward's temporaries: :mod:`seq1f1b.planning.saved`).
    """

    name: str
    summary: str
    fp32_without_fsdp: bool = False
    fsdp_at_every_degree: bool = False
    loss_chunks: int = LOSS_CHUNKS
    saved: SavedTensors = FUSED

    def runs_in_bf16(self, pp: int, tp: int, fsdp: int) -> bool:
        """Whether a setting of these degrees trains in bf16 (else fp32)."""
        return not self.fp32_without_fsdp or fsdp > 1 or (pp == 1 and tp == 1)


#: bf16 everywhere, FSDP only at degree > 1: a trainer that keeps bf16 weights (e.g.
#: Megatron-LM, whose published numbers the benchmarks compare with)
BF16 = Trainer("bf16", "bf16 everywhere, FSDP only at degree > 1")


@dataclass(frozen=True)
class Setting:
    """One point of the search: the degrees (pp x tp x cp x fsdp = GPUs), the schedule (a
    registry name) and its knobs."""

    pp: int
    tp: int
    fsdp: int
    seq_chunks: int
    microbatches: int  # M per pipeline per step (pp = 1: gradient-accumulation steps)
    split: str
    recompute: bool
    bf16: bool = True  # False: the trainer runs this setting in fp32 (Trainer.runs_in_bf16)
    name: str = ""  # registry schedule; "" = 1F1B, or Seq1F1B when seq_chunks > 1
    stages_per_rank: int = 1
    cp: int = 1  # context-parallel degree: each sequence sharded over cp ranks
    #: torchtitan's op-level selective activation checkpointing (``recompute`` is full AC)
    selective: bool = False
    #: the latent K/V cache (multi-head latent attention; ``[seq1f1b] kv_cache = "latent"``)
    latent_kv: bool = False

    def __post_init__(self) -> None:
        if self.recompute and self.selective:
            raise ValueError("activation checkpointing is full or selective, not both")

    @property
    def ac(self) -> str:
        """torchtitan's ``[activation_checkpoint] mode``: none, selective or full."""
        return "full" if self.recompute else "selective" if self.selective else "none"

    @property
    def schedule(self) -> str:
        """torchtitan's ``pipeline_parallel_schedule`` for this setting ("" without PP)."""
        if self.pp == 1:
            return ""
        return self.name or ("Seq1F1B" if self.seq_chunks > 1 else "1F1B")

    @property
    def entry(self) -> ScheduleEntry | None:
        return lookup(self.schedule) if self.pp > 1 else None

    def schedule_text(self) -> str:
        """The schedule with its knobs, e.g. ``InterleavedSeq1F1B v=2 K=4 compute``."""
        sched = self.schedule or "no PP"
        if self.stages_per_rank > 1 and self.entry and self.entry.placement == "looped":
            sched += f" v={self.stages_per_rank}"
        if self.seq_chunks > 1:
            sched += f" K={self.seq_chunks} {self.split}"
        return sched

    def label(self) -> str:
        ac = {"full": "full AC", "selective": "selective AC", "none": "no AC"}[self.ac]
        fp32 = "" if self.bf16 else ", fp32"
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        return (
            f"pp{self.pp} tp{self.tp}{cp} fsdp{self.fsdp} M={self.microbatches} "
            f"{self.schedule_text()}, {ac}{fp32}{', latent K/V' if self.latent_kv else ''}"
        )


@dataclass(frozen=True)
class Candidate:
    """A setting and what the models predict for it."""

    setting: Setting
    segment_lengths: list[int]
    bubble: float
    step_seconds: float
    tokens_per_second_per_gpu: float
    peak_bytes: list[float]  # per pipeline rank (GPU): model state + activation peak
    budget_bytes: float
    tp_comm_share: float
    #: per pipeline rank, the peak's (model state, activations, transient) bytes
    memory_parts: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def max_bytes(self) -> float:
        return max(self.peak_bytes)

    @property
    def worst_stage(self) -> int:
        return self.peak_bytes.index(self.max_bytes)

    @property
    def fits(self) -> bool:
        return self.max_bytes <= self.budget_bytes

    def why(self) -> str:
        """The one-line reason for its rank: what it costs in time and memory."""
        parts = []
        if not self.setting.bf16:
            parts.append("fp32 (bf16 needs FSDP)")
        if self.setting.pp > 1:
            parts.append(f"bubble {self.bubble:.1%}")
        if self.setting.tp > 1:
            parts.append(f"TP comm {self.tp_comm_share:.0%}")
        entry = self.setting.entry
        if entry is not None and entry.replicas > 1:
            parts.append(f"{entry.replicas} model replicas")
        if self.setting.recompute:
            parts.append("recompute +1 fwd")
        if self.setting.selective:
            parts.append("recompute every 2nd matmul")
        if self.setting.latent_kv:
            parts.append("latent K/V re-expanded per segment")
        mem = f"{self.max_bytes / GB:.1f}/{self.budget_bytes / GB:.0f} GB rank {self.worst_stage}"
        parts.append(mem if self.fits else f"does not fit: {mem}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Filters:
    """What the caller restricted :func:`~seq1f1b.planning.search.search` to (None: every
    value), kept with the plan so that its comparisons tell "excluded by your filters" from
    "none fits": with ``--pp 2 --schedules Seq1F1B`` no plain 1F1B and no setting without
    pipelining is priced, which says nothing about whether one would fit."""

    pp: frozenset[int] | None = None
    tp: frozenset[int] | None = None
    cp: frozenset[int] | None = frozenset({1})  # search's default: no context parallelism
    schedules: frozenset[str] | None = None  # registry names
    recompute: frozenset[bool] = frozenset({False, True})  # full AC off / on

    def flag(self, name: str) -> str:
        """The command-line flag and value that set filter ``name`` (search's keyword names
        them the same, ``recompute`` as ``--ac``)."""
        if name == "recompute":  # --ac selective prices neither off nor on (selective only)
            ac = {frozenset({True}): "full", frozenset({False}): "none"}
            return "--ac " + ac.get(self.recompute, "selective")
        values = getattr(self, name)
        return f"--{name} " + ",".join(str(v) for v in sorted(values))

    def given(self) -> list[str]:
        """The filters that narrow the search beyond its defaults, as flags."""
        default = Filters()
        names = ("pp", "tp", "cp", "schedules", "recompute")
        narrowed = [n for n in names if getattr(self, n) not in (None, getattr(default, n))]
        return [self.flag(n) for n in narrowed]

    def excluding(self, kind: str) -> list[str]:
        """The filters (as flags) that leave no setting of ``kind`` to price: "plain-pp" (plain
        1F1B, pp > 1), "no-pp" (pp = 1) or "no-ac" (no activation checkpointing)."""
        out = []
        if kind == "plain-pp":
            if self.pp is not None and all(p == 1 for p in self.pp):
                out.append(self.flag("pp"))
            if self.schedules is not None and not any(is_baseline(n) for n in self.schedules):
                out.append(self.flag("schedules"))
        elif kind == "no-pp" and self.pp is not None and 1 not in self.pp:
            out.append(self.flag("pp"))
        elif kind == "no-ac" and False not in self.recompute:
            out.append(self.flag("recompute"))
        return out


@dataclass(frozen=True)
class Plan:
    """Every setting searched, best first (fitting ones before the rest)."""

    shape: ModelShape
    seq_len: int
    hardware: Hardware
    global_batch: int
    candidates: list[Candidate]
    skipped: list[str] = field(default_factory=list)  # degree combinations ruled out, and why
    #: relative error of the time model: predictions closer than this are a tie
    error: float = 0.02
    error_source: str = "assumed (the --tflops constants are not checked against measurements)"
    trainer: Trainer = BF16  # the trainer the settings were priced for
    time_model: str = "hardware"  # where the per-action constants come from
    filters: Filters = Filters()  # what the search was restricted to

    @property
    def groups(self) -> list[list[Candidate]]:
        """The fitting candidates as tie groups, in rank order (:func:`tie_groups`)."""
        return tie_groups([c for c in self.candidates if c.fits], self.error)

    @property
    def best(self) -> Candidate | None:
        """The recommendation: the first of the fastest tie group (:data:`TIE_RULE`)."""
        groups = self.groups
        return groups[0][0] if groups else None

    def best_where(self, pred: object) -> Candidate | None:
        """The best fitting candidate whose setting satisfies ``pred`` (a callable)."""
        return next((c for c in self.candidates if c.fits and pred(c.setting)), None)  # type: ignore[operator]


#: how a tie group is ordered, as the output states it
TIE_RULE = "less memory (to 1 GB), then fewer ranks per stage (tp x cp), then no interleaving"


def _tie_key(c: Candidate) -> tuple[int, int, bool, float]:
    s = c.setting
    return (
        round(c.max_bytes / GB),
        s.tp * s.cp,
        s.stages_per_rank > 1,
        -c.tokens_per_second_per_gpu,
    )


def tie_groups(candidates: Sequence[Candidate], error: float) -> list[list[Candidate]]:
    """Candidates in groups the time model cannot tell apart: from the fastest left, every one
    predicted within ``error`` (relative) of it; each group ordered by :data:`TIE_RULE`."""
    rest = sorted(candidates, key=lambda c: -c.tokens_per_second_per_gpu)
    groups: list[list[Candidate]] = []
    while rest:
        floor = rest[0].tokens_per_second_per_gpu * (1 - error)
        group = [c for c in rest if c.tokens_per_second_per_gpu >= floor]
        rest = rest[len(group) :]
        groups.append(sorted(group, key=_tie_key))
    return groups
