"""ScheduleSeq1F1B: sequence-level 1F1B on torch.distributed.pipelining's runtime.

Each batch is split into ``n_microbatches`` samples along dim 0 and each sample into
``seq_chunks`` segments along ``seq_dim``; a (sample, segment) *unit* is what torch's runtime
calls a microbatch (index ``u = m * K + k``). The order (see :mod:`seq1f1b.order`) runs each
sample's segments forward 0..K-1 and backward K-1..0, which is what lets a segment attend to
the K/V of earlier segments (see :mod:`seq1f1b.attention`).

Everything else is torch's: lowering to send/recv, FSDP unshard/reshard, REDUCE_GRAD, gradient
scaling. The narrow additions, all scoped to one ``step()``:

* each stage's ``forward_one_chunk``/``backward_one_chunk`` is wrapped to activate the unit
  context and enforce the segment order (instance attributes, removed after the step);
* recv buffers are resized per unit when segments have different lengths;
* each unit's loss is weighted by its share of the batch's tokens, so uneven segments give the
  same loss and gradients as one full-sequence run with a mean loss.

Checked against torch 2.13 (the runtime internals used: ``_PipelineScheduleRuntime``,
``_RecvInfo`` buffers, ``_maybe_compute_loss``, ``_step_microbatches``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.pipelining.schedules import (
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.overrides import TorchFunctionMode

from .kv import SegmentInfo, StageKVState, UnitContext, activate
from .lowering import LoweredOrders, SendRecvLowering, is_lowerable
from .microbatch import count_tokens, merge_unit_outputs, split_target, split_units
from .order import OrderSpec, build_orders
from .partition import SPLIT_MODES, ModelShape, resolve_split, segment_offsets

__all__ = ["ScheduleInterleavedSeq1F1B", "ScheduleSeq1F1B"]

logger = logging.getLogger(__name__)

_F = _ComputationType.FORWARD
_B = _ComputationType.FULL_BACKWARD


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}): {fix}")
    return value


class _PlainAttentionGuard(TorchFunctionMode):
    """Fails fast when a model calls plain SDPA inside a chunked unit (wrong, not just slow)."""

    error: RuntimeError | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.error = RuntimeError(
                "ScheduleSeq1F1B with seq_chunks > 1: the model called "
                "torch.nn.functional.scaled_dot_product_attention directly, so a segment would "
                "not see the earlier segments' keys and values (silently wrong results). Route "
                "causal attention through seq1f1b.chunk_aware_attention / ChunkAwareAttention "
                "(or pass check_attention=False if this SDPA call is not over the sequence)."
            )
            raise self.error
        return func(*args, **(kwargs or {}))


def _check_order_rules(order: Mapping[int, Sequence[_Action | None]], k: int) -> None:
    """Raise ValueError if an order breaks Seq1F1B's rules (split backward, segment order)."""
    for rank, actions in order.items():
        next_f: dict[tuple[int, int], int] = {}
        next_b: dict[tuple[int, int], int] = {}
        for a in actions:
            if a is None:
                continue
            if a.computation_type not in (_F, _B):
                raise ValueError(
                    f"rank {rank}: action {a} is not FORWARD or FULL_BACKWARD. Seq1F1B needs a "
                    "full backward: a split backward (I/W) does not accumulate the cached K/V "
                    "gradients. Use 'F' and 'B' actions only."
                )
            m, seg = divmod(a.microbatch_index, k)
            key = (a.stage_index, m)
            if a.computation_type == _F:
                if seg != next_f.get(key, 0):
                    raise ValueError(
                        f"rank {rank}: {a} runs segment {seg} of sample {m} forward out of "
                        "order; forwards must go 0..K-1"
                    )
                next_f[key] = seg + 1
            else:
                if seg != next_b.get(key, k - 1):
                    raise ValueError(
                        f"rank {rank}: {a} runs segment {seg} of sample {m} backward out of "
                        "order; backwards must go K-1..0"
                    )
                next_b[key] = seg - 1


