"""Splitting a batch into Seq1F1B units (sample microbatch x sequence segment) and back.

torch's ``step()`` splits along the batch dim only; Seq1F1B also cuts every per-token tensor
along the sequence dim with the same segment lengths, so inputs, targets and per-token kwargs
(positions, ...) of a unit line up. Unit ``u = m * K + k``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    merge_chunks,
    split_args_kwargs_into_chunks,
)

from .._runtime import is_fake
from ..attention.masks import Runs
from .upstream import _merge_segments, _split_into_segments

__all__ = [
    "count_tokens",
    "merge_unit_outputs",
    "split_presplit_units",
    "split_target",
    "split_units",
]


Lengths = Sequence[int] | Sequence[Sequence[int]]  # one cut for every sample, or one each


def per_sample(lengths: Lengths, n_samples: int) -> list[Sequence[int]]:
    """``lengths`` as one list of segment lengths per sample."""
    if all(isinstance(n, int) for n in lengths):
        return [lengths] * n_samples  # type: ignore[list-item]
    if len(lengths) != n_samples:
        raise ValueError(
            f"got segment lengths for {len(lengths)} samples but the batch is cut into "
            f"{n_samples}: pass one list of lengths per sample, or one list for all"
        )
    return list(lengths)  # type: ignore[arg-type]


def _cut(t: torch.Tensor, dim: int, lengths: Sequence[int], what: str) -> list[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] != sum(lengths):
        raise ValueError(
            f"{what} has shape {tuple(t.shape)} but Seq1F1B splits dim {dim} into segments "
            f"{list(lengths)} (sum {sum(lengths)}): give it the full sequence length at that dim, "
            "set seq_dim to the sequence dimension, or for a kwarg that is not per-token pass "
            "kwargs_seq_dims={name: None}"
        )
    return _split_into_segments(t, lengths, dim)


def split_units(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    n_microbatches: int,
    lengths: Lengths,
    seq_dim: int,
    *,
    args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
    kwargs_seq_dims: Mapping[str, int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split along the batch (torch's chunk specs) and then along ``seq_dim`` into units
    (``lengths``: one cut for every sample, or one per sample)."""
    samples = per_sample(lengths, n_microbatches)
    if not args and not kwargs:
        n = sum(len(ls) for ls in samples)
        return [()] * n, [{}] * n
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.shape[0] % n_microbatches != 0:
            raise ValueError(
                f"positional input {i} has batch size {a.shape[0]}, not divisible by "
                f"n_microbatches={n_microbatches}: use a batch size that is a multiple of it"
            )
    arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
        args, kwargs, n_microbatches, args_chunk_spec, kwargs_chunk_spec
    )
    unit_args: list[tuple[Any, ...]] = []
    unit_kwargs: list[dict[str, Any]] = []
    for mb_args, mb_kwargs, ls in zip(arg_mbs, kwarg_mbs, samples, strict=True):
        a, kw = _cut_sample(mb_args, mb_kwargs, ls, seq_dim, kwargs_seq_dims)
        unit_args.extend(a)
        unit_kwargs.extend(kw)
    return unit_args, unit_kwargs


def _holds_tensors(value: Any, depth: int = 2) -> bool:
    """A structured value (BlockMask, varlen metadata, containers) with tensors inside."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, str | bytes | int | float | bool | type(None)):
        return False
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, tuple | list):
        items = value
    else:
        slots = getattr(type(value), "__slots__", ())
        fields = [getattr(value, n, None) for n in ([slots] if isinstance(slots, str) else slots)]
        items = [*vars(value).values(), *fields] if hasattr(value, "__dict__") else fields
    return any(_holds_tensors(v, depth - 1) for v in items)


def _cut_sample(
    mb_args: Sequence[Any],
    mb_kwargs: Mapping[str, Any],
    lengths: Sequence[int],
    seq_dim: int,
    kwargs_seq_dims: Mapping[str, int | None] | None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """One sample's args and kwargs cut into its K segments along the sequence."""
    k = len(lengths)
    seq_dims = dict(kwargs_seq_dims or {})
    cut_args = [
        _cut(a, seq_dim, lengths, f"positional input {i}")
        if isinstance(a, torch.Tensor)
        else [a] * k
        for i, a in enumerate(mb_args)
    ]
    cut_kwargs: dict[str, list[Any]] = {}
    for name, value in mb_kwargs.items():
        dim = seq_dims.get(name, seq_dim)
        if isinstance(value, torch.Tensor) and dim is not None:
            cut_kwargs[name] = _cut(value, dim, lengths, f"kwarg {name!r}")
        elif k > 1 and dim is not None and _holds_tensors(value):
            raise ValueError(
                f"kwarg {name!r} is a {type(value).__name__} holding tensors (e.g. an attention "
                "mask built for the whole sequence): it cannot be cut into segments, and each "
                "segment would get the full-sequence one. Pass packed documents as "
                "step(document_ids=...) and drop the mask (chunk-aware attention builds each "
                f"segment's own), or pass kwargs_seq_dims={{{name!r}: None}} to hand every "
                "segment the same object on purpose"
            )
        else:
            cut_kwargs[name] = [value] * k
    args = [tuple(c[seg] for c in cut_args) for seg in range(k)]
    kwargs = [{name: c[seg] for name, c in cut_kwargs.items()} for seg in range(k)]
    return args, kwargs


