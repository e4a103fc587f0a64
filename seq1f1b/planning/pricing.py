"""Pricing one setting: its schedule's real order simulated with per-action seconds from the
time model, memory per rank along that order from the memory model, FSDP's exposed traffic.

:func:`price` prices one :class:`~seq1f1b.planning.plan_types.Setting`; the search
(:mod:`seq1f1b.planning.search`) builds the same :class:`_SettingModel` for each of its
settings and replays their orders together. The K/V deltas say what a trainer holds between a
sample's segments beyond its activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from .._runtime import ir as rt
from .._runtime.ir import Action
from ..orders.order import whole_backwards
from ..schedules.partition import ModelShape, resolve_split, segment_multiple
from .batch_simulate import OrderGraph
from .costmodel import (
    FP32_SLOWDOWN,
    ActionCosts,
    Hardware,
    MemoryModel,
    TimeModel,
    action_work,
    fsdp_exposed_seconds,
)
from .plan_types import LOSS_CHUNKS, Candidate, Setting
from .saved import FUSED, SavedTensors
from .simulate import simulate, simulate_blocking

__all__ = ["Order", "kv_grad_deltas", "kv_prefix_deltas", "price"]

Order = dict[int, list[Action | None]]


def runs_whole(setting: Setting) -> bool:
    """Whether the setting's zero-bubble order runs each backward whole: the Seq1F1B family's
    split backwards on checkpointed blocks (full or selective AC, which torchtitan wraps per
    block) run as full backwards (:func:`seq1f1b.orders.order.whole_backwards`)."""
    entry = setting.entry
    return bool(entry is not None and entry.seq_chunked and entry.split_backward
                and (setting.recompute or setting.selective))  # fmt: skip


def order_key(setting: Setting) -> tuple[str, int, int, int, int, bool]:
    """What a setting's compute order depends on (the caches' key)."""
    s, entry = setting, setting.entry
    assert entry is not None
    return (entry.name, s.pp, s.stages_per_rank, s.microbatches, s.seq_chunks, runs_whole(s))


def _order(setting: Setting, cache: dict) -> Order | str | None:
    """The setting's per-rank compute order as it runs (None without a pipeline; whole
    backwards where :func:`runs_whole`), or why it has none."""
    entry = setting.entry
    if entry is None:
        return None
    key = order_key(setting)
    if key not in cache:
        try:
            order = entry.compute_orders(
                setting.pp, setting.microbatches, setting.seq_chunks, setting.stages_per_rank
            )
        except (ValueError, AssertionError, RuntimeError) as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            cache[key] = f"no order ({text})"
        else:
            whole = runs_whole(setting)
            cache[key] = {r: whole_backwards(o) for r, o in order.items()} if whole else order
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
    """Price one setting (what :func:`~seq1f1b.planning.search.search` does for each): its
    schedule's real order simulated with per-action seconds, memory per rank along that
    order. ValueError when the schedule has no order for it. ``extra_layer_bytes``: what a
    trainer saves per token per layer beyond the formula
    (:class:`~seq1f1b.planning.costmodel.MemoryModel`). ``blocking_p2p``: simulate
    Megatron-LM's blocking sends and receives
    (:func:`~seq1f1b.planning.simulate.simulate_blocking`) instead of torch's posted-ahead
    ones. ``kv_prefix_copy``: with K > 1, the trainer keeps a concatenated copy of each
    microbatch's K/V prefix and the prefix's K/V gradient between its segments' backwards
    (:func:`kv_prefix_deltas`). ``saved``: what the trainer's blocks save where trainers
    differ (:mod:`seq1f1b.planning.saved`); ``loss_chunks``: the chunks of a sequence its loss
    runs in (:attr:`~seq1f1b.planning.plan_types.Trainer.loss_chunks`)."""
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

        # torch 2.15 holds each backward's sent input gradient to the step's end; the Seq1F1B
        # family waits for it once the peer has it (backward_send_waits="consumed", the
        # default): freed within a unit or two, not priced
        held_sends = saved.backward_sends_held and not (entry is not None and entry.seq_chunked)
        sent = dtype_bytes * shape.hidden / (setting.tp * c) if held_sends else 0.0

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
