"""Workload-balanced packing: a step's rows rebuilt so their attention costs are even.

torchtitan packs tokenized documents into rows of ``seq_len`` tokens in arrival order, so one
row may hold a 30k-token document and the next sixty short ones. Under per-document
(block-causal) attention a row's attention cost is the sum of its documents' squared lengths,
and a pipeline runs at the pace of its costliest row. Following WLB-LLM (OSDI'25), the pieces
(documents, or parts of them) of a step's rows are reassigned among those rows by a
longest-processing-time greedy, so that the costliest row costs as little as the pieces
allow. Every (input, label) token pair moves with its piece: the step trains on the same
pairs, only grouped into rows differently.

Version-independent (torch and Python only). Rows come either with ``positions`` (torchtitan
0.3: a piece is a maximal run 0, 1, 2, ...) or without them (torchtitan 0.2.2: documents end
at the EOS token, and a piece not ended by EOS continues on the next row, so it is kept at
the end of a row). :class:`BalancedPackingDataset` wraps a dataset of rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

__all__ = [
    "BalancedPackingDataset",
    "Piece",
    "assign_pieces",
    "balance_rows",
    "pieces_from_eos",
    "pieces_from_positions",
    "row_costs",
]


@dataclass(frozen=True)
class Piece:
    """A run of one row's tokens that is one document (or part of one)."""

    row: int
    start: int
    length: int
    open: bool = False
    """The document goes on past the piece's end (EOS-delimited rows only): the piece must
    end its row, or its document would run into the next piece's."""


#: one output row: (piece index, offset in the piece, tokens) runs, in row order
Layout = list[list[tuple[int, int, int]]]


def pieces_from_positions(positions: torch.Tensor) -> list[Piece]:
    """The pieces of ``[rows, seq_len]`` rows by position: a new one starts where a position
    is not its predecessor's plus one (and at each row's start)."""
    rows, seq_len = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    out = []
    for row in range(rows):
        cuts = [*starts[row].nonzero().flatten().tolist(), seq_len]
        out += [Piece(row, a, b - a) for a, b in pairwise(cuts)]
    return out


def pieces_from_eos(inputs: torch.Tensor, eos_id: int) -> list[Piece]:
    """The pieces of ``[rows, seq_len]`` rows by end-of-text token: a piece ends at each EOS
    (which belongs to the document it ends, as ``document_ids_from_eos`` counts them) and at
    the row's end (then it is open: its document continues on the next row)."""
    rows, seq_len = inputs.shape
    out = []
    for row in range(rows):
        ends = (inputs[row] == eos_id).nonzero().flatten().add(1).tolist()
        start = 0
        for end in ends:
            out.append(Piece(row, start, end - start))
            start = end
        if start < seq_len:
            out.append(Piece(row, start, seq_len - start, open=True))
    return out


def _cost(length: int, linear: float) -> float:
    return float(length * length) + linear * length


def row_costs(layout: Layout, linear: float = 0.0) -> list[float]:
    """Each row's cost under ``layout``: the sum over its runs of length^2 (+ linear x length)."""
    return [sum(_cost(n, linear) for _, _, n in row) for row in layout]


def assign_pieces(
    pieces: Sequence[Piece], rows: int, seq_len: int, linear: float = 0.0
) -> Layout | None:
    """Pieces to rows by the longest-processing-time greedy: by descending cost (ties: lower
    index first), each to the cheapest row (ties: lower row) with room for all of it; if no
    row has room, the row with the most free room is filled with the piece's head and the
    rest goes on the same way (it becomes a document of its own, as at a row boundary).

    Every row ends with exactly ``seq_len`` tokens (the pieces must total ``rows x
    seq_len``). An open piece (and a split piece's head) ends its row, so a row takes at most
    one; None when that cannot be met (the caller keeps the arrival order).
    """
    if sum(p.length for p in pieces) != rows * seq_len:
        raise ValueError(
            f"pieces total {sum(p.length for p in pieces)} tokens, not {rows} x {seq_len}"
        )
    free = [seq_len] * rows
    cost = [0.0] * rows
    closed: list[list[tuple[int, int, int]]] = [[] for _ in range(rows)]
    tail: list[tuple[int, int, int] | None] = [None] * rows  # the run that must end the row
    order = sorted(range(len(pieces)), key=lambda i: (-_cost(pieces[i].length, linear), i))
    for i in order:
        piece, offset, left = pieces[i], 0, pieces[i].length
        while left > 0:
            fits = [r for r in range(rows) if free[r] >= left and not (piece.open and tail[r])]
            if fits:
                r = min(fits, key=lambda r: (cost[r], r))
                take = left
            else:  # the head of the piece fills a row to its end; it continues elsewhere
                room = [r for r in range(rows) if free[r] > 0 and tail[r] is None]
                if not room:
                    return None
                r = min(room, key=lambda r: (-free[r], r))
                take = free[r]
            run = (i, offset, take)
            if take < left or piece.open:  # a split head, or the open piece's last run
                tail[r] = run
            else:
                closed[r].append(run)
            free[r] -= take
            cost[r] += _cost(take, linear)
            offset += take
            left -= take
    # rows list their closed runs in arrival order, then the run that must end them
    return [sorted(c) + ([t] if t is not None else []) for c, t in zip(closed, tail, strict=True)]


