"""A depthwise causal convolution over the sequence that continues from the last inputs of
the previous segment (Gated DeltaNet's and Mamba's short convolution).

Output position ``t`` reads inputs ``t-W+1 .. t``; at a segment's start the first ``W-1`` of
those belong to the previous segment, whose last ``W-1`` inputs are the carried ``tail``
(zeros at the sample's start). Inputs of another document never reach a position (packed
rows): a piece that opens a document starts from zeros, as the unsegmented convolution does
with per-document offsets. Under context parallelism the tail a run starts from comes from
other ranks' runs: :func:`tail_transition` gives a run's new tail as an affine map of the one
it starts from, for :func:`seq1f1b.attention.carried_cp.affine_scan`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .carried import Piece

__all__ = ["causal_conv1d", "tail_transition"]


def _conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    """(B, L, D) convolved, left-padded with ``tail`` (B, W-1, D) or zeros."""
    width = weight.shape[-1]
    pad = x.new_zeros(x.shape[0], width - 1, x.shape[2]) if tail is None else tail.to(x.dtype)
    ext = torch.cat([pad, x], 1).transpose(1, 2)
    return F.conv1d(ext, weight.to(x.dtype), None, groups=weight.shape[0]).transpose(1, 2)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    tail: torch.Tensor | None,
    pieces: Sequence[Piece] | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, L, D) convolved with the depthwise ``weight`` (D, 1, W), continuing from
    ``tail`` (B, W-1, D; None: zeros) where a piece continues its document; returns the output
    (after ``activation``) and the new tail: the last ``W-1`` inputs each row's last document
    has seen (fewer positions than that are padded with what preceded them in the document)."""
    width = weight.shape[-1]
    if pieces is None or (len(pieces) == 1 and pieces[0].b - pieces[0].a == x.shape[1]):
        use = tail if pieces is None or pieces[0].continues else None
        y = _conv(x, weight, use)
        last = _tail(x, use, width)
    else:
        rows: dict[tuple[int, int], list[torch.Tensor]] = {}
        tails: dict[tuple[int, int], torch.Tensor] = {}
        for p in sorted(pieces, key=lambda p: (p.r0, p.a)):
            use = tail[p.r0 : p.r1] if p.continues and tail is not None else None
            xp = x[p.r0 : p.r1, p.a : p.b]
            rows.setdefault((p.r0, p.r1), []).append(_conv(xp, weight, use))
            tails[p.r0, p.r1] = _tail(xp, use, width)
        keys = sorted(rows)
        y = torch.cat([torch.cat(rows[key], 1) for key in keys], 0)
        last = torch.cat([tails[key] for key in keys], 0)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"causal_conv1d(activation={activation!r}): use 'silu' or None")
    return y, last


def _tail(x: torch.Tensor, tail: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last ``width-1`` inputs of ``tail`` followed by ``x``."""
    keep = width - 1
    if x.shape[1] >= keep:
        return x[:, x.shape[1] - keep :]
    pad = x.new_zeros(x.shape[0], keep, x.shape[2]) if tail is None else tail.to(x.dtype)
    return torch.cat([pad, x], 1)[:, -keep:]


def tail_transition(
    x: torch.Tensor, pieces: Sequence[Piece], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail :func:`causal_conv1d` returns for ``x`` (B, L, D) cut into ``pieces``, as an
    affine map of the tail it starts from: ``new = M @ tail + E`` with ``M`` (B, W-1, W-1) a
    0/1 shift (nonzero only where the row's last piece is shorter than the tail and continues
    its document) and ``E`` (B, W-1, D) the row's last inputs (zeros before a document start)."""
    keep = width - 1
    b = x.shape[0]
    shift = x.new_zeros(b, keep, keep)
    last_inputs = x.new_zeros(b, keep, x.shape[2])
    last: dict[tuple[int, int], Piece] = {}
    for p in pieces:  # each row group's last piece (it ends where the run ends)
        key = (p.r0, p.r1)
        if key not in last or p.a > last[key].a:
            last[key] = p
    for (r0, r1), p in last.items():
        n = min(p.b - p.a, keep)
        if n:
            last_inputs[r0:r1, keep - n :] = x[r0:r1, p.b - n : p.b]
        if n < keep and p.continues:
            idx = torch.arange(keep - n, device=x.device)
            shift[r0:r1, idx, idx + n] = 1
    return shift, last_inputs