class ScheduleSeq1F1B(_PipelineScheduleRuntime):
    """Seq1F1B: 1F1B over (sample, sequence segment) units with ordered K/V dependencies.

    Args:
        stages: this rank's stages: one, or several in looped placement (stage s on rank
            s % pp), which gives the interleaved variant.
        n_microbatches: M, samples along the batch dim (dim 0).
        seq_chunks: K, segments per sample along ``seq_dim``.
        loss_fn: as in torch's schedules; with ``scale_grads=True`` it must be a mean over
            tokens (e.g. cross entropy), and each unit is weighted by its token share.
        seq_dim: sequence dimension of inputs, targets, per-token kwargs and activations.
        split: "uniform", "compute" (equal FLOPs; needs ``model_shape``) or explicit lengths.
        model_shape: transformer shape for ``split="compute"``.
        split_multiple_of: every segment length is a multiple of this (e.g. the TP degree).
        seq_len: sequence length, if known up front (validates the split at construction and
            saves a tiny all-reduce per step that tells middle stages the length).
        ignore_index: target value that does not count as a token (as in cross entropy).
        kwargs_seq_dims: per kwarg, the dim to split along the sequence, or None to pass it
            whole to every segment. Default: ``seq_dim`` for every tensor kwarg.
        check_attention: on the first step, raise if the model calls plain SDPA inside a unit.
    """

    def __init__(
        self,
        stages: _PipelineStageBase | Sequence[_PipelineStageBase],
        n_microbatches: int,
        seq_chunks: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        seq_dim: int = 1,
        split: str | Sequence[int] = "uniform",
        model_shape: ModelShape | None = None,
        split_multiple_of: int = 1,
        seq_len: int | None = None,
        ignore_index: int | None = -100,
        kwargs_seq_dims: Mapping[str, int | None] | None = None,
        check_attention: bool = True,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        stage_list = self._check_stages(stages)
        m = _positive_int("n_microbatches", n_microbatches, "pass the number of samples per step")
        k = _positive_int("seq_chunks", seq_chunks, "pass 1 for plain 1F1B, or 2, 4, 8 ...")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(
                f"seq_dim must be an integer >= 1 (got {seq_dim!r}): dim 0 is the batch dim "
                "that n_microbatches splits; pass the sequence dimension, usually 1"
            )
        _positive_int("split_multiple_of", split_multiple_of, "pass 1, or the TP degree")
        if isinstance(split, str):
            if split not in SPLIT_MODES:
                raise ValueError(
                    f"split={split!r} is unknown: use one of {list(SPLIT_MODES)} or a list of "
                    "segment lengths"
                )
            if split == "compute" and model_shape is None:
                raise ValueError(
                    "split='compute' needs the model shape: pass model_shape=ModelShape(...)"
                )
        elif len(split) != k:
            raise ValueError(
                f"split has {len(split)} lengths but seq_chunks={k}: give exactly seq_chunks "
                "lengths, or change seq_chunks"
            )
        self.n_samples = m
        self.seq_chunks = k
        self.seq_dim = seq_dim
        self.split = split if isinstance(split, str) else list(split)
        self.model_shape = model_shape
        self.split_multiple_of = split_multiple_of
        self.ignore_index = ignore_index
        self.kwargs_seq_dims = dict(kwargs_seq_dims or {})
        self.check_attention = check_attention
        self._fixed_seq_len = seq_len
        self._lengths_cache: dict[int, list[int]] = {}
        if seq_len is not None:
            self.segment_lengths(seq_len)  # fail at construction, not at the first step

        super().__init__(
            stages=stage_list,
            n_microbatches=m * k,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            defer_pp_recv=defer_pp_recv,
        )
        self.order_spec = OrderSpec(self.pp_group_size, len(stage_list), m, k)
        self._kv_states = {s.stage_index: StageKVState(s.stage_index, k) for s in stage_list}
        self._unit_loss_weights: list[float] = [1.0] * (m * k)
        self._lengths: list[int] = []
        self._attention_checked = not check_attention or k == 1
        self.pipeline_order = dict(build_orders(self.order_spec))
        self._prepare_schedule_with_comms(self.pipeline_order)

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_stages(
        stages: _PipelineStageBase | Sequence[_PipelineStageBase],
    ) -> list[_PipelineStageBase]:
        stage_list = [stages] if isinstance(stages, _PipelineStageBase) else list(stages)
        if not stage_list:
            raise ValueError("stages is empty: pass this rank's PipelineStage(s)")
        pp = stage_list[0].group_size
        rank = stage_list[0].group_rank
        n_stages = stage_list[0].num_stages
        indices = sorted(s.stage_index for s in stage_list)
        expected = list(range(rank, n_stages, pp))
        if any(s.num_stages != n_stages or s.group_size != pp for s in stage_list) or (
            n_stages != pp * len(stage_list) or indices != expected
        ):
            raise ValueError(
                f"rank {rank} of {pp} holds stages {indices} of {n_stages}: Seq1F1B uses looped "
                f"placement (stage s on rank s % pp, the same number on every rank), so this "
                f"rank must hold exactly {expected}. Build num_stages = pp * stages_per_rank "
                "stages and give rank r the stages r, r + pp, r + 2*pp, ..."
            )
        return stage_list

    def segment_lengths(self, seq_len: int) -> list[int]:
        """Segment lengths for a sequence of ``seq_len`` tokens (cached per length)."""
        if seq_len not in self._lengths_cache:
            self._lengths_cache[seq_len] = resolve_split(
                self.split,
                seq_len,
                self.seq_chunks,
                shape=self.model_shape,
                multiple_of=self.split_multiple_of,
            )
        return self._lengths_cache[seq_len]

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Load an order like torch does, refusing one that breaks Seq1F1B's rules."""
        super()._load_csv(filename, format=format)  # type: ignore[arg-type]
        _check_order_rules(self.pipeline_order, self.seq_chunks)

    def _prepare_schedule_with_comms(
        self,
        actions: dict[int, list[_Action | None]],
        format: str = "compute_only",
    ) -> None:
        """torch's lowering, but only this rank's list and in linear time (see lowering.py).

        torch lowers every rank's schedule on every rank, superlinearly: 10 s to minutes at
        pp=64 with 1024 units. The result is identical; other ranks' lists are lowered on access.
        """
        if format != "compute_only" or not is_lowerable(actions):
            super()._prepare_schedule_with_comms(actions, format=format)  # type: ignore[arg-type]
            return
        self._validate_and_set_stage_mapping(actions)
        stage_rank = dict(self.stage_index_to_group_rank)
        lowering = SendRecvLowering(
            actions,
            stage_rank.__getitem__,
            self._num_stages,
            self._n_microbatches,
            defer_recv=self._defer_pp_recv,
        )
        self.pipeline_order_with_comms = LoweredOrders(lowering)  # type: ignore[assignment]
        self.pipeline_order_with_comms[self.rank]  # this rank's list, at construction

    # ------------------------------------------------------------------ step
    def _local_seq_len(self, args: tuple, kwargs: dict, target: Any) -> int:
        for a in args:
            if isinstance(a, torch.Tensor):
                return int(a.shape[self.seq_dim])
        for name, value in kwargs.items():
            dim = self.kwargs_seq_dims.get(name, self.seq_dim)
            if isinstance(value, torch.Tensor) and dim is not None:
                return int(value.shape[dim])
        if isinstance(target, torch.Tensor):
            return int(target.shape[self.seq_dim])
        return 0

    def _split_step_inputs(
        self, seq_len: int, args: tuple, kwargs: dict, target: Any
    ) -> tuple[list, list, list | None]:
        """Cut this rank's inputs into units and set the per-unit loss weights."""
        self._lengths = self.segment_lengths(seq_len)
        arg_units, kwarg_units = split_units(
            args,
            kwargs,
            self.n_samples,
            self._lengths,
            self.seq_dim,
            args_chunk_spec=self._args_chunk_spec,
            kwargs_chunk_spec=self._kwargs_chunk_spec,
            kwargs_seq_dims=self.kwargs_seq_dims,
        )
        target_units = None
        self._unit_loss_weights = [1.0] * (self.n_samples * self.seq_chunks)
        if target is not None:
            target_units = split_target(target, self.n_samples, self._lengths, self.seq_dim)
            if self.scale_grads:
                tokens = [count_tokens(t, self.ignore_index) for t in target_units]
                total = sum(tokens)
                if total > 0:
                    self._unit_loss_weights = [len(tokens) * t / total for t in tokens]
        return arg_units, kwarg_units, target_units

    def _prepare_step(self, args: tuple, kwargs: dict, target: Any) -> tuple[list, list, Any]:
        """Validate and split inputs on every rank *before* any pipeline traffic.

        Middle stages get no input, so the pp group agrees on the sequence length with one tiny
        all-reduce, which also carries an error flag: bad input on one rank fails every rank at
        once instead of leaving the others waiting in a recv until the timeout.
        """
        local = self._local_seq_len(args, kwargs, target)
        fixed = self._fixed_seq_len
        error: ValueError | None = None
        units = None
        try:
            if fixed is not None and local and local != fixed:
                raise ValueError(
                    f"inputs have sequence length {local} but the schedule was built with "
                    f"seq_len={fixed}: pass matching inputs or rebuild it"
                )
            if fixed or local:
                units = self._split_step_inputs(fixed or local, args, kwargs, target)
        except ValueError as exc:
            error = exc
        agreed = fixed or local
        if self.pp_group_size > 1:
            stage = self._stages[0]
            t = torch.tensor([agreed, error is not None], dtype=torch.int64, device=stage.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=stage.group)
            agreed, failed = int(t[0].item()), bool(t[1].item())
            if failed and error is None:
                raise RuntimeError(
                    "ScheduleSeq1F1B.step(): another pipeline rank rejected its inputs (see its "
                    "error); no pipeline communication was started"
                )
        if error is not None:
            raise error
        if agreed < 1:
            raise ValueError(
                "no rank passed a tensor input or target to step(), so the sequence length is "
                "unknown: pass seq_len= to ScheduleSeq1F1B"
            )
        if units is None:  # a rank without inputs learns the length from the others
            units = self._split_step_inputs(agreed, args, kwargs, target)
        elif sum(self._lengths) != agreed:
            raise ValueError(
                f"this rank's inputs have sequence length {sum(self._lengths)} but another "
                f"rank's have {agreed}: pass the same sequence length on every rank"
            )
        return units

    def step(
        self,
        *args: Any,
        target: torch.Tensor | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step on whole-batch inputs (split into M samples x K segments here).

        ``losses`` receives M*K per-unit losses, token-weighted so that their mean equals the
        full-batch mean loss (with ``scale_grads=True``; their sum with ``scale_grads=False``).
        """
        if self._has_backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; "
                "it should not be used under torch.no_grad() context. Please call eval() instead."
            )
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        arg_units, kwarg_units, target_units = self._prepare_step(args, kwargs, target)
        self._step_microbatches(
            arg_units, kwarg_units, target_units, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        for stage in self._stages:
            if stage.is_last and return_outputs:
                return merge_unit_outputs(
                    stage.output_chunks, self.n_samples, self.seq_dim, self._output_merge_spec
                )
        return None

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        """torch's per-unit loss, weighted by the unit's share of the batch's tokens."""
        if stage.is_last and self._loss_fn is not None:
            if len(self._internal_losses) != mb_index:
                raise RuntimeError(
                    f"Seq1F1B: loss of unit {mb_index} computed out of order "
                    f"({len(self._internal_losses)} losses so far)"
                )
            loss = self._compute_loss(output, target_mbs[mb_index], loss_kwargs)
            weight = self._unit_loss_weights[mb_index]
            self._internal_losses.append(loss * weight if weight != 1.0 else loss)

    def _initialize_stages(self, args, kwargs, target=None, loss_kwargs=None):
        super()._initialize_stages(args, kwargs, target, loss_kwargs)
        self._resize_recv_buffers()

    def _resize_recv_buffers(self) -> None:
        """Give each unit's recv buffers its own segment length (torch sizes them all alike)."""
        lengths, dim = self._lengths, self.seq_dim
        if not lengths or len(set(lengths)) == 1:
            return
        for stage in self._stages:
            for table in (stage.args_recv_info, stage.grad_recv_info):
                for u, infos in table.items():
                    for info in infos:
                        buf = getattr(info, "buffer", None)
                        if info.is_root_arg or not isinstance(buf, torch.Tensor):
                            continue
                        if buf.dim() <= dim:
                            raise ValueError(
                                f"stage {stage.stage_index} receives a tensor of shape "
                                f"{tuple(buf.shape)} with no sequence dim {dim}: uneven segment "
                                "lengths need activations that keep the sequence at seq_dim; "
                                "use split='uniform' with a divisible seq_len"
                            )
                        # buffers were sized for segment 0; a sequence-sharded activation
                        # (tensor parallel) holds a fixed fraction of each segment
                        seg = lengths[u % self.seq_chunks]
                        if not hasattr(info, "_seq1f1b_base"):  # size torch gave it (segment 0)
                            info._seq1f1b_base = buf.shape[dim]
                        have = info._seq1f1b_base
                        if (have * seg) % lengths[0]:
                            raise ValueError(
                                f"stage {stage.stage_index} receives activations with "
                                f"{have} positions for a segment of {lengths[0]} tokens, which "
                                f"does not scale to a segment of {seg}: set split_multiple_of "
                                "to the sequence-sharding degree (e.g. the TP size)"
                            )
                        want = have * seg // lengths[0]
                        if buf.shape[dim] == want:
                            continue
                        shape = list(buf.shape)
                        shape[dim] = want
                        new = torch.empty(shape, dtype=buf.dtype, device=buf.device)
                        info.buffer = new.requires_grad_(buf.requires_grad)

    @contextlib.contextmanager
    def _units_installed(self) -> Iterator[None]:
        """Wrap each stage's per-chunk methods with the unit context for one step."""
        patched: list[tuple[Any, str]] = []
        guard_first_step = not self._attention_checked
        for stage in self._stages:
            state = self._kv_states[stage.stage_index]
            state.clear()
            for name, fn in self._stage_wrappers(stage, state, guard_first_step).items():
                setattr(stage, name, fn)
                patched.append((stage, name))
        try:
            yield
            self._attention_checked = True
        finally:
            for stage, name in patched:
                with contextlib.suppress(AttributeError):
                    delattr(stage, name)
            for state in self._kv_states.values():
                state.clear()

    def _segment_info(self, unit: int) -> SegmentInfo:
        m, seg = divmod(unit, self.seq_chunks)
        starts = segment_offsets(self._lengths)
        return SegmentInfo(
            microbatch=m,
            segment=seg,
            num_segments=self.seq_chunks,
            start=starts[seg],
            length=self._lengths[seg],
            seq_len=sum(self._lengths),
        )

    def _stage_wrappers(
        self, stage: _PipelineStageBase, state: StageKVState, guard: bool
    ) -> dict[str, Callable[..., Any]]:
        cls = type(stage)

        def forward_one_chunk(fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            info = self._segment_info(fwd_chunk_id)
            keep = stage.has_backward and torch.is_grad_enabled()
            state.begin_forward(info.microbatch, info.segment)
            ctx = UnitContext(state, info, "forward", keep)
            mode = _PlainAttentionGuard() if guard else None
            try:
                with activate(ctx), mode or contextlib.nullcontext():
                    out = cls.forward_one_chunk(
                        stage, fwd_chunk_id, args, kwargs, save_forward_output
                    )
            except RuntimeError as exc:
                if mode is not None and mode.error is not None:
                    raise mode.error from exc  # not torch's generic "failed to run forward"
                raise
            state.end_forward(info.microbatch, info.segment, keep)
            return out

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if not stage.has_backward:
                return None
            if not full_backward:
                raise RuntimeError(
                    "ScheduleSeq1F1B needs a full backward per unit: a split backward "
                    "(BACKWARD_INPUT/BACKWARD_WEIGHT) does not accumulate the cached K/V "
                    "gradients, which would make the gradients silently wrong"
                )
            info = self._segment_info(bwd_chunk_id)
            state.begin_backward(info.microbatch, info.segment)
            with activate(UnitContext(state, info, "backward", True)):
                cls.backward_one_chunk(stage, bwd_chunk_id, loss, full_backward, last_backward)
            state.end_backward(info.microbatch, info.segment)
            return None

        def backward_weight_one_chunk(*_: Any, **__: Any) -> None:
            raise RuntimeError(
                "ScheduleSeq1F1B does not support BACKWARD_WEIGHT: the weight/input split "
                "backward would skip the K/V gradients that later segments leave for earlier ones"
            )

        def get_local_bwd_output(mb_index):
            if not stage.has_backward:  # eval(): same-rank neighbours pass nothing backward
                return ()
            return cls.get_local_bwd_output(stage, mb_index)

        def set_local_bwd_input(next_stage_bwd_outputs, mb_index):
            if not stage.has_backward:
                return None
            return cls.set_local_bwd_input(stage, next_stage_bwd_outputs, mb_index)

        return {
            "forward_one_chunk": forward_one_chunk,
            "backward_one_chunk": backward_one_chunk,
            "backward_weight_one_chunk": backward_weight_one_chunk,
            "get_local_bwd_output": get_local_bwd_output,
            "set_local_bwd_input": set_local_bwd_input,
        }

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not self._lengths:
            raise RuntimeError("call step() or eval(): Seq1F1B splits the sequence itself")
        with self._units_installed():
            super()._step_microbatches(
                arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
            )

    def kv_state_bytes(self) -> int:
        """Bytes of K/V still cached (0 between steps; for tests and memory checks)."""
        return sum(s.nbytes() for s in self._kv_states.values())

    def kv_state_empty(self) -> bool:
        return all(s.is_empty() for s in self._kv_states.values())


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """Seq1F1B-I: the same schedule with several stages per rank (looped placement).

    ``ScheduleSeq1F1B`` already interleaves when given several stages; this name exists so
    that configs can ask for the interleaved variant explicitly, and it insists on >= 2 stages.
    """

    def __init__(self, stages: Sequence[_PipelineStageBase], *args: Any, **kwargs: Any) -> None:
        if isinstance(stages, _PipelineStageBase) or len(stages) < 2:
            raise ValueError(
                "ScheduleInterleavedSeq1F1B needs >= 2 stages per rank (looped placement): "
                "build pp * v stages, or use ScheduleSeq1F1B for one stage per rank"
            )
        super().__init__(stages, *args, **kwargs)
