"""The Seq1F1B schedules: sequence-level 1F1B over (sample, segment) units.

One class per schedule, each giving its per-rank compute order in closed form
(``_calculate_single_rank_operations``, as torch's schedules do); everything they share is in
:class:`~seq1f1b.schedules.sequence_schedule.SequencePipelineSchedule`. A segment attends to the K/V
of the earlier segments of its sample (:mod:`seq1f1b.attention.layer`), which is why every order
runs a sample's forwards 0..K-1 and its backwards K-1..0 (:mod:`seq1f1b.orders.order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._runtime import Action, PipelineStageBase
from ..orders.order import rank_order
from ..orders.order_v import v_rank_order
from .sequence_schedule import SequencePipelineSchedule

__all__ = [
    "ScheduleInterleavedSeq1F1B",
    "ScheduleSeq1F1B",
    "ScheduleZBSeq1F1B",
    "ScheduleZBVSeq1F1B",
]


class ScheduleSeq1F1B(SequencePipelineSchedule):
    """Seq1F1B: 1F1B over (sample, sequence segment) units with ordered K/V dependencies.

    Args (positional as in the class proposed to torch, :mod:`seq1f1b.schedules.upstream`;
    what this package adds is keyword-only):
        stages: this rank's stages: one, or several in looped placement (stage s on rank
            s % pp), which gives the interleaved order.
        n_microbatches: M, samples along the batch dim (dim 0).
        seq_chunks: K, segments per sample along ``seq_dim``.
        loss_fn: as in torch's schedules; with ``scale_grads=True`` it must be a mean over
            tokens (e.g. cross entropy), and each unit is weighted by its token share.
        args_chunk_spec, kwargs_chunk_spec, output_merge_spec: how inputs are split into
            samples and outputs merged, as in torch's schedules (each sample is then cut
            along ``seq_dim``).
        scale_grads: as in torch's schedules.
        seq_dim: sequence dimension of inputs, targets, per-token kwargs and activations.
        seq_split: how each sample is cut (torch's ``seq_split``, which takes fixed lengths):
            a :class:`~seq1f1b.schedules.options.SequenceSplit` (mode, model shape, multiple,
            fixed length), or its mode alone ("uniform", the default; "compute" needs the model
            shape; or explicit lengths).
        backward_requires_autograd, defer_pp_recv: as in torch's schedules.
        max_active_stages, unshard_lookahead, defer_reduce_grad_wait, max_outstanding_sends:
            torch 2.15's runtime options, as in its ``ScheduleInterleaved1F1B``, at its
            defaults; older torch runs at those and refuses any other value.
        context_parallel: a :class:`~seq1f1b.schedules.options.ContextParallelConfig` to shard
            each segment over a CP group (ring attention, see
            :mod:`seq1f1b.attention.context_parallel`).
        ignore_index: target value that does not count as a token (as in cross entropy).
        kwargs_seq_dims: per kwarg, the dim to split along the sequence, or None to pass it
            whole to every segment. Default: ``seq_dim`` for every tensor kwarg.
        check_attention: the first step checks the model, raising on every rank before any
            optimizer step: plain SDPA inside a unit, positions mixed outside the chunk-aware
            attention, and each stage's outputs for one sample against the stage run over the
            whole sequence (also after the sequence length changes;
            :mod:`seq1f1b.schedules.output_check`). False turns these checks off.
        skip_invisible: with packed documents / sliding windows, skip (query, key) blocks that
            share no visible pair and cache only what later segments see; False computes every
            block under the mask and caches every segment (the mask-alone baseline).
        loss_reduction: "mean" (default): ``loss_fn`` averages over its tokens; each unit is
            weighted by its token share and the gradients are those of the batch's mean.
            "sum": ``loss_fn`` sums over its tokens; units are not weighted nor the gradients
            scaled, so they are those of the sum over the step's tokens (not with
            ``context_parallel``). A sum loss under "mean" (``reduction="sum"`` declared, or
            found at the first step: its value on a unit is the sum of its halves') is refused
            on every rank, never trained with gradients M*K times too small.
        backward_send_waits: "consumed" (default): each unit's input gradient sent upstream
            is waited for, and freed, right after the first action of this rank that
            consumes a message the peer sent after receiving it (no stall: its arrival is
            proven); "end": torch 2.15's placement, every backward send held to the step's
            end (a unit's input gradient per unit on every stage but the first). torch 2.13
            and 2.14 wait for sends in their own way; a ``max_outstanding_sends`` budget
            places the waits itself (torch's lowering).

    ``loss_fn`` must take ``(output, target)`` (checked at construction); the rank that holds
    the last stage must get the target (checked before any traffic, on every rank). A failure
    during a step raises on every rank, naming the failing rank and its error
    (:class:`seq1f1b._runtime.StepFailures`; the pipeline group is unusable afterwards).

    Each step may have its own sequence length (and its own split). A tiny all-reduce per
    step (pp > 1) lets middle stages, which get no input, learn the length and makes bad
    input on any rank fail every rank before pipeline traffic.
    """

    def _calculate_single_rank_operations(self, rank: int) -> list[Action | None]:
        return self._runnable(rank_order(self.order_spec, rank))


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """Seq1F1B-I: several stages per rank (looped placement), rounds of whole samples.

    ``ScheduleSeq1F1B`` already interleaves when given several stages; this name exists so
    that configs can ask for the interleaved variant explicitly, and it insists on >= 2 stages.
    """

    def __init__(self, stages: Sequence[PipelineStageBase], *args: Any, **kwargs: Any) -> None:
        if isinstance(stages, PipelineStageBase) or len(stages) < 2:
            raise ValueError(
                "ScheduleInterleavedSeq1F1B needs >= 2 stages per rank (looped placement): "
                "build pp * v stages, or use ScheduleSeq1F1B for one stage per rank"
            )
        super().__init__(stages, *args, **kwargs)


class ScheduleZBSeq1F1B(SequencePipelineSchedule):
    """Zero-bubble Seq1F1B: the Seq1F1B order with each backward split into its input half
    (sent upstream at once) and its weight half (see :func:`seq1f1b.orders.order.split_backward`).

    Same arguments as :class:`ScheduleSeq1F1B`, one or several stages per rank; the cached K/V
    gradients stay exact because the attention accumulates them itself. Activation
    checkpointing must be non-reentrant (its recomputation then runs in BACKWARD_INPUT). On
    compiled blocks each backward runs whole (torch cannot split a compiled backward; split,
    it would run twice): the order is then Seq1F1B's.
    """

    _split_backward = True
    # Seq1F1B's order; the runtime splits each backward (order.split_backward)
    _calculate_single_rank_operations = ScheduleSeq1F1B._calculate_single_rank_operations


class ScheduleZBVSeq1F1B(SequencePipelineSchedule):
    """Zero-bubble Seq1F1B on the V placement (ZB-V): rank ``r`` holds stages ``r`` and
    ``2*pp-1-r`` of ``2*pp``, so rank 0 holds the first and the last stage, and each backward
    is split into its input half and its weight half (the first stage keeps full backwards).

    Same arguments as :class:`ScheduleSeq1F1B`, with exactly two stages per rank in that
    placement (torch's ``style="v"``, as for ``ScheduleZBVZeroBubble``). The order is ZB-V's
    with the backwards shifted by ``K - 1`` units (:mod:`seq1f1b.orders.order_v`); stage ``s`` holds
    at most ``min(M*K, 2*pp - 1 - s + K)`` units
    (:func:`seq1f1b.orders.order_v.v_stage_peak_units`).
    Activation checkpointing must be non-reentrant (its recomputation then runs in
    BACKWARD_INPUT). Any ``n_microbatches`` works; ``M*K + K - 1 >= 2*pp - 1`` keeps ZB-V's
    warm-up full. On compiled blocks each backward runs whole, as in ZBSeq1F1B.
    """

    _split_backward = True
    _placement = "v"

    def _calculate_single_rank_operations(self, rank: int) -> list[Action | None]:
        return self._runnable(v_rank_order(self.order_spec, rank))
