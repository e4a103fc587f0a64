"""Catches attention the schedule cannot see: a stage that mixes sequence positions in the
forward of a later segment without one chunk-aware attention call.

A segment's forward must reach every earlier position through the chunk-aware attention (the
K/V cache); anything else that combines positions (attention written by hand, a foreign kernel
such as flash-attn's or xformers', a convolution or a norm over the sequence) sees only the
running segment, so the result is silently wrong. In the guarded first step, a stage forward of
a later segment that made no chunk-aware call (an attention call or a carried-state read) is
run once more (no gradients, the same random state) with the segment's first position
changed: if any later position's output moves, the stage mixes positions itself and the step
fails naming the fix. A declared carried state is seen, and the first-step output check holds
it to the whole-sequence run. Attention-free stages (embedding, MLP, head) pass: each output
position depends on its own input position only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PositionMixingError", "mixes_positions", "mixing_error"]


class PositionMixingError(RuntimeError):
    """A stage combines sequence positions outside the chunk-aware attention."""

    def __init__(self, message: str, stage_index: int, segment: int) -> None:
        super().__init__(message)
        self.stage_index, self.segment = stage_index, segment


def _perturbed(x: Any, seq_dim: int) -> tuple[Any, bool]:
    """``x`` with its first position along ``seq_dim`` changed (tokens: another id)."""
    if not isinstance(x, torch.Tensor) or x.dim() <= seq_dim or x.shape[seq_dim] < 2:
        return x, False
    y = x.clone()
    first = y.narrow(seq_dim, 0, 1)
    if y.is_floating_point():
        first.add_(1.0 + first.abs())
    else:
        first.copy_(torch.where(first > 0, first - 1, first + 1))
    return y, True


def mixes_positions(
    module: nn.Module, args: tuple, kwargs: dict, output: Any, seq_dim: int, length: int
) -> bool:
    """Whether ``module``'s output after position 0 depends on the input at position 0, for a
    segment of ``length`` positions on this rank. Inputs of another length along the sequence
    are shards of it (sequence parallelism): every rank's first position moves at once and
    the shards are gathered, so such a stage is not probed (False)."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > seq_dim), None)
    if first is not None and first.shape[seq_dim] != length:
        return False
    changed, any_changed = [], False
    for a in args:
        b, did = _perturbed(a, seq_dim) if not any_changed else (a, False)
        changed.append(b)
        any_changed = any_changed or did
    out = output[0] if isinstance(output, tuple) else output
    if not any_changed or not isinstance(out, torch.Tensor) or out.dim() <= seq_dim:
        return False
    if out.shape[seq_dim] < 2:
        return False
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        again = module(*changed, **kwargs)
    again = again[0] if isinstance(again, tuple) else again
    rest = out.detach().narrow(seq_dim, 1, out.shape[seq_dim] - 1).float()
    moved = again.narrow(seq_dim, 1, again.shape[seq_dim] - 1).float()
    scale = rest.abs().max().clamp_min(1e-6)
    return bool(((moved - rest).abs().max() / scale) > 1e-4)


def mixing_error(stage_index: int, segment: int) -> PositionMixingError:
    return PositionMixingError(
        f"stage {stage_index} combines sequence positions in the forward of segment {segment} "
        "without calling the chunk-aware attention: attention written by hand (softmax(QK^T)V), "
        "a foreign kernel (flash-attn, xformers, a fused SDPA), a recurrent layer whose state is "
        "not carried (Gated DeltaNet, Mamba, an RNN) or a layer that mixes positions (a "
        "convolution, a norm over the sequence). Under Seq1F1B such a layer sees only the "
        "running segment, so training would be silently wrong. Route attention through "
        "seq1f1b.chunk_aware_attention(q, k, v, layer=...) or ChunkAwareAttention, carry a "
        "recurrent state with seq1f1b.carried_state(layer) (ChunkAwareGatedDeltaNet does), and "
        "keep other layers per-position; seq1f1b.verify_model(...) checks a model before training "
        "(check_attention=False turns this check off).",
        stage_index,
        segment,
    )
