"""Which pipeline / tensor-parallel / FSDP degrees, seq_chunks K, microbatches M, split and
activation checkpointing to use for a model, a sequence length and a set of GPUs.

    python -m seq1f1b.planning.planner --model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80

Why: K trades bubble and activation memory (both shrink with K) against kernel efficiency, and
it interacts with every other degree: more TP saves memory but pays collectives, more PP adds
bubble that K removes, recomputation buys memory with a third more compute. Each setting is
priced by running its real schedule order through the simulator (:mod:`seq1f1b.planning.simulate`)
with per-unit times and memory from :mod:`seq1f1b.planning.costmodel`, then the settings that fit
are ranked by predicted tokens per second per GPU.

Each setting is priced as its trainer runs it (:class:`Trainer`: what runs in bf16, whether
FSDP wraps at degree 1): bf16 needs something that casts, and a trainer that casts only through
FSDP's mixed-precision policy trains PP or TP without FSDP in fp32, with twice the activation
bytes and fp32 matmul throughput. This module's command prices for :data:`BF16` (bf16 weights,
FSDP only at degree > 1); the torchtitan releases' trainers, and the complete TOML of the top
plan, are the integration's (``python -m torchtitan_integration.planner``, same arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from .._runtime import ir as rt
from .._runtime.ir import Action
from ..orders.order import OrderSpec, build_orders
from ..registry import REGISTRY, ScheduleEntry, is_baseline, lookup
from ..schedules.partition import ModelShape, resolve_split, segment_multiple
from .batch_simulate import OrderGraph, simulate_graphs
from .calibration import load_action_costs, load_calibration
from .costmodel import (
    FP32_SLOWDOWN,
    GB,
    PRESETS,
    ActionCosts,
    Hardware,
    MemoryModel,
    TimeModel,
    action_work,
    fsdp_exposed_seconds,
)
from .fitting import cpu_profile, held_out_errors, largest_error
from .profiles import (
    CPU_NOMINAL_TFLOPS,
    PROFILES,
    GpuProfile,
    calibrated_profile,
    machine_spec,
    profile,
)
from .saved import FUSED, SavedTensors
from .saved import PROFILES as PROFILES_SAVED
from .simulate import simulate, simulate_blocking

__all__ = [
    "BF16",
    "Candidate",
    "Filters",
    "Plan",
    "Setting",
    "Trainer",
    "build_parser",
    "collection_paused",
    "kv_prefix_deltas",
    "main",
    "price",
    "problem_from_args",
    "search",
]

DEFAULT_CHUNKS = (1, 2, 4, 8, 16, 32)
Order = dict[int, list[Action | None]]
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
    """What the caller restricted :func:`search` to (None: every value), kept with the plan so
    that its comparisons tell "excluded by your filters" from "none fits": with
    ``--pp 2 --schedules Seq1F1B`` no plain 1F1B and no setting without pipelining is priced,
    which says nothing about whether one would fit."""

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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_problem(shape: ModelShape, seq_len: int, tp: int, cp: int) -> str | None:
    if shape.n_kv_heads % tp:
        return f"tp={tp} does not divide the {shape.n_kv_heads} KV heads"
    if seq_len % segment_multiple(tp, cp):
        return (
            f"tp={tp} x cp={cp} does not divide seq_len {seq_len} (sequence parallel, and "
            f"2*cp load-balanced chunks)"
        )
    return None


#: stages per rank tried for schedules that take several (looped placement)
STAGES_PER_RANK = (1, 2, 4)


def schedule_points(
    shape: ModelShape, pp: int, names: Iterable[str] | None = None
) -> tuple[list[tuple[ScheduleEntry, int]], list[str]]:
    """Every (registry entry, stages per rank) that can cut ``shape`` over ``pp`` ranks; and
    why the others cannot."""
    wanted = None if names is None else {lookup(n).name for n in names}
    points: list[tuple[ScheduleEntry, int]] = []
    why: list[str] = []
    for entry in REGISTRY:
        if wanted is not None and entry.name not in wanted:
            continue
        hi = entry.max_stages_per_rank
        for v in STAGES_PER_RANK:
            if v < entry.min_stages_per_rank or (hi is not None and v > hi):
                continue
            n = entry.model_stages(pp, v)
            if n < 1 or shape.n_layers % n:
                why.append(
                    f"pp={pp} {entry.name} v={v}: {n} stages do not divide the "
                    f"{shape.n_layers} layers"
                )
                continue
            points.append((entry, v))
    return points, why


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (restored after), for the command line
    only (a library call leaves the process's collector alone): :func:`search` builds millions
    of actions, tuples the collector tracks (they hold an enum), and a full collection, due
    every ~10^5 new ones, walks every live object of torch's import (two fifths of the
    paper-7B search's time). The search makes no cycles to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search(
    shape: ModelShape,
    seq_len: int,
    hardware: Hardware,
    global_batch: int,
    *,
    pp: Iterable[int] | None = None,
    tp: Iterable[int] | None = None,
    cp: Iterable[int] | None = (1,),
    chunks: Sequence[int] = DEFAULT_CHUNKS,
    splits: Sequence[str] = ("compute", "uniform"),
    recompute: Sequence[bool] = (False, True),
    selective: bool = False,
    min_segment: int = 4096,
    dtype_bytes: int = 2,
    state_bytes_per_param: float = 16.0,
    trainer: Trainer = BF16,
    schedules: Iterable[str] | None = None,
    actions: ActionCosts | None = None,
    error: tuple[float, str] | None = None,
    blocking_p2p: bool = False,
) -> Plan:
    """Price every (pp, tp, cp, fsdp, schedule, stages per rank, K, split, recompute) on
    ``hardware.gpus`` GPUs; rank them.

    Schedules: every entry of :data:`seq1f1b.registry.REGISTRY` (or those in ``schedules``),
    with 1, 2 or 4 stages per rank where the entry takes them and the layers divide; K > 1
    for sequence-chunked entries, K = 1 for the others. ``global_batch`` sequences per step;
    each of the ``fsdp`` data-parallel pipelines runs ``M = global_batch / fsdp``
    microbatches of one sequence (BitPipe's two replicas take half each). ``cp``: context-
    parallel degrees to try (None: every divisor); each sequence is sharded over ``cp`` ranks,
    which FSDP also shards the model state over (torchtitan's mesh). K > 1 only with a
    pipeline, and only with segments of at least ``min_segment`` tokens on average: short
    segments cost real kernels more than their FLOPs (a calibrated ``actions`` prices that).

    ``trainer`` (:class:`Trainer`): which settings compute in bf16 (``dtype_bytes``
    activations) and which in fp32 (4-byte activations, ``hardware.fp32_throughput``), and
    whether FSDP wraps at degree 1. ``actions``: calibrated per-action
    constants replacing the hardware figures (:mod:`seq1f1b.planning.calibration`, or a GPU
    profile's, :mod:`seq1f1b.planning.profiles`). ``error``: the time model's relative error
    and where it comes from; candidates closer than it are ranked as ties (:func:`tie_groups`).
    ``blocking_p2p``: price Megatron-LM's blocking sends and receives (:func:`price`); orders
    with split backwards or replicas are skipped then. ``selective``: also price torchtitan's
    selective activation checkpointing (attention's output kept: its policy keeps torch's
    attention kernels, and the integration's the compiled chunk-aware attention, what the
    planner's TOML runs), except with K > 1 under context parallelism, whose ring runs eager
    kernels per hop (their kept outputs not modelled): those settings are skipped.
    """
    if global_batch < 1 or seq_len < 1 or hardware.gpus < 1:
        raise ValueError(
            f"global_batch={global_batch}, seq_len={seq_len} and gpus={hardware.gpus} must all "
            "be >= 1"
        )
    if hardware.budget_bytes <= 0:
        raise ValueError(
            f"gpu memory {hardware.memory_gb} GB leaves nothing after the {hardware.reserve_gb} "
            "GB reserve: raise --gpu-memory-gb or lower --reserve-gb"
        )
    allowed_pp = set(pp) if pp is not None else None
    allowed_tp = set(tp) if tp is not None else None
    allowed_cp = set(cp) if cp is not None else None
    names = list(schedules) if schedules is not None else None
    cands: list[Candidate | None] = []  # None: a slot _Batch.finish fills
    skipped: list[str] = []
    sac_on_ring = False  # selective AC asked for K > 1 with cp > 1 (not priced)
    batch = _Batch(compile=not blocking_p2p)
    for p in _divisors(hardware.gpus):
        if allowed_pp is not None and p not in allowed_pp:
            continue
        if shape.n_layers % p:
            skipped.append(f"pp={p}: does not divide the {shape.n_layers} layers")
            continue
        if p > 1:
            points, why = schedule_points(shape, p, names)
            skipped += why
        else:
            points = [(None, 1)]
        for t in _divisors(hardware.gpus // p):
            if allowed_tp is not None and t not in allowed_tp:
                continue
            for c in _divisors(hardware.gpus // (p * t)):
                if allowed_cp is not None and c not in allowed_cp:
                    continue
                problem = _tp_problem(shape, seq_len, t, c)
                fsdp = hardware.gpus // (p * t * c)
                if problem is None and global_batch % fsdp:
                    problem = f"fsdp={fsdp} does not divide the global batch {global_batch}"
                if problem:
                    skipped.append(f"pp={p} tp={t} cp={c}: {problem}")
                    continue
                m = global_batch // fsdp
                bf16 = trainer.runs_in_bf16(p, t, fsdp * c)
                for entry, v in points:
                    chunked = entry is not None and entry.seq_chunked
                    for k in sorted({1, *chunks}):
                        if chunked != (k > 1) or (k > 1 and seq_len / k < min_segment):
                            continue
                        for split in splits if k > 1 else ("uniform",):
                            try:
                                lengths = resolve_split(
                                    split, seq_len, k, shape=shape,
                                    multiple_of=segment_multiple(t, c),
                                )  # fmt: skip
                            except ValueError as exc:
                                skipped.append(f"pp={p} tp={t} cp={c} K={k} {split}: {exc}")
                                continue
                            name = entry.name if entry is not None else ""
                            modes = [(rc, False) for rc in recompute]
                            if selective and (k == 1 or c == 1):
                                modes.append((False, True))
                            elif selective:
                                sac_on_ring = True
                            # MLA's latent K/V cache: K > 1, without TP and CP (as it runs)
                            caches = (
                                (False, True)
                                if shape.latent_kv and k > 1 and t == c == 1
                                else (False,)
                            )
                            batch.group += 1
                            for (rc, sel), lat in itertools.product(modes, caches):
                                setting = Setting(
                                    p, t, fsdp, k, m, split, rc, bf16, name, v, c, sel, lat
                                )
                                order, graph = batch.order(setting)
                                if isinstance(order, str):
                                    skipped.append(f"{setting.label()}: {order}")
                                    break
                                try:
                                    model = _SettingModel.build(
                                        setting, lengths, shape, hardware, dtype_bytes,
                                        state_bytes_per_param, global_batch * seq_len,
                                        trainer.fsdp_at_every_degree, actions,
                                        blocking_p2p=blocking_p2p, cost_tables=batch.seconds,
                                        loss_chunks=trainer.loss_chunks,
                                        saved=trainer.saved,
                                    )  # fmt: skip
                                    if graph is None or model.holds_after_backward:
                                        if graph is not None:  # the replay takes no deltas
                                            order = _order(setting, batch.orders)
                                        cands.append(model.candidate(*model.simulate(order)))
                                    else:  # simulated with the others after the loop
                                        batch.add(model, graph, len(cands), len(skipped))
                                        cands.append(None)
                                except ValueError as exc:  # blocking P2P: F and B orders only
                                    skipped.append(f"{setting.label()}: {exc}")
                                    break
    if sac_on_ring:
        skipped.append(
            "selective AC with K > 1 and cp > 1: not priced (the ring attention runs eager "
            "kernels per hop, whose outputs torchtitan's policy keeps; not modelled)"
        )
    priced = batch.finish(cands, skipped)
    priced.sort(
        key=lambda c: (not c.fits, -c.tokens_per_second_per_gpu, c.setting.seq_chunks, c.max_bytes)
    )
    err = error or (Plan.error, Plan.error_source)
    fitting = [c for g in tie_groups([c for c in priced if c.fits], err[0]) for c in g]
    return Plan(
        shape,
        seq_len,
        hardware,
        global_batch,
        fitting + [c for c in priced if not c.fits],
        skipped,
        error=err[0],
        error_source=err[1],
        trainer=trainer,
        time_model="hardware" if actions is None else actions.source,
        filters=Filters(
            _narrowing(allowed_pp, hardware.gpus),
            _narrowing(allowed_tp, hardware.gpus),
            _narrowing(allowed_cp, hardware.gpus),
            None if names is None else frozenset(lookup(n).name for n in names),
            frozenset(recompute),
        ),
    )


def _narrowing(allowed: set[int] | None, gpus: int) -> frozenset[int] | None:
    """``allowed`` degrees as a filter, None where they leave out no divisor of ``gpus``."""
    if allowed is None or set(_divisors(gpus)) <= allowed:
        return None
    return frozenset(allowed)


class _Batch:
    """The settings of one :func:`search` whose orders :func:`simulate_graphs` replays together
    after the loop, and their orders, each built once (:func:`_order`) and compiled to an
    :class:`OrderGraph` shared by the settings using it.

    A compiled order's Action lists are not kept (a search's orders hold millions of actions);
    a setting whose graph the replay does not take gets its order built again
    (:meth:`finish`). ``compile``: False prices every setting through
    :meth:`_SettingModel.simulate` (blocking sends, which OrderGraph does not model).

    ``group`` numbers the loop's groups of settings (one split of one K): as the loop stops a
    group at its first setting that cannot be priced, :meth:`finish` drops the group's later
    settings after a failure.
    """

    def __init__(self, compile: bool) -> None:
        self.compile = compile
        self.group = 0
        self.orders: dict[tuple[str, int, int, int, int], Order | str] = {}
        self.graphs: dict[tuple[str, int, int, int, int], OrderGraph | None] = {}
        self.plain: dict[OrderSpec, OrderGraph | None] = {}  # by _chunked_graph
        self.seconds: dict[tuple, Callable[[Action], float]] = {}  # _SettingModel's cost_tables
        self.jobs: list[tuple[OrderGraph, list[float], list[float]]] = []
        # per job: its model, its group, its slot in cands and its place in skipped
        self.pending: list[tuple[_SettingModel, int, int, int]] = []

    def order(self, setting: Setting) -> tuple[Order | str | None, OrderGraph | None]:
        """The setting's graph (None: price it through simulate) and, without one, its order
        (None without a pipeline) or why it has none. Each order is compiled once, from the
        order without split backwards where that applies (:meth:`_chunked_graph`)."""
        entry, s = setting.entry, setting
        if entry is None:
            return None, None
        key = (entry.name, s.pp, s.stages_per_rank, s.microbatches, s.seq_chunks)
        if self.compile and key not in self.graphs:
            graph = self._chunked_graph(setting)
            if graph is None:
                order = _order(setting, self.orders)
                if isinstance(order, str):
                    return order, None
                graph = OrderGraph.build(order, replicas=entry.replicas, **_classes(setting))
            self.graphs[key] = graph
            if graph is not None:
                self.orders.pop(key, None)  # the graph replaces the Action lists
        graph = self.graphs.get(key)
        return (None, graph) if graph is not None else (_order(setting, self.orders), None)

    def _chunked_graph(self, setting: Setting) -> OrderGraph | None:
        """The graph of a looped sequence-chunked entry's order from the order without split
        backwards, built once for Seq1F1B (or InterleavedSeq1F1B) and ZBSeq1F1B, whose order is
        that one with its backwards split (:func:`seq1f1b.orders.order.rank_order`). None
        where that does not apply or fails: :func:`_order` builds it then, or says why not."""
        entry, s = setting.entry, setting
        if entry is None or not entry.seq_chunked or entry.placement != "looped":
            return None
        try:
            entry.check_stages_per_rank(s.stages_per_rank)
            spec = entry.order_spec(s.pp, s.microbatches, s.seq_chunks, s.stages_per_rank)
        except ValueError:
            return None
        plain = replace(spec, split_backward=False)
        if plain not in self.plain:
            try:
                order = build_orders(plain)
            except (ValueError, AssertionError, RuntimeError):
                self.plain[plain] = None
            else:
                self.plain[plain] = OrderGraph.build(order, **_classes(setting))
        graph = self.plain[plain]
        if graph is None or not spec.split_backward:
            return graph
        return graph.split_backward()

    def add(self, model: _SettingModel, graph: OrderGraph, slot: int, at: int) -> None:
        self.jobs.append(model.graph_job(graph))
        self.pending.append((model, self.group, slot, at))

    def finish(self, cands: list[Candidate | None], skipped: list[str]) -> list[Candidate]:
        """Replay the jobs, fill their slots in ``cands``; a job the replay does not take runs
        through simulate, and if that raises, its text goes into ``skipped`` where the loop
        would have put it. Returns the candidates in loop order."""
        timings = simulate_graphs(self.jobs)
        failed: list[tuple[int, str]] = []
        broken: set[int] = set()
        for (model, group, slot, at), timing in zip(self.pending, timings, strict=True):
            if group in broken:
                continue
            if timing is not None:
                cands[slot] = model.candidate(
                    timing.makespan, timing.bubble_ratio, timing.peak_activation_rank,
                    timing.stage_to_rank,
                )  # fmt: skip
                continue
            try:
                order = _order(model.setting, {})
                assert not isinstance(order, str)  # it was built before
                cands[slot] = model.candidate(*model.simulate(order))
            except ValueError as exc:
                failed.append((at, f"{model.setting.label()}: {exc}"))
                broken.add(group)
        for at, text in reversed(failed):
            skipped.insert(at, text)
        return [c for c in cands if c is not None]


def _classes(setting: Setting) -> dict[str, object]:
    """OrderGraph's action classes for the setting's callbacks: its actions' seconds and
    bytes depend on the stage's position (first, last chunk of the model), the computation and
    the segment (unit % K)."""
    entry, s = setting.entry, setting
    assert entry is not None
    n = entry.model_stages(s.pp, s.stages_per_rank)
    position = [(g % n == 0) + 2 * (g % n == n - 1) for g in range(s.pp * s.stages_per_rank)]
    return {"period": s.seq_chunks, "stage_class": position}


def _order(setting: Setting, cache: dict) -> Order | str | None:
    """The setting's per-rank compute order (None without a pipeline), or why it has none."""
    entry = setting.entry
    if entry is None:
        return None
    s = setting
    key = (entry.name, s.pp, s.stages_per_rank, s.microbatches, s.seq_chunks)
    if key not in cache:
        try:
            cache[key] = entry.compute_orders(
                setting.pp, setting.microbatches, setting.seq_chunks, setting.stages_per_rank
            )
        except (ValueError, AssertionError, RuntimeError) as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            cache[key] = f"no order ({text})"
    return cache[key]


def price(
    setting: Setting,
    shape: ModelShape,
    seq_len: int,
    hardware: Hardware,
    *,
    global_batch: int | None = None,
    dtype_bytes: int = 2,
    state_bytes_per_param: float = 16.0,
    fsdp_wrapped: bool = False,
    actions: ActionCosts | None = None,
    extra_layer_bytes: float = 0.0,
    blocking_p2p: bool = False,
    kv_prefix_copy: bool = False,
    saved: SavedTensors = FUSED,
    loss_chunks: int = LOSS_CHUNKS,
) -> Candidate:
    """Price one setting (what :func:`search` does for each): its schedule's real order
    simulated with per-action seconds, memory per rank along that order. ValueError when the
    schedule has no order for it. ``extra_layer_bytes``: what a trainer saves per token per
    layer beyond the formula (:class:`~seq1f1b.planning.costmodel.MemoryModel`).
    ``blocking_p2p``: simulate Megatron-LM's blocking sends and receives
    (:func:`~seq1f1b.planning.simulate.simulate_blocking`) instead of torch's posted-ahead
    ones. ``kv_prefix_copy``: with K > 1, the trainer keeps a concatenated copy of each
    microbatch's K/V prefix and the prefix's K/V gradient between its segments' backwards
    (:func:`kv_prefix_deltas`). ``saved``: what the trainer's blocks save where trainers
    differ (:mod:`seq1f1b.planning.saved`); ``loss_chunks``: the chunks of a sequence its
    loss runs in (:attr:`Trainer.loss_chunks`)."""
    k = setting.seq_chunks
    lengths = resolve_split(
        setting.split if k > 1 else "uniform", seq_len, k, shape=shape,
        multiple_of=segment_multiple(setting.tp, setting.cp),
    )  # fmt: skip
    order = _order(setting, {})
    if isinstance(order, str):
        raise ValueError(f"{setting.label()}: {order}")
    batch = global_batch if global_batch is not None else setting.microbatches * setting.fsdp
    model = _SettingModel.build(
        setting, lengths, shape, hardware, dtype_bytes, state_bytes_per_param, batch * seq_len,
        fsdp_wrapped, actions, extra_layer_bytes, blocking_p2p, kv_prefix_copy,
        loss_chunks=loss_chunks, saved=saved,
    )  # fmt: skip
    return model.candidate(*model.simulate(order))


def kv_grad_deltas(lengths: Sequence[int]) -> list[int]:
    """Tokens of K/V gradient (per layer) that segment ``j``'s backward leaves held, for the
    library's chunk-aware attention (:attr:`~seq1f1b.planning.saved.SavedTensors.
    kv_cache_by_reader`): the last segment's backward leaves gradients on the cached K/V of
    every earlier segment (later backwards add into them in place), and each earlier
    segment's backward takes its own into its graph and frees it. Sums to zero per sample."""
    k = len(lengths)
    if k == 1:
        return [0]
    return [-n for n in lengths[:-1]] + [sum(lengths[:-1])]


def kv_prefix_deltas(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Tokens of K/V (per layer) that segment ``j``'s forward adds, and that its backward
    adds once its own activations are freed, for a trainer that, like the Seq1F1B paper's
    fork (``FlashAttnVarlenFunc`` in its megatron/model/transformer.py), concatenates each
    segment's K/V onto a per-microbatch prefix copy (the first segment's K/V is the prefix
    itself, no copy), keeps that copy until the microbatch's first segment's backward, and
    between two segments' backwards keeps the gradient of the whole prefix up to the later
    one (a view of it holds the buffer). Forward ``j`` adds ``P_1`` for ``j = 1`` and ``s_j``
    after; backward ``j`` adds back its forward's share and moves the held gradient from
    ``P_{j+1}`` to ``P_j`` (``P_j``: tokens of segments ``0..j``); the first segment's
    backward frees the copy and the gradient. The deltas sum to zero over a microbatch."""
    k = len(lengths)
    prefix = [sum(lengths[: j + 1]) for j in range(k)]
    if k == 1:
        return [0], [0]
    added = [0, prefix[1], *lengths[2:]]
    held = [0, *prefix[1:], 0]  # gradient held after backward j; none before the last's
    after = [added[j] + held[j] - held[j + 1] for j in range(k)]
    after[0] -= prefix[-1]  # the copy goes with the first segment's backward
    return added, after


@dataclass(frozen=True)
class _SettingModel:
    """One setting's time and memory models and its per-action callbacks: what :func:`price`
    and the search build before simulating the order; it turns the simulation into a
    Candidate after."""

    setting: Setting
    lengths: list[int]
    shape: ModelShape
    hardware: Hardware
    tokens_per_step: int
    time: TimeModel
    memory: MemoryModel
    layers: int
    model_stages: int
    seconds: Callable[[Action], float]
    saved: Callable[[Action], float]
    after_backward: Callable[[Action], float]
    blocking_p2p: bool
    kv_prefix_copy: bool
    #: memory changes after backwards (``after_backward``) to simulate: the prefix copy's, or
    #: the K/V gradients the cache holds; the batched replay does not take them
    holds_after_backward: bool = False

    @classmethod
    def build(
        cls,
        setting: Setting,
        lengths: list[int],
        shape: ModelShape,
        hardware: Hardware,
        dtype_bytes: int,
        state_bytes_per_param: float,
        tokens_per_step: int,
        fsdp_at_degree_1: bool,
        actions: ActionCosts | None = None,
        extra_layer_bytes: float = 0.0,
        blocking_p2p: bool = False,
        kv_prefix_copy: bool = False,
        cost_tables: dict[tuple, Callable[[Action], float]] | None = None,
        loss_chunks: int = LOSS_CHUNKS,
        saved: SavedTensors = FUSED,
    ) -> _SettingModel:
        """The models of ``setting``; ``cost_tables``: the seconds callbacks built so far, by
        what they depend on (settings of a search share them: the schedules with as many model
        stages, for one)."""
        p, k, c = setting.pp, setting.seq_chunks, setting.cp
        entry = setting.entry
        n = entry.model_stages(p, setting.stages_per_rank) if entry is not None else 1
        layers = shape.n_layers // n
        dtype_bytes = dtype_bytes if setting.bf16 else 4  # fp32 activations and TP collectives
        if actions is not None and not setting.bf16 and actions.precision == "bf16":
            # bf16 kernels' constants (a GPU profile's): fp32 runs on the fp32 units
            actions = replace(actions.scaled(FP32_SLOWDOWN), precision="fp32")
        # pp is the mesh's outermost dimension: the pipeline crosses nodes once the world does
        link = hardware.link_gbps(hardware.gpus) if p > 1 else None
        p2p = None if link is None else link * hardware.p2p_efficiency
        time = TimeModel(
            hardware, shape, setting.tp, setting.recompute, layers, dtype_bytes, setting.bf16,
            actions, c, p2p, selective=setting.selective, fused_qkv=fsdp_at_degree_1,
            latent_kv=setting.latent_kv,
        )  # fmt: skip
        memory = MemoryModel(
            shape,
            setting.tp,
            setting.fsdp * c,  # torchtitan's FSDP shards over the data-parallel and CP ranks
            setting.recompute,
            dtype_bytes,
            state_bytes_per_param,
            pipelined=p > 1,
            fsdp_wrapped=fsdp_at_degree_1,
            # the loss in chunks: always for a trainer that wraps FSDP at every degree
            # (Trainer.fsdp_at_every_degree), and under the Seq1F1B schedules (K > 1)
            loss_chunk_tokens=(
                -(-sum(lengths) // loss_chunks) if fsdp_at_degree_1 or k > 1 else None
            ),
            extra_layer_bytes=extra_layer_bytes,
            selective=setting.selective,
            fused_qkv=fsdp_at_degree_1,  # Trainer.fsdp_at_every_degree: Q, K, V fused
            latent_kv=setting.latent_kv,
            saved=saved,
        )
        table_key = (time, tuple(lengths), n, k, not blocking_p2p)
        seconds = None if cost_tables is None else cost_tables.get(table_key)
        if seconds is None:
            seconds = time.cost(lengths, n, seq_chunks=k, sends=not blocking_p2p)
            if cost_tables is not None:
                cost_tables[table_key] = seconds
        segmented = k > 1

        # K/V bytes per token of one stage's layers (what a K/V prefix copy costs)
        kv_bytes = layers * 2 * dtype_bytes * shape.n_kv_heads * shape.head_dim / (setting.tp * c)
        kv_added, kv_after = [0] * k, [0] * k
        if kv_prefix_copy:
            kv_added, kv_after = kv_prefix_deltas(lengths)
        elif saved.kv_cache_by_reader and segmented:
            kv_after = kv_grad_deltas(lengths)
        by_reader = saved.kv_cache_by_reader

        def saved_bytes(a: Action) -> float:
            pos = a.stage_index % n
            j = (a.microbatch_index or 0) % k
            tokens = lengths[j] / c
            held = memory.unit_bytes(tokens, layers, pos == n - 1, segmented, first=pos == 0,
                                     cached=j < k - 1 or not by_reader)  # fmt: skip
            return held + kv_added[j] * kv_bytes

        # torch 2.15 holds each backward's sent input gradient to the step's end
        sent = dtype_bytes * shape.hidden / (setting.tp * c) if saved.backward_sends_held else 0.0

        def after_backward(a: Action) -> float:
            j = (a.microbatch_index or 0) % k
            held = lengths[j] * sent if a.stage_index % n else 0.0
            return kv_after[j] * kv_bytes + held

        return cls(
            setting, lengths, shape, hardware, tokens_per_step, time, memory, layers, n,
            seconds, saved_bytes, after_backward, blocking_p2p, kv_prefix_copy,
            any(kv_after) or (sent > 0 and n > 1),
        )  # fmt: skip

    def simulate(
        self, order: Order | None
    ) -> tuple[float, float, dict[int, float], dict[int, int]]:
        """(makespan, bubble, peak activation bytes per rank, stage -> rank) of ``order``."""
        setting, entry, seconds, saved = self.setting, self.setting.entry, self.seconds, self.saved
        if self.blocking_p2p and entry is not None and entry.replicas > 1:
            raise ValueError("blocking communication is modelled for one pipeline only")
        if order is None:  # gradient accumulation over M sequences, no pipeline
            one = Action(0, rt.FORWARD, 0)
            back = Action(0, rt.FULL_BACKWARD, 0)
            return (
                setting.microbatches * (seconds(one) + seconds(back)),
                0.0,
                {0: saved(one)},
                {0: 0},
            )
        after = self.after_backward if self.holds_after_backward else None
        if self.blocking_p2p:
            k, lengths, time = setting.seq_chunks, self.lengths, self.time
            pair = setting.stages_per_rank > 1  # Megatron's interleaved steady phase
            res = simulate_blocking(
                order, seconds, activation=saved, pair_steady=pair,
                transfer=lambda a: time.p2p_seconds(lengths[(a.microbatch_index or 0) % k]),
                after_backward=after,
            )  # fmt: skip
        else:
            replicas = entry.replicas if entry else 1
            res = simulate(
                order, seconds, activation=saved, replicas=replicas, after_backward=after
            )
        return res.makespan, res.bubble_ratio, res.peak_activation_rank, res.stage_to_rank

    def graph_job(self, graph: OrderGraph) -> tuple[OrderGraph, list[float], list[float]]:
        """``graph`` with this setting's seconds and activation bytes per action class, for
        :func:`~seq1f1b.planning.batch_simulate.simulate_graphs`."""
        reps = graph.representatives
        costs = [float(self.seconds(a)) for a in reps]
        sizes = [float(self.saved(a)) if a.computation_type == rt.FORWARD else 0.0 for a in reps]
        return graph, costs, sizes

    def candidate(
        self,
        makespan: float,
        bubble: float,
        peak_act: Mapping[int, float],
        stage_to_rank: Mapping[int, int],
    ) -> Candidate:
        """The Candidate of a simulated order: FSDP's exposed time, memory per rank."""
        setting, memory, layers, n = self.setting, self.memory, self.layers, self.model_stages
        lengths, c = self.lengths, setting.cp
        makespan += _fsdp_seconds(setting, self.shape, self.hardware, layers, n, self.seconds)
        parts = []
        unit = max(lengths) / c
        for r in range(setting.pp):
            mine = [g for g, rank in stage_to_rank.items() if rank == r]
            state = sum(memory.state_bytes(layers, g % n == 0, g % n == n - 1) for g in mine)
            transient = max((memory.transient_bytes(unit, g % n == n - 1, g % n == 0)
                             for g in mine), default=0)  # fmt: skip
            parts.append((state, peak_act.get(r, 0.0), transient))
        seq_len = sum(lengths)
        flops = action_work(self.shape, self.shape.n_layers, True, seq_len, seq_len)
        comm_share = self.time.tp_comm_share(flops.linear + flops.attention, seq_len)
        return Candidate(
            setting,
            list(lengths),
            bubble,
            makespan,
            self.tokens_per_step / (makespan * self.hardware.gpus),
            [sum(p) for p in parts],
            self.hardware.budget_bytes,
            comm_share,
            parts,
        )


def _fsdp_seconds(
    setting: Setting,
    shape: ModelShape,
    hardware: Hardware,
    layers: int,
    model_stages: int,
    seconds: Callable[[Action], float],
) -> float:
    """FSDP traffic the compute cannot hide on rank 0 (its stages' parameters, after TP),
    over the FSDP x CP group: torchtitan's mesh puts it inside ``fsdp * cp * tp`` ranks."""
    shards = setting.fsdp * setting.cp
    span = shards * setting.tp
    stages = setting.stages_per_rank if setting.pp > 1 else 1
    first_and_last = model_stages == 1
    params = stages * layers * shape.params_per_layer + shape.vocab * shape.hidden * (
        1 + int(first_and_last)
    )
    return fsdp_exposed_seconds(
        params / setting.tp,
        shards,
        hardware.link_gbps(span),
        stages * layers,
        pipelined=setting.pp > 1,
        microbatches=setting.microbatches,
        forward=seconds(Action(0, rt.FORWARD, 0)),
        backward=seconds(Action(0, rt.FULL_BACKWARD, 0)),
    )


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


def build_parser(
    prog: str = "python -m seq1f1b.planning.planner", trainers: Sequence[Trainer] = (BF16,)
) -> argparse.ArgumentParser:
    """The planner's arguments (shared with ``python -m torchtitan_integration.planner``);
    ``--precision`` names one of ``trainers``, the first by default."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Search pipeline / tensor-parallel / FSDP degrees, seq_chunks K, "
        "microbatches, split and activation checkpointing for a model, sequence length and "
        "GPUs; prints the ranked settings with the reason for each.",
    )
    ap.add_argument("--model", choices=sorted(PRESETS), help="a preset shape (or give the widths)")
    ap.add_argument("--hidden", type=int, help="model width H")
    ap.add_argument("--heads", type=int, help="attention heads")
    ap.add_argument(
        "--kv-heads", type=int, help="KV heads (grouped-query attention; default: heads)"
    )
    ap.add_argument("--layers", type=int, help="transformer blocks")
    ap.add_argument("--vocab", type=int, help="vocabulary size")
    ap.add_argument("--ffn-hidden", type=int, help="FFN width (default 4*hidden)")
    ap.add_argument("--gated-ffn", action="store_true", help="SwiGLU FFN (three matrices)")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in total")
    ap.add_argument(
        "--gpu",
        choices=[*sorted(PROFILES), "cpu"],
        help="GPU profile (seq1f1b/planning/profiles.py): specifications and fitted efficiencies "
        "for the time model, the GPU's memory; replaces --tflops and --tp-gbps. 'cpu': the "
        "machine measured in --calibration FILE (the same as --calibration alone)",
    )
    ap.add_argument(
        "--gpu-memory-gb", type=float, help="memory per GPU (1e9 B); required without --gpu"
    )
    ap.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step (default 2 x GPUs)"
    )
    ap.add_argument("--pp", help="comma-separated pipeline degrees to consider (default: all)")
    ap.add_argument("--tp", help="comma-separated tensor-parallel degrees (default: all)")
    ap.add_argument(
        "--cp",
        default="1",
        help="comma-separated context-parallel degrees, or 'all' (default: 1, no CP)",
    )
    ap.add_argument(
        "--schedules",
        help="comma-separated registry schedules to consider (default: every one: "
        + ", ".join(e.name for e in REGISTRY)
        + ")",
    )
    ap.add_argument(
        "--calibration",
        help="JSON of measured actions and per-action constants (python -m "
        "benchmarks.planner_models.time_costs) replacing the --tflops time model",
    )
    ap.add_argument(
        "--calibration-model",
        choices=("efficiency", "per-action"),
        default="efficiency",
        help="with --calibration (no GPU profile): 'efficiency' fits the measured machine's "
        "profile (linear and attention efficiencies of a nominal --tflops, overhead per action) "
        "to its measured actions, as the GPU profiles are fitted; 'per-action' prices with the "
        "file's separate forward/backward least-squares constants",
    )
    ap.add_argument(
        "--chunks",
        default=",".join(map(str, DEFAULT_CHUNKS)),
        help="comma-separated seq_chunks K to consider (segments per sequence)",
    )
    ap.add_argument("--split", choices=("compute", "uniform", "both"), default="both")
    ap.add_argument(
        "--ac",
        choices=("none", "selective", "full", "both", "all"),
        default="both",
        help="activation checkpointing to consider: both = none and full; all adds torchtitan's "
        "selective (op-level) AC (not with K > 1 and cp > 1)",
    )
    ap.add_argument(
        "--min-segment",
        type=int,
        default=4096,
        help="shortest average segment (tokens) to consider",
    )
    ap.add_argument(
        "--reserve-gb", type=float, help="memory kept free per GPU (default: the profile's, or 4)"
    )
    ap.add_argument(
        "--tflops",
        type=float,
        help="achieved bf16 TFLOP/s per GPU (assumed-constants time model; default 400)",
    )
    ap.add_argument(
        "--tp-gbps",
        type=float,
        help="achieved TP collective bandwidth, GB/s (assumed-constants time model; default 300)",
    )
    ap.add_argument(
        "--fp32-tflops",
        type=float,
        help="achieved fp32 TFLOP/s per GPU, for settings that run in fp32 (default: --tflops / "
        "15, the bf16-to-fp32 peak ratio of H100 and A100 with TF32 off, torch's default)",
    )
    ap.add_argument(
        "--precision",
        choices=[t.name for t in trainers],
        default=trainers[0].name,
        help="the trainer, for what runs in bf16: "
        + ", ".join(f"'{t.name}' ({t.summary})" for t in trainers),
    )
    ap.add_argument(
        "--saved-tensors",
        choices=sorted(PROFILES_SAVED),
        help="what the trainer's blocks save for the backward where trainers differ "
        "(seq1f1b/planning/saved.py; default: the trainer's own, 'fused' for all shipped): "
        "'torch-eager-cuda' (torch's eager ops with torchtitan's TP plan: the all-gathered "
        "sequence-parallel matmul inputs, the backward's temporaries), 'torch-compiled' "
        "(compiled blocks), 'torch-eager-cpu' (what the dry run sees)",
    )
    ap.add_argument(
        "--p2p",
        choices=("posted", "blocking"),
        default="posted",
        help="pipeline sends and receives: 'posted' (torch.distributed.pipelining posts each "
        "receive ahead of the action that needs it) or 'blocking' (Megatron-LM's batched "
        "send/receive that waits for both neighbours, as the Seq1F1B paper ran; F/B orders only)",
    )
    ap.add_argument("--top", type=int, default=12, help="rows to print")
    ap.add_argument("--json", action="store_true", help="print the ranked settings as JSON")
    return ap


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers (got {text!r})") from None


def _calibrated(a: argparse.Namespace) -> GpuProfile:
    """The measured machine's profile from ``--calibration``: efficiencies fitted to its
    measured actions by the GPU profiles' fit (:func:`~seq1f1b.planning.fitting.cpu_profile`),
    or with ``--calibration-model per-action`` the file's per-kind constants."""
    costs, samples = load_calibration(a.calibration)
    spec = machine_spec(
        a.gpu_memory_gb,
        tflops=CPU_NOMINAL_TFLOPS if a.tflops is None else a.tflops,
        tp_gbps=300.0 if a.tp_gbps is None else a.tp_gbps,
        reserve_gb=4.0 if a.reserve_gb is None else a.reserve_gb,
        source=costs.source,
    )
    if a.calibration_model == "per-action":
        prof = calibrated_profile(costs, spec)
        error, error_source = largest_error(held_out_errors(spec, samples, per_action=True))
        eff = replace(prof.efficiency, error=error, error_source=error_source)
        return prof.with_efficiency(eff)
    if not samples:
        raise ValueError(
            f"{a.calibration} holds no measured actions to fit a profile on: write it again "
            "with python -m benchmarks.planner_models.time_costs, or plan with its per-kind "
            "constants (--calibration-model per-action)"
        )
    return cpu_profile(samples, spec)


def _hardware_from_args(
    a: argparse.Namespace,
) -> tuple[Hardware, ActionCosts | None, tuple[float, str] | None]:
    """The GPUs the arguments describe: a profile's (``--gpu``), or the assumed constants."""
    if a.gpu == "cpu" and not a.calibration:
        raise ValueError("--gpu cpu is the machine a calibration measured: give --calibration")
    if a.gpu in (None, "cpu") and a.calibration:
        if a.gpu_memory_gb is None:
            raise ValueError("--calibration needs --gpu-memory-gb (the measured machine's)")
        prof = _calibrated(a)
        hw = replace(prof.hardware(a.gpus), fp32_tflops=a.fp32_tflops)
        actions = replace(prof.action_costs(), source=f"calibrated ({prof.efficiency.source})")
        return hw, actions, (prof.efficiency.error, prof.efficiency.error_source)
    if a.gpu is None:
        if a.gpu_memory_gb is None:
            raise ValueError("give --gpu (one of " + ", ".join(sorted(PROFILES)) + ") or "
                             "--gpu-memory-gb with the assumed --tflops / --tp-gbps")  # fmt: skip
        reserve = 4.0 if a.reserve_gb is None else a.reserve_gb
        tflops = 400.0 if a.tflops is None else a.tflops
        tp_gbps = 300.0 if a.tp_gbps is None else a.tp_gbps
        return (
            Hardware(a.gpus, a.gpu_memory_gb, reserve, tflops, tp_gbps, a.fp32_tflops),
            None,
            None,
        )
    if a.tflops is not None or a.tp_gbps is not None:
        raise ValueError("--gpu sets the time model: drop --tflops / --tp-gbps, or drop --gpu")
    prof = profile(a.gpu)
    hw = prof.hardware(a.gpus, a.reserve_gb)
    if a.gpu_memory_gb is not None:
        hw = replace(hw, memory_gb=a.gpu_memory_gb)
    if a.fp32_tflops is not None:
        hw = replace(hw, fp32_tflops=a.fp32_tflops)
    eff = prof.efficiency
    return hw, prof.action_costs(), (eff.error, eff.error_source)


def problem_from_args(
    a: argparse.Namespace, trainers: Sequence[Trainer] = (BF16,)
) -> tuple[str | None, Plan]:
    """Run the search the arguments describe (``--precision`` one of ``trainers``); returns
    (preset name or None, plan)."""
    widths = (a.hidden, a.heads, a.layers, a.vocab)
    if a.model:
        if any(w is not None for w in (*widths, a.kv_heads, a.ffn_hidden)):
            raise ValueError("give either --model or the widths (--hidden ...), not both")
        shape = PRESETS[a.model]
    elif None in widths:
        raise ValueError(
            "give --model (one of " + ", ".join(sorted(PRESETS)) + ") or all of --hidden, "
            "--heads, --layers and --vocab"
        )
    else:
        shape = ModelShape(
            a.hidden,
            a.heads,
            a.layers,
            a.vocab,
            ffn_hidden=a.ffn_hidden,
            n_kv_heads=a.kv_heads,
            gated_ffn=a.gated_ffn,
        )
    hw, actions, error = _hardware_from_args(a)
    if a.calibration and a.gpu not in (None, "cpu"):  # a GPU's specifications, measured constants
        costs = load_action_costs(a.calibration)
        actions = replace(costs, source=f"calibrated ({costs.source})")
        error = None
    schedules = [x.strip() for x in a.schedules.split(",") if x.strip()] if a.schedules else None
    for name in schedules or ():
        lookup(name)  # an unknown name fails with the known ones listed
    plan = search(
        shape,
        a.seq_len,
        hw,
        a.global_batch or 2 * a.gpus,
        pp=_ints(a.pp, "--pp"),
        tp=_ints(a.tp, "--tp"),
        cp=None if a.cp == "all" else _ints(a.cp, "--cp"),
        schedules=schedules,
        actions=actions,
        chunks=_ints(a.chunks, "--chunks") or [1],
        splits=("compute", "uniform") if a.split == "both" else (a.split,),
        recompute={"none": (False,), "full": (True,), "selective": ()}.get(a.ac, (False, True)),
        selective=a.ac in ("selective", "all"),
        min_segment=a.min_segment,
        trainer=_trainer_with(a, trainers),
        error=error,
        blocking_p2p=a.p2p == "blocking",
    )
    if not plan.candidates:
        raise ValueError(
            "no setting to price: " + ("; ".join(plan.skipped) or "check --pp/--tp/--chunks")
        )
    return a.model, plan


def _trainer_with(a: argparse.Namespace, trainers: Sequence[Trainer]) -> Trainer:
    """The trainer ``--precision`` names, with the saved tensors ``--saved-tensors`` names."""
    trainer = _trainer_named(a.precision, trainers)
    if a.saved_tensors is not None:
        trainer = replace(trainer, saved=PROFILES_SAVED[a.saved_tensors])
    return trainer


def _trainer_named(name: str, trainers: Sequence[Trainer]) -> Trainer:
    for trainer in trainers:
        if trainer.name == name:
            return trainer
    raise ValueError(f"--precision {name!r}: use one of {', '.join(t.name for t in trainers)}")


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


def main(argv: Sequence[str] | None = None, trainers: Sequence[Trainer] = (BF16,)) -> int:
    """The command: the ranked table (or ``--json``) for the trainers ``--precision`` names."""
    a = build_parser(trainers=trainers).parse_args(argv)
    try:
        with collection_paused():
            preset, plan = problem_from_args(a, trainers)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        best = plan.best
        doc = {
            "recommended": {**asdict(best), "fits": True} if best else None,
            "candidates": [{**asdict(c), "fits": c.fits} for c in plan.candidates[: a.top]],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(describe(preset, plan))
    print(format_plan(plan, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
