"""ScheduleSeq1F1B: sequence-level 1F1B on torch.distributed.pipelining's runtime.

Each batch is split into ``n_microbatches`` samples along dim 0 and each sample into
``seq_chunks`` segments along ``seq_dim``; a (sample, segment) *unit* is what torch's runtime
calls a microbatch (index ``u = m * K + k``). The order (see :mod:`seq1f1b.order`) runs each
sample's segments forward 0..K-1 and backward K-1..0, which is what lets a segment attend to
the K/V of earlier segments (see :mod:`seq1f1b.attention`).

Everything else is torch's: lowering to send/recv, FSDP unshard/reshard, REDUCE_GRAD, gradient
scaling. The narrow additions, all scoped to one ``step()`` and reached through the hooks of
:class:`seq1f1b._runtime.UnitRuntime` (the one module that touches torch internals):

* each stage's ``forward_one_chunk``/``backward_one_chunk`` runs inside the unit context, which
  also enforces the segment order;
* receives are sized per unit when segments have different lengths, and every received
  activation's sequence length is checked against its unit's segment before it is used;
* each unit's loss is weighted by its share of the batch's tokens, so uneven segments give the
  same loss and gradients as one full-sequence run with a mean loss.
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
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from . import _runtime as rt
from ._runtime import Action, PipelineStageBase
from .context_parallel import CP_PREFIX_MODES
from .kv import (
    ContextParallel,
    SegmentInfo,
    StageKVState,
    UnitContext,
    activate,
    metadata_inference,
)
from .masks import document_runs
from .microbatch import (
    count_tokens,
    merge_unit_outputs,
    shard_units,
    split_presplit_units,
    split_target,
    split_units,
)
from .order import OrderSpec, build_orders
from .partition import (
    SPLIT_MODES,
    ModelShape,
    resolve_split,
    segment_multiple,
    segment_offsets,
)

__all__ = ["ScheduleInterleavedSeq1F1B", "ScheduleSeq1F1B"]

logger = logging.getLogger(__name__)

_F = rt.FORWARD
_B = rt.FULL_BACKWARD
_I = rt.BACKWARD_INPUT
_W = rt.BACKWARD_WEIGHT


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}): {fix}")
    return value


class _PlainAttentionGuard(TorchFunctionMode):
    """Fails fast when a model calls plain SDPA inside a chunked unit (wrong, not just slow)."""

    error: RuntimeError | None = None

    def __init__(self, documents: bool) -> None:
        super().__init__()
        self.documents = documents

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            why = (
                "it would ignore the document_ids given to step() (attention across documents)"
                if self.documents
                else "a segment would not see the earlier segments' keys and values"
            )
            self.error = RuntimeError(
                "ScheduleSeq1F1B: the model called "
                f"torch.nn.functional.scaled_dot_product_attention directly, so {why} "
                "(silently wrong results). Route causal attention through "
                "seq1f1b.chunk_aware_attention / ChunkAwareAttention (or pass "
                "check_attention=False if this SDPA call is not over the sequence)."
            )
            raise self.error
        return func(*args, **(kwargs or {}))


def _kv_backward(a: Action) -> bool:
    """The action that runs a unit's backward through its attention (and so its K/V): a full
    backward, or the input half of a split one (on the first stage torch runs the whole
    backward in BACKWARD_WEIGHT, there being no input gradient)."""
    t = a.computation_type
    if t == _B:
        return True
    return t == (_W if a.stage_index == 0 else _I)


def _check_order_rules(order: Mapping[int, Sequence[Action | None]], k: int) -> None:
    """Raise ValueError if an order breaks Seq1F1B's rules: forwards of a sample in segment
    order 0..K-1, backwards (full, or the K/V-carrying half of a split one) K-1..0."""
    for rank, actions in order.items():
        next_f: dict[tuple[int, int], int] = {}
        next_b: dict[tuple[int, int], int] = {}
        for a in actions:
            if a is None:
                continue
            if a.computation_type not in (_F, _B, _I, _W):
                raise ValueError(
                    f"rank {rank}: action {a} is not a FORWARD or a (full or split) BACKWARD; "
                    "give compute-only orders (F, B, I, W)"
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
            elif _kv_backward(a):
                if seg != next_b.get(key, k - 1):
                    raise ValueError(
                        f"rank {rank}: {a} runs segment {seg} of sample {m} backward out of "
                        "order; backwards must go K-1..0 (a later segment leaves K/V "
                        "gradients for the earlier ones)"
                    )
                next_b[key] = seg - 1


class ScheduleSeq1F1B(rt.UnitRuntime):
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
        split_multiple_of: every segment length (with context parallelism: each rank's share
            of it) is a multiple of this (e.g. the TP degree).
        seq_len: sequence length, if fixed up front (validates the split at construction; a
            step of another length is then an error). Without it every step may have its own
            length. Either way a tiny all-reduce per step (pp > 1) lets middle stages, which
            get no input, learn the length and makes bad input on any rank fail every rank
            before pipeline traffic.
        ignore_index: target value that does not count as a token (as in cross entropy).
        kwargs_seq_dims: per kwarg, the dim to split along the sequence, or None to pass it
            whole to every segment. Default: ``seq_dim`` for every tensor kwarg.
        check_attention: on the first step, raise if the model calls plain SDPA inside a unit.
        skip_invisible: with packed documents / sliding windows, skip (query, key) blocks that
            share no visible pair and cache only what later segments see; False computes every
            block under the mask and caches every segment (the mask-alone baseline).
        cp_group: context parallelism: the process group this stage's sequence is sharded
            over (ring attention, see :mod:`seq1f1b.context_parallel`). Every CP rank passes
            the same whole batch; the schedule keeps its load-balanced share of each segment
            (every segment a multiple of ``2 * cp`` tokens). Each rank's losses are scaled so
            that their mean over the CP group is the batch's mean loss.
        cp_prefix: how a segment reaches the cached K/V of earlier segments on the other CP
            ranks: "pass_q" (its queries travel), "pass_kv" (the cache travels) or "auto"
            (whichever moves fewer bytes, per segment).
        cp_reduce_grads: average parameter gradients over ``cp_group`` at the end of
            ``step()``; pass False when FSDP/DDP over a mesh that includes CP averages them.
        runtime_options: torch's runtime options of the installed release (2.15:
            ``max_active_stages``, ``unshard_lookahead``, ``defer_reduce_grad_wait``,
            ``max_outstanding_sends``), passed through.
    """

    #: run each backward as BACKWARD_INPUT + BACKWARD_WEIGHT (ScheduleZBSeq1F1B)
    split_backward: bool = False

    def __init__(
        self,
        stages: PipelineStageBase | Sequence[PipelineStageBase],
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
        skip_invisible: bool = True,
        cp_group: dist.ProcessGroup | None = None,
        cp_prefix: str = "auto",
        cp_reduce_grads: bool = True,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        **runtime_options: Any,
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
        self._cp = self._check_cp(cp_group, cp_prefix)
        self.cp_reduce_grads = cp_reduce_grads
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
            **runtime_options,
        )
        self.order_spec = OrderSpec(
            self.pp_group_size, len(stage_list), m, k, split_backward=self.split_backward
        )
        self._kv_states = {
            s.stage_index: StageKVState(s.stage_index, k, skip_invisible=skip_invisible)
            for s in stage_list
        }
        self._unit_loss_weights: list[float] = [1.0] * (m * k)
        self._lengths: list[int] = []
        self._documents: list | None = None  # per sample: document runs (packed documents)
        # per receive: (positions torch sized it for, tokens of the segment it was sized for)
        self._recv_base: dict[tuple[int, bool, int, int], tuple[int, int]] = {}
        self._presplit: tuple[list, list, list | None] | None = None
        self._attention_checked = not check_attention or (k == 1 and self._cp is None)
        self._documents_checked = not check_attention
        self._install_order(dict(build_orders(self.order_spec)))

    # ------------------------------------------------------------------ construction checks
    @staticmethod
    def _check_stages(
        stages: PipelineStageBase | Sequence[PipelineStageBase],
    ) -> list[PipelineStageBase]:
        stage_list = [stages] if isinstance(stages, PipelineStageBase) else list(stages)
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

    @staticmethod
    def _check_cp(group: dist.ProcessGroup | None, prefix: str) -> ContextParallel | None:
        if prefix not in CP_PREFIX_MODES:
            raise ValueError(f"cp_prefix={prefix!r} is unknown: use one of {list(CP_PREFIX_MODES)}")
        if group is None:
            return None
        size = dist.get_world_size(group)
        if size < 1 or dist.get_rank(group) < 0:
            raise ValueError(
                "cp_group does not contain this rank: pass the context-parallel group this "
                "rank belongs to (e.g. device_mesh['cp'].get_group())"
            )
        return ContextParallel(group, dist.get_rank(group), size, prefix) if size > 1 else None

    @property
    def cp_size(self) -> int:
        return 1 if self._cp is None else self._cp.size

    def segment_lengths(self, seq_len: int) -> list[int]:
        """Segment lengths for a sequence of ``seq_len`` tokens (cached per length)."""
        if seq_len not in self._lengths_cache:
            cp = self.cp_size
            multiple = segment_multiple(self.split_multiple_of, cp)
            if cp > 1 and (seq_len % multiple or seq_len < multiple * self.seq_chunks):
                raise ValueError(
                    f"seq_len={seq_len} cannot be cut into {self.seq_chunks} segments that are "
                    f"each a multiple of {multiple} tokens (context parallelism over {cp} ranks "
                    f"cuts each segment into 2 * cp = {2 * cp} chunks, and each rank's share "
                    f"must be a multiple of split_multiple_of={self.split_multiple_of}): use a "
                    f"sequence length that is a multiple of {multiple} and at least "
                    f"{multiple * self.seq_chunks}, or fewer seq_chunks"
                )
            lengths = resolve_split(
                self.split,
                seq_len,
                self.seq_chunks,
                shape=self.model_shape,
                multiple_of=multiple,
            )
            self._lengths_cache[seq_len] = lengths
        return self._lengths_cache[seq_len]

    def check_loaded_order(self, actions: Mapping[int, Sequence[Action | None]]) -> None:
        """A loaded CSV order must keep Seq1F1B's rules (full backward, segment order)."""
        _check_order_rules(actions, self.seq_chunks)

    # ------------------------------------------------------------------ step
    def _local_seq_len(self, args: tuple, kwargs: dict, target: Any) -> int:
        if self._presplit is not None:  # the first sample tells the length
            arg_mbs, kwarg_mbs, target_mbs = self._presplit
            args, kwargs = tuple(arg_mbs[0]), dict(kwarg_mbs[0])
            target = target_mbs[0] if target_mbs else None
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
        args_spec, kwargs_spec, _ = self.chunk_specs
        if self._presplit is not None:
            arg_units, kwarg_units, target_units = split_presplit_units(
                *self._presplit, self._lengths, self.seq_dim, self.kwargs_seq_dims
            )
        else:
            arg_units, kwarg_units = split_units(
                args,
                kwargs,
                self.n_samples,
                self._lengths,
                self.seq_dim,
                args_chunk_spec=args_spec,
                kwargs_chunk_spec=kwargs_spec,
                kwargs_seq_dims=self.kwargs_seq_dims,
            )
            target_units = None
            if target is not None:
                target_units = split_target(target, self.n_samples, self._lengths, self.seq_dim)
        self._unit_loss_weights = [1.0] * (self.n_samples * self.seq_chunks)
        total = 0
        if target_units is not None and self.scale_grads:
            total = sum(count_tokens(t, self.ignore_index) for t in target_units)
            if total == 0:
                raise ValueError(
                    f"every target of this batch is ignore_index={self.ignore_index}: a mean "
                    "loss over zero tokens is undefined. Drop the batch, or pass "
                    "scale_grads=False with a sum loss"
                )
        if self._cp is not None:  # keep this CP rank's share of every segment
            starts = segment_offsets(self._lengths)
            shards = [
                (self._cp.runs(starts[seg], starts[seg] + self._lengths[seg]), starts[seg])
                for _ in range(self.n_samples)
                for seg in range(self.seq_chunks)
            ]
            arg_units, kwarg_units, target_units = shard_units(
                arg_units, kwarg_units, target_units, shards, self.seq_dim, self.kwargs_seq_dims
            )
        if total:
            # token share of each (local) unit, times the CP size: the mean over the CP group
            # of each rank's loss is the batch's mean loss, as FSDP/DDP averaging expects
            tokens = [count_tokens(t, self.ignore_index) for t in target_units]
            scale = len(tokens) * self.cp_size / total
            self._unit_loss_weights = [scale * t for t in tokens]
        return arg_units, kwarg_units, target_units

    def _prepare_step(
        self, args: tuple, kwargs: dict, target: Any, document_ids: Any = None
    ) -> tuple[list, list, Any]:
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
            if document_ids is not None:
                self._documents = self._split_documents(document_ids, fixed or local)
            else:
                self._documents = None
        except ValueError as exc:
            error = exc
        agreed = fixed or local
        has_docs = document_ids is not None
        if self.pp_group_size > 1:
            stage = self.local_stages[0]
            flags = [agreed, error is not None, has_docs, not has_docs]
            t = torch.tensor(flags, dtype=torch.int64, device=stage.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=stage.group)
            agreed, failed = int(t[0].item()), bool(t[1].item())
            if failed and error is None:
                raise RuntimeError(
                    "ScheduleSeq1F1B.step(): another pipeline rank rejected its inputs (see its "
                    "error); no pipeline communication was started"
                )
            if error is None and bool(t[2].item()) and bool(t[3].item()):
                raise ValueError(
                    "step(document_ids=...) was passed on some pipeline ranks but not on others: "
                    "every stage's attention needs the document boundaries, pass them on every "
                    "rank"
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
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        finalize_gradients: bool = True,
        document_ids: torch.Tensor | Sequence[torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run one step on whole-batch inputs (split into M samples x K segments here).

        ``document_ids`` (batch, seq_len) marks packed documents (one contiguous run of equal
        ids each): attention then stays inside each document, blocks that share no document
        are skipped and never cached. Pass it on every pipeline rank (every stage attends);
        the model does not see it. With pre-split inputs, a list of M per-sample tensors.

        ``losses`` receives M*K per-unit losses, token-weighted so that their mean equals the
        full-batch mean loss (with ``scale_grads=True``; their sum with ``scale_grads=False``).
        As in torch's ``step()``, inputs already split along the batch may be passed as
        ``arg_mbs``/``kwarg_mbs``/``target_mbs`` (one entry per sample, M entries); each is then
        cut into the K segments here.
        """
        if self.has_backward and self.backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; "
                "it should not be used under torch.no_grad() context. Please call eval() instead."
            )
        presplit = (arg_mbs, kwarg_mbs, target_mbs)
        self._presplit = None
        if any(x is not None for x in presplit):
            if args or kwargs or target is not None:
                raise ValueError(
                    "step(): pass either whole-batch inputs (args, kwargs, target) or pre-split "
                    "samples (arg_mbs, kwarg_mbs, target_mbs), not both"
                )
            self._presplit = self._check_presplit(*presplit)
        self.set_finalize_gradients(finalize_gradients)
        for stage in self.local_stages:
            stage.has_backward = self.has_backward
            stage.clear_runtime_states()
        arg_units, kwarg_units, target_units = self._prepare_step(
            args, kwargs, target, document_ids
        )
        self.run_microbatches(
            arg_units, kwarg_units, target_units, losses, return_outputs, loss_kwargs=loss_kwargs
        )
        if self._cp is not None and self.cp_reduce_grads and self.has_backward:
            self._average_cp_grads()
        for stage in self.local_stages:
            if stage.is_last and return_outputs:
                return merge_unit_outputs(
                    stage.output_chunks, self.n_samples, self.seq_dim, self.chunk_specs[2]
                )
        return None

    def eval(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any):
        """Forwards only (no backward, no K/V kept for one), for validation at any length.

        Takes what :meth:`step` takes (whole-batch inputs or pre-split ``arg_mbs``/
        ``kwarg_mbs``/``target_mbs``, ``document_ids``, ``loss_kwargs``). Returns, on the rank
        holding the last stage, the model's output for the whole batch (each sample's segments
        concatenated along ``seq_dim``; with context parallelism this rank's share), None on
        other ranks; ``losses`` receives the M*K unit losses as in :meth:`step`.
        """
        return super().eval(*args, target=target, losses=losses, **kwargs)

    def _average_cp_grads(self) -> None:
        """Each CP rank holds the gradient of its shard's loss share: average them in place,
        one asynchronous all-reduce per gradient (no flat copy of all gradients)."""
        assert self._cp is not None
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for stage in self.local_stages
            for p in stage.submod.parameters()
            if p.grad is not None
        ]
        works = [dist.all_reduce(g, group=self._cp.group, async_op=True) for g in grads]
        for g, work in zip(grads, works, strict=True):
            work.wait()
            g.div_(self._cp.size)

    def _split_documents(self, document_ids: Any, seq_len: int) -> list:
        """Per-sample document runs, checked against the batch and the sequence length."""
        m = self.n_samples
        if isinstance(document_ids, torch.Tensor):
            if document_ids.dim() != 2 or document_ids.shape[0] % m:
                raise ValueError(
                    f"document_ids has shape {tuple(document_ids.shape)}: it must be (batch, "
                    f"seq_len) with a batch divisible by n_microbatches={m}"
                )
            samples = list(torch.tensor_split(document_ids, m, dim=0))
        else:
            samples = list(document_ids)
            if len(samples) != m:
                raise ValueError(
                    f"document_ids as a list needs one (batch, seq_len) tensor per sample "
                    f"(n_microbatches={m}), got {len(samples)}"
                )
        for ids in samples:
            if seq_len and ids.shape[-1] != seq_len:
                raise ValueError(
                    f"document_ids cover {ids.shape[-1]} positions but the inputs have "
                    f"seq_len={seq_len}: pass one id per token"
                )
        return [document_runs(ids) for ids in samples]

    def _check_presplit(
        self, arg_mbs: list | None, kwarg_mbs: list | None, target_mbs: list | None
    ) -> tuple[list, list, list | None]:
        """Pre-split samples: M entries each (torch's contract, with M = n_microbatches)."""
        m = self.n_samples
        out: list[list | None] = []
        for name, mbs, empty in (
            ("arg_mbs", arg_mbs, ()),
            ("kwarg_mbs", kwarg_mbs, {}),
            ("target_mbs", target_mbs, None),
        ):
            if mbs is None:
                out.append(None if name == "target_mbs" else [empty] * m)
                continue
            if not isinstance(mbs, list) or len(mbs) != m:
                raise ValueError(
                    f"{name} must be a list of n_microbatches={m} samples (got "
                    f"{type(mbs).__name__}): ScheduleSeq1F1B cuts each sample into its "
                    "seq_chunks segments itself"
                )
            out.append(mbs)
        return out[0], out[1], out[2]  # type: ignore[return-value]

    def unit_loss(self, stage, output, target, mb_index, loss_kwargs):  # type: ignore[override]
        """torch's per-unit loss, weighted by the unit's share of the batch's tokens."""
        loss = super().unit_loss(stage, output, target, mb_index, loss_kwargs)
        weight = self._unit_loss_weights[mb_index]
        if weight == 0.0:
            # no token counts (all ignore_index): a mean loss is 0/0 = NaN; the unit adds
            # nothing to the batch loss and its gradient is zero either way
            return torch.where(loss.isnan(), torch.zeros_like(loss), loss) * 0.0
        return loss * weight if weight != 1.0 else loss

    def after_stage_init(self) -> None:
        """Give each unit's receives its own segment length (torch sizes them all alike)."""
        lengths, dim = self._lengths, self.seq_dim
        if not lengths:
            return
        for stage in self.local_stages:
            for backward in (False, True):
                for u, infos in rt.recv_infos(stage, backward).items():
                    for i, info in enumerate(infos):
                        shape = rt.recv_shape(info)
                        if shape is None:
                            continue
                        want = self._recv_length(stage.stage_index, backward, u, i, shape)
                        if want is not None:
                            rt.set_recv_length(info, dim, want)

    def _recv_length(
        self, stage_index: int, backward: bool, unit: int, slot: int, shape: torch.Size
    ) -> int | None:
        """Positions unit ``unit`` receives at ``seq_dim`` (None: not a per-token tensor)."""
        lengths, dim = self._lengths, self.seq_dim
        key = (stage_index, backward, unit, slot)
        if len(shape) <= dim:
            if len(set(lengths)) == 1:
                return None
            raise ValueError(
                f"stage {stage_index} receives a tensor of shape {tuple(shape)} with no "
                f"sequence dim {dim}: uneven segment lengths need activations that keep the "
                "sequence at seq_dim; use split='uniform' with a divisible seq_len"
            )
        # torch sized every unit like the first one it saw (segment 0 of the first step); a
        # sequence-sharded activation (tensor parallel) holds a fixed fraction of each
        # segment. The ratio is kept, not the size: a later step may have another length.
        base, tokens = self._recv_base.setdefault(key, (int(shape[dim]), lengths[0]))
        seg = lengths[unit % self.seq_chunks]
        if (base * seg) % tokens:
            raise ValueError(
                f"stage {stage_index} receives activations with {base} positions for a "
                f"segment of {tokens} tokens, which does not scale to a segment of {seg}: "
                "set split_multiple_of to the sequence-sharding degree (e.g. the TP size)"
            )
        return base * seg // tokens

    def _check_received(self, stage: PipelineStageBase, unit: int) -> None:
        """Every received activation has its unit's segment length (never silently wrong)."""
        for slot, buf in enumerate(rt.received_tensors(stage, unit)):
            want = self._recv_length(stage.stage_index, False, unit, slot, buf.shape)
            if want is not None and buf.shape[self.seq_dim] != want:
                raise RuntimeError(
                    f"stage {stage.stage_index}, unit {unit}: received an activation with "
                    f"{buf.shape[self.seq_dim]} positions at dim {self.seq_dim}, expected {want} "
                    "(its segment). The receive was not sized per unit: this torch release "
                    "changed how receive buffers are allocated (see seq1f1b/_runtime/)."
                )

    @contextlib.contextmanager
    def _run_units(self) -> Iterator[None]:
        if not self._lengths:
            raise RuntimeError("call step() or eval(): Seq1F1B splits the sequence itself")
        docs = self._documents is not None
        guard_first_step = not self._attention_checked or (docs and not self._documents_checked)
        replacements = {}
        for stage in self.local_stages:
            state = self._kv_states[stage.stage_index]
            state.clear(reset_peak=True)
            replacements[stage] = self._stage_wrappers(stage, state, guard_first_step)
        try:
            with rt.stage_methods_replaced(replacements):
                yield
            self._attention_checked = True
            self._documents_checked = self._documents_checked or docs
        finally:
            for state in self._kv_states.values():
                state.clear()

    def unit_scope(self) -> contextlib.AbstractContextManager[None]:
        return self._run_units()

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        return metadata_inference()

    def _segment_info(self, unit: int) -> SegmentInfo:
        m, seg = divmod(unit, self.seq_chunks)
        starts = segment_offsets(self._lengths)
        total = sum(self._lengths)
        return SegmentInfo(
            microbatch=m,
            segment=seg,
            num_segments=self.seq_chunks,
            start=starts[seg],
            length=self._lengths[seg],
            seq_len=total,
            bounds=(*starts[: self.seq_chunks], total),
            documents=None if self._documents is None else self._documents[m],
            cp=self._cp,
        )

    def _stage_wrappers(
        self, stage: PipelineStageBase, state: StageKVState, guard: bool
    ) -> dict[str, Callable[..., Any]]:
        # what runs each unit: the stage's own methods, or an instance override already there
        run_forward = stage.forward_one_chunk
        run_backward = stage.backward_one_chunk
        run_weight = stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id, args, kwargs=None, save_forward_output=True):
            info = self._segment_info(fwd_chunk_id)
            if not stage.is_first:
                self._check_received(stage, fwd_chunk_id)
            keep = stage.has_backward and torch.is_grad_enabled()
            state.begin_forward(info.microbatch, info.segment)
            ctx = UnitContext(state, info, "forward", keep)
            mode = _PlainAttentionGuard(info.documents is not None) if guard else None
            try:
                with activate(ctx), mode or contextlib.nullcontext():
                    out = run_forward(fwd_chunk_id, args, kwargs, save_forward_output)
            except RuntimeError as exc:
                if mode is not None and mode.error is not None:
                    raise mode.error from exc  # not torch's generic "failed to run forward"
                raise
            state.end_forward(info.microbatch, info.segment, keep)
            return out

        def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if not stage.has_backward:
                return None
            if not full_backward and stage.is_first:
                # torch runs the first stage's whole backward in its BACKWARD_WEIGHT (there is
                # no input gradient to split off): the unit's K/V work happens there
                run_backward(bwd_chunk_id, loss, full_backward, last_backward)
                return None
            info = self._segment_info(bwd_chunk_id)
            state.begin_backward(info.microbatch, info.segment)
            with activate(UnitContext(state, info, "backward", True)):
                run_backward(bwd_chunk_id, loss, full_backward, last_backward)
            state.end_backward(info.microbatch, info.segment, free=full_backward)
            return None

        def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
            if not stage.has_backward:
                return None
            info = self._segment_info(bwd_chunk_id)
            if stage.is_first:  # the full backward (see above)
                state.begin_backward(info.microbatch, info.segment)
                with activate(UnitContext(state, info, "backward", True)):
                    run_weight(bwd_chunk_id, last_backward)
                state.end_backward(info.microbatch, info.segment)
                return None
            # weight gradients from the intermediates BACKWARD_INPUT saved; checkpointing may
            # recompute the layer (and its attention, from the kept K/V cache) once more here
            with activate(UnitContext(state, info, "backward", False)):
                run_weight(bwd_chunk_id, last_backward)
            state.end_weight(info.microbatch, info.segment)
            return None

        return {
            "forward_one_chunk": forward_one_chunk,
            "backward_one_chunk": backward_one_chunk,
            "backward_weight_one_chunk": backward_weight_one_chunk,
        }

    def kv_state_bytes(self) -> int:
        """Bytes of K/V still cached (0 between steps; for tests and memory checks)."""
        return sum(s.nbytes() for s in self._kv_states.values())

    def kv_peak_bytes(self) -> int:
        """Most K/V bytes cached at once on this rank's stages during the last step."""
        return max((s.peak_bytes for s in self._kv_states.values()), default=0)

    def kv_state_empty(self) -> bool:
        return all(s.is_empty() for s in self._kv_states.values())


class ScheduleZBSeq1F1B(ScheduleSeq1F1B):
    """Zero-bubble Seq1F1B: the Seq1F1B order with each backward split into its input half
    (sent upstream at once) and its weight half (see :func:`seq1f1b.order.split_backward`).

    Same arguments as :class:`ScheduleSeq1F1B`, one or several stages per rank; the cached K/V
    gradients stay exact because the attention accumulates them itself. Activation
    checkpointing must be non-reentrant (its recomputation then runs in BACKWARD_INPUT).
    """

    split_backward = True


class ScheduleInterleavedSeq1F1B(ScheduleSeq1F1B):
    """Seq1F1B-I: the same schedule with several stages per rank (looped placement).

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
