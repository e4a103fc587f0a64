"""A step's inputs as units, read in one pass (:func:`prepare_step`): the pre-split samples,
the sequence length, the packed documents, the cut into (sample, segment) units and each
unit's loss weight. Each input is checked here and only here; the cross-rank agreement is a
callback (:func:`seq1f1b.schedules.preflight.agree_on_step`), so a rank's bad input fails every
rank before any pipeline traffic. Apart from that callback these are pure functions of the
inputs and the schedule's settings, so every rank computes the same thing and a test can call
them directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _runtime as rt
from ..attention.kv import ContextParallel
from ..attention.masks import document_runs
from .microbatch import (
    count_tokens,
    shard_units,
    split_presplit_units,
    split_target,
    split_units,
)
from .partition import segment_offsets

__all__ = [
    "StepDocuments",
    "StepInputs",
    "UnitCutter",
    "check_presplit",
    "prepare_step",
    "split_step_inputs",
    "token_weights",
]

Presplit = tuple[list, list, list | None]
#: (this rank's sequence length or 0, its error or None, whether it has documents) -> the
#: length every rank agrees on; raises on every rank if any rank failed
Agree = Callable[[int, "Exception | None", bool], int]
#: (sequence length, per-sample document ids or None) -> each sample's segment lengths
LengthsOf = Callable[[int, "list[torch.Tensor] | None"], list[list[int]]]


@dataclass(frozen=True)
class StepDocuments:
    """The step's packed documents, per sample: the ids (what the split balances) and their
    runs (what the attention masks and the context-parallel shards follow)."""

    ids: list[torch.Tensor]
    runs: list


@dataclass
class StepInputs:
    """This rank's share of one step, cut into units (``u = m * K + k``)."""

    lengths: list[tuple[int, ...]]  # each sample's segment lengths
    args: list
    kwargs: list
    targets: list | None
    weights: list[float]  # each unit's loss weight (its token share; 1.0 without scaling)
    documents: list | None = None  # each sample's document runs (packed documents), or None

    @property
    def unit_lengths(self) -> list[int]:
        """Every unit's segment length, by unit index."""
        return [n for sample in self.lengths for n in sample]


def check_presplit(
    arg_mbs: list | None, kwarg_mbs: list | None, target_mbs: list | None, n_samples: int
) -> Presplit:
    """Pre-split samples: M entries each (torch's contract, with M = n_microbatches)."""
    out: list[list | None] = []
    for name, mbs, empty in (
        ("arg_mbs", arg_mbs, ()),
        ("kwarg_mbs", kwarg_mbs, {}),
        ("target_mbs", target_mbs, None),
    ):
        if mbs is None:
            out.append(None if name == "target_mbs" else [empty] * n_samples)
            continue
        if not isinstance(mbs, list) or len(mbs) != n_samples:
            raise ValueError(
                f"{name} must be a list of n_microbatches={n_samples} samples (got "
                f"{type(mbs).__name__}): ScheduleSeq1F1B cuts each sample into its "
                "seq_chunks segments itself"
            )
        out.append(mbs)
    return out[0], out[1], out[2]  # type: ignore[return-value]


def split_step_inputs(
    args: tuple,
    kwargs: dict,
    target: Any,
    arg_mbs: list | None,
    kwarg_mbs: list | None,
    target_mbs: list | None,
    n_samples: int,
) -> Presplit | None:
    """The pre-split samples of a step (checked), or None for whole-batch inputs; never both."""
    if all(x is None for x in (arg_mbs, kwarg_mbs, target_mbs)):
        return None
    if args or kwargs or target is not None:
        raise ValueError(
            "step(): pass either whole-batch inputs (args, kwargs, target) or pre-split "
            "samples (arg_mbs, kwarg_mbs, target_mbs), not both"
        )
    return check_presplit(arg_mbs, kwarg_mbs, target_mbs, n_samples)


def token_weights(tokens: Sequence[int], total: int, cp_size: int) -> list[float]:
    """Loss weight of each local unit: its token share of the batch, times the number of
    units and the CP size, so that the mean over units (and over the CP group, as FSDP/DDP
    averaging expects) of the weighted mean losses is the batch's mean loss."""
    scale = len(tokens) * cp_size / total
    return [scale * t for t in tokens]