def split_presplit_units(
    arg_mbs: Sequence[tuple[Any, ...]],
    kwarg_mbs: Sequence[dict[str, Any]],
    target_mbs: Sequence[Any] | None,
    lengths: Lengths,
    seq_dim: int,
    kwargs_seq_dims: Mapping[str, int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[Any] | None]:
    """Samples already split along the batch (torch's ``arg_mbs`` ...) cut into segments."""
    samples = per_sample(lengths, len(arg_mbs))
    unit_args: list[tuple[Any, ...]] = []
    unit_kwargs: list[dict[str, Any]] = []
    for mb_args, mb_kwargs, ls in zip(arg_mbs, kwarg_mbs, samples, strict=True):
        if not isinstance(mb_args, tuple | list) or not isinstance(mb_kwargs, dict):
            raise ValueError(
                "arg_mbs entries must be tuples and kwarg_mbs entries dicts (one per sample)"
            )
        a, kw = _cut_sample(mb_args, mb_kwargs, ls, seq_dim, kwargs_seq_dims)
        unit_args.extend(a)
        unit_kwargs.extend(kw)
    targets = None
    if target_mbs is not None:
        targets = [
            u
            for t, ls in zip(target_mbs, samples, strict=True)
            for u in _cut(t, seq_dim, ls, "target")
        ]
    return unit_args, unit_kwargs, targets


def split_target(
    target: torch.Tensor, n_microbatches: int, lengths: Lengths, seq_dim: int
) -> list[torch.Tensor]:
    """Targets split like the inputs: batch dim 0 into M, then ``seq_dim`` into segments."""
    if target.shape[0] % n_microbatches != 0:
        raise ValueError(
            f"target has batch size {target.shape[0]}, not divisible by "
            f"n_microbatches={n_microbatches}: use a batch size that is a multiple of it"
        )
    units: list[torch.Tensor] = []
    samples = per_sample(lengths, n_microbatches)
    for mb, ls in zip(torch.tensor_split(target, n_microbatches, dim=0), samples, strict=True):
        units.extend(_cut(mb, seq_dim, ls, "target"))
    return units


def count_tokens(target: torch.Tensor, ignore_index: int | None) -> int:
    """Tokens that count towards a mean loss: integer targets not equal to ``ignore_index``
    (every token of a dry run's fake target, which holds no values)."""
    if ignore_index is not None and not target.is_floating_point() and not is_fake(target):
        return int((target != ignore_index).sum().item())
    return target.numel()


def merge_unit_outputs(
    outputs: list[Any], n_microbatches: int, seq_dim: int, output_merge_spec: Any = None
) -> Any:
    """Concatenate each sample's segment outputs along ``seq_dim`` (patch 6's
    ``_merge_segments``), then merge samples. Any pytree output merges leaf by leaf (a dict
    or a model-output dataclass as torch's ``merge_chunks`` does); every unit must return the
    same structure, since a leaf missing from one segment has no whole-sample value."""
    if not outputs or len(outputs) % n_microbatches != 0:
        return outputs
    layouts = {_layout(out) for out in outputs}
    if len(layouts) > 1:
        raise ValueError(_MIXED_OUTPUTS.format(layouts=sorted(map(str, layouts))[:2]))
    try:
        samples = _merge_segments(outputs, len(outputs) // n_microbatches, seq_dim)
    except ValueError as e:  # leaves differ in number between segments
        raise ValueError(_MIXED_OUTPUTS.format(layouts=e)) from e
    return merge_chunks(samples, output_merge_spec)


_MIXED_OUTPUTS = (
    "The last stage's output differs in structure between sequence segments ({layouts}): "
    "Seq1F1B joins each output leaf along the sequence, so the model must return the same "
    "structure (type, tuple length, dict keys, optional fields) for every segment."
)


def _layout(output: Any) -> tuple[Any, ...]:
    """An output's top-level structure: its type, and its keys or length."""
    if isinstance(output, Mapping):
        return (type(output).__name__, tuple(output))
    if isinstance(output, (tuple, list)):
        return (type(output).__name__, len(output))
    return (type(output).__name__,)


def shard_sequence(t: torch.Tensor, dim: int, runs: Runs, start: int) -> torch.Tensor:
    """The positions ``runs`` of ``t``, whose index 0 along ``dim`` is position ``start``
    (a context-parallel rank's share of one segment)."""
    pieces = [t.narrow(dim, a - start, b - a) for a, b in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def shard_units(
    unit_args: list[tuple[Any, ...]],
    unit_kwargs: list[dict[str, Any]],
    unit_targets: list[Any] | None,
    shards: Sequence[tuple[Runs, int]],
    seq_dim: int,
    kwargs_seq_dims: Mapping[str, int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[Any] | None]:
    """Units cut down to this rank's context-parallel shard: ``shards[u]`` is the unit's
    ``(runs, segment start)``. Tensors are cut where :func:`split_units` cut them."""
    seq_dims = dict(kwargs_seq_dims or {})
    args_out, kwargs_out = [], []
    for (runs, start), args, kwargs in zip(shards, unit_args, unit_kwargs, strict=True):
        args_out.append(
            tuple(
                shard_sequence(a, seq_dim, runs, start) if isinstance(a, torch.Tensor) else a
                for a in args
            )
        )
        kw = {}
        for name, value in kwargs.items():
            dim = seq_dims.get(name, seq_dim)
            if isinstance(value, torch.Tensor) and dim is not None:
                value = shard_sequence(value, dim, runs, start)
            kw[name] = value
        kwargs_out.append(kw)
    targets = None
    if unit_targets is not None:
        targets = [
            shard_sequence(t, seq_dim, runs, start)
            for (runs, start), t in zip(shards, unit_targets, strict=True)
        ]
    return args_out, kwargs_out, targets
