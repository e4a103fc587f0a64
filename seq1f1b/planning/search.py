"""The search: every (pp, tp, cp, fsdp, schedule, stages per rank, K, split, recompute) that
the GPUs and the model allow, each priced (:mod:`seq1f1b.planning.pricing`), ranked into a
:class:`~seq1f1b.planning.plan_types.Plan`.

Why its own module: the search enumerates and batches (the orders built once, replayed
together by :func:`~seq1f1b.planning.batch_simulate.simulate_graphs`); what one setting costs
is the pricing's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from .._runtime.ir import Action
from ..orders.order import OrderSpec, build_orders
from ..registry import REGISTRY, ScheduleEntry, lookup
from ..schedules.partition import ModelShape, resolve_split, segment_multiple
from .batch_simulate import OrderGraph, simulate_graphs
from .costmodel import ActionCosts, Hardware
from .plan_types import BF16, Candidate, Filters, Plan, Setting, Trainer, tie_groups
from .pricing import Order, _order, _SettingModel, order_key, runs_whole

__all__ = ["DEFAULT_CHUNKS", "STAGES_PER_RANK", "schedule_points", "search"]

DEFAULT_CHUNKS = (1, 2, 4, 8, 16, 32)


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

    ``trainer`` (:class:`~seq1f1b.planning.plan_types.Trainer`): which settings compute in
    bf16 (``dtype_bytes`` activations) and which in fp32 (4-byte activations,
    ``hardware.fp32_throughput``), and whether FSDP wraps at degree 1. ``actions``:
    calibrated per-action constants replacing the hardware figures
    (:mod:`seq1f1b.planning.calibration`, or a GPU profile's, :mod:`seq1f1b.planning.profiles`).
    ``error``: the time model's relative error and where it comes from; candidates closer than
    it are ranked as ties (:func:`~seq1f1b.planning.plan_types.tie_groups`). ``blocking_p2p``:
    price Megatron-LM's blocking sends and receives (:func:`~seq1f1b.planning.pricing.price`);
    orders with split backwards or replicas are skipped then. ``selective``: also price
    torchtitan's selective activation checkpointing (attention's output kept: its policy keeps
    torch's attention kernels, and the integration's the compiled chunk-aware attention, what
    the planner's TOML runs), except with K > 1 under context parallelism, whose ring runs
    eager kernels per hop (their kept outputs not modelled): those settings are skipped.
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
    unpriced_ac: set[str] = set()  # torch's zero-bubble schedules asked with AC (not priced)
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
                            if entry is not None and entry.torch_weight_half:
                                kept = [(rc, sel) for rc, sel in modes if not (rc or sel)]
                                if len(kept) < len(modes):
                                    unpriced_ac.add(entry.name)
                                modes = kept
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
    for name in sorted(unpriced_ac):
        skipped.append(
            f"{name} with activation checkpointing: not priced (torch's weight half recomputes "
            "each checkpointed block once per weight group, 5.1x the weight half and 1.29x "
            "the uncheckpointed peak measured by the dry run; docs/upstream_hooks.md 11)"
        )
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
    after the loop, and their orders, each built once (:func:`~seq1f1b.planning.pricing._order`)
    and compiled to an :class:`OrderGraph` shared by the settings using it.

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
        self.orders: dict[tuple[str, int, int, int, int, bool], Order | str] = {}
        self.graphs: dict[tuple[str, int, int, int, int, bool], OrderGraph | None] = {}
        self.plain: dict[OrderSpec, OrderGraph | None] = {}  # by _chunked_graph
        self.seconds: dict[tuple, Callable[[Action], float]] = {}  # _SettingModel's cost_tables
        self.jobs: list[tuple[OrderGraph, list[float], list[float]]] = []
        # per job: its model, its group, its slot in cands and its place in skipped
        self.pending: list[tuple[_SettingModel, int, int, int]] = []

    def order(self, setting: Setting) -> tuple[Order | str | None, OrderGraph | None]:
        """The setting's graph (None: price it through simulate) and, without one, its order
        (None without a pipeline) or why it has none. Each order is compiled once, from the
        order without split backwards where that applies (:meth:`_chunked_graph`)."""
        entry = setting.entry
        if entry is None:
            return None, None
        key = order_key(setting)
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
        where that does not apply or fails: :func:`~seq1f1b.planning.pricing._order` builds it
        then, or says why not."""
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
        if graph is None or not spec.split_backward or runs_whole(setting):
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