@dataclass(frozen=True)
class UnitCutter:
    """The schedule's settings for cutting whole-batch (or per-sample) inputs into units."""

    n_samples: int
    seq_chunks: int
    seq_dim: int
    kwargs_seq_dims: Mapping[str, int | None] = field(default_factory=dict)
    ignore_index: int | None = -100
    scale_grads: bool = True
    args_chunk_spec: Any = None
    kwargs_chunk_spec: Any = None

    def seq_len(self, args: tuple, kwargs: dict, target: Any, presplit: Presplit | None) -> int:
        """The sequence length this rank's inputs carry (0: this rank got none)."""
        if presplit is not None:  # the first sample tells the length
            arg_mbs, kwarg_mbs, target_mbs = presplit
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

    def cut(
        self,
        lengths: list[list[int]],
        args: tuple,
        kwargs: dict,
        target: Any,
        presplit: Presplit | None,
        cp: ContextParallel | None,
        documents: list | None = None,
    ) -> StepInputs:
        """Cut this rank's inputs into units (with CP: its share of each, placed for the
        sample's ``documents`` when given) and weigh them."""
        m, dim, seq_dims = self.n_samples, self.seq_dim, dict(self.kwargs_seq_dims)
        if presplit is not None:
            arg_units, kwarg_units, target_units = split_presplit_units(
                *presplit, lengths, dim, seq_dims
            )
        else:
            arg_units, kwarg_units = split_units(
                args,
                kwargs,
                m,
                lengths,
                dim,
                args_chunk_spec=self.args_chunk_spec,
                kwargs_chunk_spec=self.kwargs_chunk_spec,
                kwargs_seq_dims=seq_dims,
            )
            target_units = None if target is None else split_target(target, m, lengths, dim)
        total, counts = 0, []  # tokens per unit (before any CP sharding)
        if target_units is not None and self.scale_grads:
            counts = [count_tokens(t, self.ignore_index) for t in target_units]
            total = sum(counts)
            if total == 0:
                raise ValueError(
                    f"every target of this batch is ignore_index={self.ignore_index}: a mean "
                    "loss over zero tokens is undefined. Drop the batch, or pass "
                    "scale_grads=False with a sum loss"
                )
        if cp is not None:  # keep this CP rank's share of every segment
            shards = [
                (cp.runs(start, start + n, None, docs), start)
                for ls, docs in zip(lengths, documents or [None] * m, strict=True)
                for start, n in zip(segment_offsets(ls), ls, strict=True)
            ]
            arg_units, kwarg_units, target_units = shard_units(
                arg_units, kwarg_units, target_units, shards, dim, seq_dims
            )
        weights = [1.0] * (m * self.seq_chunks)
        if total:  # without CP the units are those counted above: reuse their counts
            tokens = (
                counts if cp is None else [count_tokens(t, self.ignore_index) for t in target_units]
            )
            weights = token_weights(tokens, total, 1 if cp is None else cp.size)
        return StepInputs(lengths, arg_units, kwarg_units, target_units, weights)

    def documents(self, document_ids: Any, seq_len: int) -> StepDocuments:
        """Per-sample document ids and runs, checked against the batch and the length."""
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
        with rt.outside_fake_mode():  # host data, read as such (real ids in a dry run too)
            runs = [document_runs(ids) for ids in samples]
        return StepDocuments(samples, runs)


def prepare_step(
    cutter: UnitCutter,
    step: tuple[tuple, dict, Any, list | None, list | None, list | None],
    document_ids: Any,
    fixed_len: int | None,
    lengths_of: LengthsOf,
    cp: ContextParallel | None,
    agree: Agree,
) -> StepInputs:
    """This rank's units of one step, read in one pass.

    ``step`` is ``(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)`` as ``step()`` got
    them. A rank that carries the sequence checks and cuts its inputs first, so that any
    error reaches ``agree`` (which fails every rank, this one with its own error); a rank
    without a tensor input (a middle stage) learns the length from ``agree`` and cuts then.
    """
    args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs = step
    inputs: StepInputs | None = None
    documents: StepDocuments | None = None
    presplit: Presplit | None = None
    local, error = fixed_len or 0, None
    try:
        presplit = split_step_inputs(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs,
                                     cutter.n_samples)  # fmt: skip
        carried = cutter.seq_len(args, kwargs, target, presplit)
        if fixed_len is not None and carried and carried != fixed_len:
            raise ValueError(
                f"inputs have sequence length {carried} but the schedule was built with "
                f"seq_len={fixed_len}: pass matching inputs or rebuild it"
            )
        local = fixed_len or carried
        if document_ids is not None:
            documents = cutter.documents(document_ids, local)
        if local:
            inputs = _cut(cutter, local, (args, kwargs, target, presplit), documents,
                          lengths_of, cp)  # fmt: skip
    except Exception as exc:  # any error of this rank's inputs fails every rank, named
        error = exc
    agreed = agree(local, error, document_ids is not None)
    if inputs is None:  # a rank without inputs learns the length from the others
        inputs = _cut(cutter, agreed, (args, kwargs, target, presplit), documents, lengths_of, cp)
    elif sum(inputs.lengths[0]) != agreed:
        raise ValueError(
            f"this rank's inputs have sequence length {sum(inputs.lengths[0])} but another "
            f"rank's have {agreed}: pass the same sequence length on every rank"
        )
    return inputs


def _cut(
    cutter: UnitCutter,
    seq_len: int,
    step: tuple[tuple, dict, Any, Presplit | None],
    documents: StepDocuments | None,
    lengths_of: LengthsOf,
    cp: ContextParallel | None,
) -> StepInputs:
    """The units for ``seq_len`` tokens, each sample cut for its own documents."""
    ids = None if documents is None else documents.ids
    lengths = [tuple(sample) for sample in lengths_of(seq_len, ids)]
    runs = None if documents is None else documents.runs
    inputs = cutter.cut(lengths, *step, cp, runs)
    inputs.documents = runs
    return inputs
