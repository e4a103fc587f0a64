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

__all__ = ["count_tokens", "merge_unit_outputs", "split_target", "split_units"]


def _cut(t: torch.Tensor, dim: int, lengths: Sequence[int], what: str) -> list[torch.Tensor]:
    if t.dim() <= dim or t.shape[dim] != sum(lengths):
        raise ValueError(
            f"{what} has shape {tuple(t.shape)} but Seq1F1B splits dim {dim} into segments "
            f"{list(lengths)} (sum {sum(lengths)}): give it the full sequence length at that dim, "
            "set seq_dim to the sequence dimension, or for a kwarg that is not per-token pass "
            "kwargs_seq_dims={name: None}"
        )
    return list(torch.split(t, list(lengths), dim=dim))


def split_units(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    n_microbatches: int,
    lengths: Sequence[int],
    seq_dim: int,
    *,
    args_chunk_spec: tuple[TensorChunkSpec, ...] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec] | None = None,
    kwargs_seq_dims: Mapping[str, int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split along the batch (torch's chunk specs) and then along ``seq_dim`` into units."""
    k = len(lengths)
    if not args and not kwargs:
        n = n_microbatches * k
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
    seq_dims = dict(kwargs_seq_dims or {})
    unit_args: list[tuple[Any, ...]] = []
    unit_kwargs: list[dict[str, Any]] = []
    for mb_args, mb_kwargs in zip(arg_mbs, kwarg_mbs, strict=True):
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
            else:
                cut_kwargs[name] = [value] * k
        for seg in range(k):
            unit_args.append(tuple(c[seg] for c in cut_args))
            unit_kwargs.append({name: c[seg] for name, c in cut_kwargs.items()})
    return unit_args, unit_kwargs


def split_target(
    target: torch.Tensor, n_microbatches: int, lengths: Sequence[int], seq_dim: int
) -> list[torch.Tensor]:
    """Targets split like the inputs: batch dim 0 into M, then ``seq_dim`` into segments."""
    if target.shape[0] % n_microbatches != 0:
        raise ValueError(
            f"target has batch size {target.shape[0]}, not divisible by "
            f"n_microbatches={n_microbatches}: use a batch size that is a multiple of it"
        )
    units: list[torch.Tensor] = []
    for mb in torch.tensor_split(target, n_microbatches, dim=0):
        units.extend(_cut(mb, seq_dim, lengths, "target"))
    return units


def count_tokens(target: torch.Tensor, ignore_index: int | None) -> int:
    """Tokens that count towards a mean loss: integer targets not equal to ``ignore_index``."""
    if ignore_index is not None and not target.is_floating_point():
        return int((target != ignore_index).sum().item())
    return target.numel()


def merge_unit_outputs(
    outputs: list[Any], n_microbatches: int, seq_dim: int, output_merge_spec: Any = None
) -> Any:
    """Concatenate each sample's segment outputs along ``seq_dim``, then merge samples."""
    if not outputs or len(outputs) % n_microbatches != 0:
        return outputs
    k = len(outputs) // n_microbatches
    samples: list[Any] = []
    for m in range(n_microbatches):
        segs = outputs[m * k : (m + 1) * k]
        if all(isinstance(s, torch.Tensor) for s in segs):
            samples.append(torch.cat(segs, dim=seq_dim))
        elif all(isinstance(s, tuple) for s in segs):
            samples.append(
                tuple(torch.cat(parts, dim=seq_dim) for parts in zip(*segs, strict=True))
            )
        else:
            return outputs
    return merge_chunks(samples, output_merge_spec)
