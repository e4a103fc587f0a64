"""``SequencePipelineSchedule``: what every Seq1F1B-family schedule shares, on torch's runtime.

Each batch is split into ``n_microbatches`` samples along dim 0 and each sample into
``seq_chunks`` segments along ``seq_dim``; a (sample, segment) *unit* is what torch's runtime
calls a microbatch (index ``u = m * K + k``). Subclasses give each rank's compute order
(``_calculate_single_rank_operations``, as torch's schedules do); lowering to send/recv, FSDP
unshard/reshard, REDUCE_GRAD and gradient scaling are torch's.

The step is torch's ``_step_microbatches`` on units this class cuts: torch's ``step()`` splits
the target along the batch into ``n_microbatches`` pieces and merges outputs along the batch,
neither of which fits sequence units. Around it, small collaborators each do one job:
:class:`~seq1f1b.schedules.options.SequenceSplit` (segment lengths),
:class:`~seq1f1b.schedules.step_inputs. UnitCutter` (units and token weights),
:func:`~seq1f1b.schedules.preflight.agree_on_step` (cross-rank pre-flight),
:class:`~seq1f1b.schedules.receives.ReceiveSizer` (receives per unit) and
:class:`~seq1f1b.schedules.unit_actions.UnitActions` (the per-action context: K/V state, guard).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.tensor import DTensor

from .. import _runtime as rt
from .._runtime import Action, PipelineStageBase
from ..attention.kv import metadata_inference
from ..attention.mixing_probe import mixing_error
from ..orders.order import OrderSpec
from ..orders.order_rules import check_order_rules
from .microbatch import merge_unit_outputs
from .options import ContextParallelConfig, SequenceSplit, positive_int
from .preflight import agree_on_step
from .receives import ReceiveSizer
from .step_inputs import StepInputs, UnitCutter, check_presplit
from .unit_actions import UnitActions

logger = logging.getLogger(__name__)

__all__ = ["SequencePipelineSchedule"]


def whole_backwards(order: Sequence[Action | None]) -> list[Action | None]:
    """A compute order with each BACKWARD_INPUT run as a FULL_BACKWARD and no BACKWARD_WEIGHT
    (the same gradient sends, at the same places)."""
    out: list[Action | None] = []
    for action in order:
        if action is not None and action.computation_type == rt.BACKWARD_WEIGHT:
            continue
        if action is not None and action.computation_type == rt.BACKWARD_INPUT:
            action = Action(action.stage_index, rt.FULL_BACKWARD, action.microbatch_index)
        out.append(action)
    return out


class SequencePipelineSchedule(rt.UnitRuntime):
    """Base of the Seq1F1B schedules; see :class:`seq1f1b.ScheduleSeq1F1B` for the arguments."""

    def __init__(
        self,
        stages: PipelineStageBase | Sequence[PipelineStageBase],
        n_microbatches: int,
        seq_chunks: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
        kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
        output_merge_spec: dict[str, Any] | tuple[Any] | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        seq_dim: int = 1,
        split: SequenceSplit | str | Sequence[int] = "uniform",
        context_parallel: ContextParallelConfig | None = None,
        ignore_index: int | None = -100,
        kwargs_seq_dims: Mapping[str, int | None] | None = None,
        check_attention: bool = True,
        skip_invisible: bool = True,
        max_active_stages: int | None = None,
        unshard_lookahead: str | tuple[int, ...] | None = None,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
    ) -> None:
        stage_list = _check_stages(stages, self._placement)
        # torch cannot split a compiled backward into its input and weight halves: split, it
        # would run twice (twice the time; with AOTAutograd's donated buffers, wrong weight
        # gradients). Zero-bubble orders on compiled blocks run each backward whole instead.
        self._whole_backward = self._split_backward and any(
            rt.has_compiled_module(getattr(s, "submod", None)) for s in stage_list
        )
        m = positive_int("n_microbatches", n_microbatches, "pass the number of samples per step")
        k = positive_int("seq_chunks", seq_chunks, "pass 1 for plain 1F1B, or 2, 4, 8 ...")
        if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
            raise ValueError(
                f"seq_dim must be an integer >= 1 (got {seq_dim!r}): dim 0 is the batch dim "
                "that n_microbatches splits; pass the sequence dimension, usually 1"
            )
        self.sequence_split = SequenceSplit.of(split)
        self.context_parallel = context_parallel or ContextParallelConfig()
        self.sequence_split.check(k)
        self._cp = self.context_parallel.resolve()
        self.n_samples, self.seq_chunks, self.seq_dim = m, k, seq_dim
        # 2.15's runtime options, passed only when set (the seam refuses them on older torch)
        newer = {"max_active_stages": max_active_stages, "unshard_lookahead": unshard_lookahead,
                 "defer_reduce_grad_wait": defer_reduce_grad_wait or None,
                 "max_outstanding_sends": max_outstanding_sends}  # fmt: skip
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
            **{name: value for name, value in newer.items() if value is not None},
        )
        args_spec, kwargs_spec, _ = self.chunk_specs
        self.cutter = UnitCutter(m, k, seq_dim, dict(kwargs_seq_dims or {}), ignore_index,
                                 scale_grads, args_spec, kwargs_spec)  # fmt: skip
        self.receives = ReceiveSizer(seq_dim)
        self.unit_actions = UnitActions(stage_list, k, self.receives, self._cp, skip_invisible)
        self.register_action_context(self.unit_actions)
        self._inputs: StepInputs | None = None
        self._presplit: tuple[list, list, list | None] | None = None
        self._guard_attention = check_attention and (k > 1 or self._cp is not None)
        self._guard_documents = check_attention
        self._last_lengths: list[list[int]] | None = None  # logged when the split changes
        self.order_spec = OrderSpec(self.pp_group_size, len(stage_list), m, k,
                                    self._split_backward, self._placement)  # fmt: skip
        ranks = range(self.pp_group_size)
        orders = {r: self._calculate_single_rank_operations(r) for r in ranks}
        if self._whole_backward:
            logger.info(
                "%s: stages hold compiled modules, so each backward runs whole "
                "(BACKWARD_INPUT as FULL_BACKWARD, no BACKWARD_WEIGHT): a compiled backward "
                "cannot be split in two",
                type(self).__name__,
            )
            orders = {r: whole_backwards(order) for r, order in orders.items()}
        self._install_order(orders)
        if self.sequence_split.seq_len is not None:
            self.segment_lengths(self.sequence_split.seq_len)  # fail now, not at the first step

    #: whether the orders split each backward into BACKWARD_INPUT + BACKWARD_WEIGHT
    _split_backward = False
    #: how stages sit on ranks: "looped" (stage s on rank s % pp) or "v" (r and 2*pp-1-r)
    _placement = "looped"

    def _calculate_single_rank_operations(self, rank: int) -> list[Action | None]:
        """This rank's compute-only order (closed form; subclasses)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ read-only views
    @property
    def split(self) -> str | list[int]:
        mode = self.sequence_split.mode
        return mode if isinstance(mode, str) else list(mode)

    @property
    def cp_size(self) -> int:
        return 1 if self._cp is None else self._cp.size

    def segment_lengths(self, seq_len: int) -> list[int]:
        """Segment lengths for a sequence of ``seq_len`` tokens without packed documents
        (cached per length): every sample's, unless a step passes ``document_ids``."""
        return self.sequence_split.lengths(seq_len, self.seq_chunks, self.cp_size, self.order_spec)

    def sample_lengths(self, seq_len: int, document_ids: Any = None) -> list[list[int]]:
        """Each sample's segment lengths for a step. With the step's ``document_ids`` and
        ``split="compute"``, each sample's are balanced for its own documents (cached per
        layout; the same on every rank, which all hold the documents)."""
        return self.sequence_split.sample_lengths(
            seq_len, self.seq_chunks, self.cutter.n_samples, self.cp_size, self.order_spec,
            document_ids,
        )  # fmt: skip

    def kv_state_bytes(self) -> int:
        """Bytes of K/V still cached (0 between steps; for tests and memory checks)."""
        return sum(s.nbytes() for s in self.unit_actions.kv_states.values())

    def kv_peak_bytes(self) -> int:
        """Most K/V bytes cached at once on this rank's stages during the last step."""
        return max((s.peak_bytes for s in self.unit_actions.kv_states.values()), default=0)

    def kv_state_empty(self) -> bool:
        return all(s.is_empty() for s in self.unit_actions.kv_states.values())

    def check_loaded_order(self, actions: Mapping[int, Sequence[Action | None]]) -> None:
        """A loaded CSV order must keep Seq1F1B's rules (full backward, segment order)."""
        check_order_rules(actions, self.seq_chunks)

    # ------------------------------------------------------------------ step
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
        cut into the K segments here. Each step may have its own sequence length.
        """
        if self.has_backward and self.backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; "
                "it should not be used under torch.no_grad() context. Please call eval() instead."
            )
        self._presplit = None
        if any(x is not None for x in (arg_mbs, kwarg_mbs, target_mbs)):
            if args or kwargs or target is not None:
                raise ValueError(
                    "step(): pass either whole-batch inputs (args, kwargs, target) or pre-split "
                    "samples (arg_mbs, kwarg_mbs, target_mbs), not both"
                )
            self._presplit = check_presplit(arg_mbs, kwarg_mbs, target_mbs, self.n_samples)
        self.set_finalize_gradients(finalize_gradients)
        for stage in self.local_stages:
            stage.has_backward = self.has_backward
            stage.clear_runtime_states()
        inputs = self._prepare_step(args, kwargs, target, document_ids)
        self.run_microbatches(inputs.args, inputs.kwargs, inputs.targets, losses,
                              return_outputs, loss_kwargs=loss_kwargs)  # fmt: skip
        if self._cp is not None and self.context_parallel.reduce_grads and self.has_backward:
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

    def _prepare_step(
        self, args: tuple, kwargs: dict, target: Any, document_ids: Any = None
    ) -> StepInputs:
        """Validate and cut inputs on every rank *before* any pipeline traffic (see
        :mod:`seq1f1b.schedules.preflight`)."""
        fixed = self.sequence_split.seq_len
        local = self.cutter.seq_len(args, kwargs, target, self._presplit)
        error: ValueError | None = None
        inputs, documents = None, None
        try:
            if fixed is not None and local and local != fixed:
                raise ValueError(
                    f"inputs have sequence length {local} but the schedule was built with "
                    f"seq_len={fixed}: pass matching inputs or rebuild it"
                )
            if document_ids is not None:
                documents = self.cutter.documents(document_ids, fixed or local)
            if fixed or local:
                inputs = self._cut(fixed or local, args, kwargs, target, document_ids, documents)
        except ValueError as exc:
            error = exc
        stage = self.local_stages[0]
        agreed = agree_on_step(stage.group, self.pp_group_size, stage.device, fixed or local,
                               error, document_ids is not None,
                               self._whole_backward)  # fmt: skip
        if inputs is None:  # a rank without inputs learns the length from the others
            inputs = self._cut(agreed, args, kwargs, target, document_ids, documents)
        elif sum(inputs.lengths[0]) != agreed:
            raise ValueError(
                f"this rank's inputs have sequence length {sum(inputs.lengths[0])} but another "
                f"rank's have {agreed}: pass the same sequence length on every rank"
            )
        self._inputs = inputs
        guard = self._guard_attention or (documents is not None and self._guard_documents)
        self.unit_actions.begin_step(inputs.lengths, documents, guard)
        return inputs

    def _cut(
        self,
        seq_len: int,
        args: tuple,
        kwargs: dict,
        target: Any,
        document_ids: Any = None,
        documents: list | None = None,
    ) -> StepInputs:
        """This rank's units; ``documents`` (per sample) place the CP shards."""
        lengths = self.sample_lengths(seq_len, document_ids)
        if lengths != self._last_lengths:
            mode = self.sequence_split.mode
            masked = document_ids is not None and mode == "compute"
            same = all(ls == lengths[0] for ls in lengths)
            logger.info("Seq1F1B: segment lengths%s %s (split=%s%s)",
                        "" if same else " per sample", lengths[0] if same else lengths, mode,
                        ", by document" if masked else "")  # fmt: skip
            self._last_lengths = lengths
        return self.cutter.cut(lengths, args, kwargs, target, self._presplit, self._cp, documents)

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

    # ------------------------------------------------------------------ runtime hooks
    def unit_loss(self, stage, output, target, mb_index, loss_kwargs):  # type: ignore[override]
        """torch's per-unit loss, weighted by the unit's share of the batch's tokens (a loss
        that runs its own backward inside, :class:`seq1f1b.ChunkedLoss`, takes the weight)."""
        weight = self._inputs.weights[mb_index] if self._inputs is not None else 1.0
        loss_fn = self.loss_fn
        if loss_fn is not None and getattr(loss_fn, "takes_unit_weight", False):
            return loss_fn(output, target, weight=weight, **(loss_kwargs or {}))
        loss = super().unit_loss(stage, output, target, mb_index, loss_kwargs)
        if weight == 0.0:
            # no token counts (all ignore_index): a mean loss is 0/0 = NaN; the unit adds
            # nothing to the batch loss and its gradient is zero either way
            return torch.where(loss.isnan(), torch.zeros_like(loss), loss) * 0.0
        return loss * weight if weight != 1.0 else loss

    def after_stage_init(self) -> None:
        """Give each unit's receives its own segment length (torch sizes them all alike)."""
        if self._inputs is not None:
            self.receives.resize(self.local_stages, self._inputs.unit_lengths)

    @contextlib.contextmanager
    def _run_units(self) -> Iterator[None]:
        if self._inputs is None:
            raise RuntimeError("call step() or eval(): Seq1F1B splits the sequence itself")
        try:
            yield
            if self.unit_actions.guard:
                self._raise_if_positions_mix()
            self._guard_attention = False
            self._guard_documents = self._guard_documents and self.unit_actions.documents is None
        finally:
            self.unit_actions.end_step()

    def _raise_if_positions_mix(self) -> None:
        """After a guarded step: if any rank's stage combined the positions of a later segment
        without a chunk-aware attention call, every rank raises the same named error (the
        step's traffic completed; no optimizer step has run on its gradients)."""
        mixing = self.unit_actions.mixing
        code = 0 if mixing is None else (mixing[0] + 1) * (self.seq_chunks + 1) + mixing[1]
        if self.pp_group_size > 1:
            stage = self.local_stages[0]
            t = torch.tensor([code], dtype=torch.int64, device=stage.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=stage.group)
            code = int(t.item())
        if code:
            stage_index, segment = divmod(code, self.seq_chunks + 1)
            raise mixing_error(stage_index - 1, segment)

    def unit_scope(self) -> contextlib.AbstractContextManager[None]:
        return self._run_units()

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        return metadata_inference()


