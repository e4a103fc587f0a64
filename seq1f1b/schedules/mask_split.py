"""The compute split of a step's real mask: packed documents (and sliding windows).

Under a plain causal mask a later position attends to more keys, so the compute split
(:func:`seq1f1b.schedules.partition.compute_balanced_split`) makes later segments shorter. Under a
document mask a position sees only its own document: with documents much shorter than the
sequence the per-position cost is nearly flat, and the causal split would make the early
segments the expensive ones. :func:`mask_balanced_split` balances the FLOPs of the mask the
step really has, from its ``document_ids`` (every rank has them, so every rank computes the
same lengths without a collective). Vectorized over the positions; :class:`MaskSplitCache`
keeps the answer per distinct layout.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from .partition import (
    ModelShape,
    compute_balanced_split,
    cuts_to_lengths,
    token_cost,
    uniform_split,
)

__all__ = [
    "MaskSplitCache",
    "attended_keys_per_position",
    "mask_balanced_split",
    "model_keys_per_position",
    "segment_costs",
]


def _rows(document_ids: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """All rows of a step's documents as one (rows, seq_len) tensor (on the CPU)."""
    if isinstance(document_ids, torch.Tensor):
        ids = document_ids
    else:
        ids = torch.cat([d.reshape(-1, d.shape[-1]) for d in document_ids])
    return ids.reshape(-1, ids.shape[-1]).detach().to("cpu")


def document_starts(document_ids: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """(rows, seq_len) bool: True where a document starts (position 0 always)."""
    ids = _rows(document_ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


def attended_keys_per_position(
    document_ids: torch.Tensor | Sequence[torch.Tensor] | None,
    seq_len: int | None = None,
    window: int | None = None,
    sinks: int = 0,
) -> torch.Tensor:
    """Keys each position attends to under the mask, averaged over the rows (float64).

    The vectorized form of :func:`seq1f1b.schedules.partition.attended_keys` (same numbers): causal
    within each document, at most ``window`` keys, plus the first ``sinks`` positions.
    ``document_ids`` None: one causal document of ``seq_len`` positions.
    """
    if document_ids is None:
        if seq_len is None:
            raise ValueError("attended_keys_per_position: pass document_ids or seq_len")
        starts = torch.zeros(1, seq_len, dtype=torch.bool)
        starts[:, 0] = True
    else:
        starts = document_starts(document_ids)
    length = starts.shape[-1]
    pos = torch.arange(length, dtype=torch.int64)
    start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=-1).values
    lo = start if window is None else torch.maximum(start, pos - window + 1)
    keys = pos - lo + 1
    if window is not None and sinks:
        keys = keys + (torch.clamp(lo, max=sinks) - start).clamp(min=0)
    return keys.to(torch.float64).mean(dim=0)


def model_keys_per_position(
    document_ids: torch.Tensor | Sequence[torch.Tensor] | None,
    shape: ModelShape,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Keys per position averaged over the model's layers: the windowed layers
    (``shape.window``, ``shape.sinks`` on ``shape.window_layers``) and the full ones."""
    full = attended_keys_per_position(document_ids, seq_len)
    if shape.window is None:
        return full
    windowed = attended_keys_per_position(document_ids, seq_len, shape.window, shape.sinks)
    w = shape.window_layers or shape.n_layers
    return (w * windowed + (shape.n_layers - w) * full) / shape.n_layers


def _prefix_flops(keys: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """FLOPs of positions ``0..p`` for every ``p`` (float64)."""
    base, per_key = token_cost(shape)
    return torch.cumsum(base + per_key * keys, dim=0)


def segment_costs(prefix: torch.Tensor, lengths: Sequence[int]) -> list[float]:
    """Each segment's FLOPs from the prefix sums of the per-position FLOPs."""
    ends = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    upto = prefix[ends - 1]
    return torch.diff(upto, prepend=upto.new_zeros(1)).tolist()


def mask_balanced_split(
    document_ids: torch.Tensor | Sequence[torch.Tensor] | None,
    k: int,
    shape: ModelShape,
    *,
    seq_len: int | None = None,
    window: int | None = None,
    sinks: int = 0,
    multiple_of: int = 1,
) -> list[int]:
    """``k`` segment lengths with (nearly) equal FLOPs under the step's real mask.

    The FLOPs of position ``p`` are its share of every matmul plus attention over the keys it
    sees (:func:`attended_keys_per_position`, averaged over all rows of the step: every
    sample is cut the same way). Cuts fall where the prefix sum crosses ``j/k`` of the
    total, rounded to ``multiple_of``. Never costlier in its largest segment than the uniform
    or the causal compute split under the same mask (the pipeline runs at the pace of its
    costliest segment): the best of the three is returned. ``window``/``sinks`` given here
    apply to every layer; otherwise the model's (``shape.window`` ...) are used.
    """
    if window is None:
        keys = model_keys_per_position(document_ids, shape, seq_len)
    else:
        keys = attended_keys_per_position(document_ids, seq_len, window, sinks)
    length = keys.shape[0]
    prefix = _prefix_flops(keys, shape)
    total = prefix[-1]
    targets = total * torch.arange(1, k, dtype=torch.float64) / k
    cuts = (torch.searchsorted(prefix, targets) + 1).tolist()
    balanced = cuts_to_lengths(cuts, length, k, multiple_of)
    candidates = [
        balanced,
        uniform_split(length, k, multiple_of),
        compute_balanced_split(length, k, shape, multiple_of),
    ]
    return min(candidates, key=lambda ls: max(segment_costs(prefix, ls)))


class MaskSplitCache:
    """Mask-aware lengths per distinct document layout (bounded: least recently used out).

    The key is the layout itself (where documents start, row by row), so two steps with the
    same packing share one answer and a changed packing never reuses a stale one.
    """

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, list[int]] = OrderedDict()

    def lengths(
        self,
        document_ids: torch.Tensor | Sequence[torch.Tensor],
        k: int,
        shape: ModelShape,
        *,
        window: int | None = None,
        sinks: int = 0,
        multiple_of: int = 1,
    ) -> list[int]:
        starts = document_starts(document_ids)
        key = (
            tuple(starts.shape),
            starts.nonzero().numpy().tobytes(),
            k,
            shape,
            window,
            sinks,
            multiple_of,
        )
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return list(hit)
        lengths = mask_balanced_split(
            document_ids, k, shape, window=window, sinks=sinks, multiple_of=multiple_of
        )
        self._entries[key] = lengths
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return list(lengths)