def balance_rows(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    eos_id: int | None = None,
    linear: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``[rows, seq_len]`` rows with their pieces reassigned (:func:`assign_pieces`) so
    the costliest row costs as little as the greedy finds; each (input, label) pair moves
    with its piece and ``positions`` (when given) restart at 0 on every piece.

    Pieces come from ``positions`` (torchtitan 0.3) or, without them, from ``eos_id``
    (0.2.2). The rows come back unchanged (the same tensors) when the balanced layout is not
    strictly cheaper at its costliest row, or the open-piece constraint cannot be met.
    """
    if inputs.shape != labels.shape or inputs.dim() != 2:
        raise ValueError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must "
                         "be the same [rows, seq_len]")  # fmt: skip
    rows, seq_len = inputs.shape
    if positions is not None:
        if positions.shape != inputs.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match inputs "
                             f"{tuple(inputs.shape)}")  # fmt: skip
        pieces = pieces_from_positions(positions)
    elif eos_id is not None:
        pieces = pieces_from_eos(inputs, eos_id)
    else:
        raise ValueError("balance_rows needs positions (torchtitan 0.3) or eos_id (0.2.2)")
    before = [0.0] * rows
    for p in pieces:
        before[p.row] += _cost(p.length, linear)
    layout = assign_pieces(pieces, rows, seq_len, linear)
    if layout is None or max(row_costs(layout, linear)) >= max(before):
        return inputs, labels, positions
    index, pos = [], []
    for row in layout:
        for i, offset, n in row:
            first = pieces[i].row * seq_len + pieces[i].start + offset
            index.append(torch.arange(first, first + n))
            pos.append(torch.arange(n))
    gather = torch.cat(index).to(inputs.device)
    new_inputs = inputs.reshape(-1)[gather].reshape(rows, seq_len)
    new_labels = labels.reshape(-1)[gather].reshape(rows, seq_len)
    new_positions = None
    if positions is not None:
        new_positions = torch.cat(pos).to(positions).reshape(rows, seq_len)
    return new_inputs, new_labels, new_positions


Row = tuple[Any, torch.Tensor]


class BalancedPackingDataset(IterableDataset, Stateful):
    """Rows of ``inner`` in groups of ``rows_per_step`` (the rows one data-parallel rank
    feeds per step), each group balanced by :func:`balance_rows`, yielded one by one.

    Rows are torchtitan 0.3's ``({"input", "positions"}, labels)`` or 0.2.2's ``(input,
    labels)`` (then ``eos_id`` delimits the documents). Stateful as torchtitan's datasets
    are: the state is ``inner``'s (taken after the current group was drawn) plus the
    balanced rows not yet yielded, so a checkpoint taken mid-group resumes exactly. The
    groups line up with steps as long as one process reads the dataset from its start, or
    from a checkpoint of this wrapper (a dataloader with workers splits it: not supported).
    """

    def __init__(
        self,
        inner: Any,
        rows_per_step: int,
        *,
        eos_id: int | None = None,
        linear: float = 0.0,
    ) -> None:
        if rows_per_step < 1:
            raise ValueError(f"rows_per_step must be >= 1, not {rows_per_step}")
        self.inner = inner
        self.rows_per_step = rows_per_step
        self.eos_id = eos_id
        self.linear = linear
        self._pending: list[Row] = []

    def balance(self, group: Sequence[Row]) -> list[Row]:
        """The group's rows, balanced, in the format they came in."""
        first = group[0][0]
        labels = torch.stack([lab for _, lab in group])
        if isinstance(first, dict):
            extra = set(first) - {"input", "positions"}
            if extra:
                raise ValueError(f"balanced packing moves input, positions and labels only; "
                                 f"the rows also carry {sorted(extra)}")  # fmt: skip
            inputs = torch.stack([x["input"] for x, _ in group])
            has_pos = "positions" in first
            positions = torch.stack([x["positions"] for x, _ in group]) if has_pos else None
            if positions is None and self.eos_id is None:
                return list(group)  # no way to tell the documents apart
            x, y, p = balance_rows(inputs, labels, positions, eos_id=self.eos_id,
                                   linear=self.linear)  # fmt: skip
            return [
                ({"input": x[r], **({"positions": p[r]} if p is not None else {})}, y[r])
                for r in range(len(group))
            ]
        if self.eos_id is None:
            raise ValueError("rows without positions need eos_id to find their documents")
        inputs = torch.stack([x for x, _ in group])
        x, y, _ = balance_rows(inputs, labels, eos_id=self.eos_id, linear=self.linear)
        return [(x[r], y[r]) for r in range(len(group))]

    def __iter__(self) -> Iterator[Row]:
        while self._pending:
            yield self._pending.pop(0)
        source = iter(self.inner)
        while True:
            group = list(islice(source, self.rows_per_step))
            if not group:
                return
            self._pending = self.balance(group)
            while self._pending:
                yield self._pending.pop(0)

    def state_dict(self) -> dict[str, Any]:
        """``inner``'s state and the balanced rows of the current group not yet yielded."""
        return {"inner": self.inner.state_dict(), "pending": list(self._pending)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken: the pending rows first, then ``inner``."""
        self.inner.load_state_dict(state_dict["inner"])
        self._pending = list(state_dict["pending"])