def _check_stages(
    stages: PipelineStageBase | Sequence[PipelineStageBase], placement: str = "looped"
) -> list:
    """This rank's stages, checked against the schedule's placement (looped or V)."""
    stage_list = [stages] if isinstance(stages, PipelineStageBase) else list(stages)
    if not stage_list:
        raise ValueError("stages is empty: pass this rank's PipelineStage(s)")
    pp, rank = stage_list[0].group_size, stage_list[0].group_rank
    n_stages = stage_list[0].num_stages
    indices = sorted(s.stage_index for s in stage_list)
    consistent = all(s.num_stages == n_stages and s.group_size == pp for s in stage_list)
    if placement == "v":
        expected = [rank, 2 * pp - 1 - rank]
        if not consistent or n_stages != 2 * pp or indices != expected:
            raise ValueError(
                f"rank {rank} of {pp} holds stages {indices} of {n_stages}: this schedule uses "
                f"the V placement (num_stages = 2 * pp, rank r holds stages r and 2*pp-1-r), "
                f"so this rank must hold exactly {expected}. Split the model into 2 * pp "
                "stages and give rank r the stages r and 2*pp-1-r (torch's style='v')"
            )
        return sorted(stage_list, key=lambda s: s.stage_index)
    expected = list(range(rank, n_stages, pp))
    if not consistent or n_stages != pp * len(stage_list) or indices != expected:
        raise ValueError(
            f"rank {rank} of {pp} holds stages {indices} of {n_stages}: Seq1F1B uses looped "
            f"placement (stage s on rank s % pp, the same number on every rank), so this "
            f"rank must hold exactly {expected}. Build num_stages = pp * stages_per_rank "
            "stages and give rank r the stages r, r + pp, r + 2*pp, ..."
        )
    return stage_list
