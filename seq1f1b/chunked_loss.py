"""The output head and the loss of the last stage, a few positions at a time.

Under Seq1F1B the last stage runs every segment of a sample forward before the first of its
backwards (the last segment's backward comes first, and it needs all the K/V before it). With a
plain loss each of those forwards keeps its vocabulary-wide state for backward (logits and
log-probabilities, ``tokens x vocab`` in fp32), so the last stage holds a whole sample's of
them: 16.8 GB at Llama3's 128,256 vocabulary and 32k tokens.

:class:`ChunkedLoss` is the stage's head and loss in one: it takes the hidden states (the last
stage runs without its head), and for each chunk of a few positions it runs head + loss and
that chunk's backward at once, keeping only the gradient of the hidden states. Until the unit's
own backward the stage then holds ``tokens x hidden`` (fp32), not ``tokens x vocab``. The
returned loss is differentiable: its backward hands the kept gradient to the decoder (the
mechanism of torchtitan 0.3's ``ChunkedLossWrapper``, here per unit and for segments of any
length). The head's weight gradients accumulate during the forward, as in torchtitan.

A schedule passes each unit's loss weight (its token share, :func:`seq1f1b.schedules.step_inputs.
token_weights`) as ``weight=``, since the head's backward runs inside the call.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from . import _runtime as rt
from .attention.kv import inferring_metadata

__all__ = ["ChunkedLoss", "sum_cross_entropy"]


def sum_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Cross-entropy summed over the tokens (fp32), ``ignore_index`` targets left out."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), target.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _HandBackHidden(torch.autograd.Function):
    """The loss value; its backward is the hidden states' gradient, computed in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, grad: torch.Tensor, value: torch.Tensor):
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.hidden_dtype), None, None


class ChunkedLoss:
    """``loss = ChunkedLoss(head)(hidden, target)``: the head and the loss in chunks of at most
    ``chunk_tokens`` positions along ``seq_dim`` (or ``num_chunks`` per call), with each chunk's
    backward run at once so that no vocabulary-wide tensor outlives its chunk.

    ``loss_fn(logits, target, **loss_kwargs)`` must add up over tokens (a sum, or a sum divided
    by a count fixed for the whole batch, as torchtitan's ``global_valid_tokens``); the default is
    :func:`sum_cross_entropy`. ``normalize="mean"`` divides the total by the call's non-ignored
    targets, giving ``F.cross_entropy``'s mean over the unit; ``"none"`` keeps the sum.
    ``head`` may be a module or a zero-argument callable returning it (torchtitan sets its
    ``lm_head`` after the model is built).

    Not for gradient scalers that scale the loss: the head's gradients are made in the forward
    (the returned loss's backward scales only the part below the head).
    """

    takes_unit_weight = True  # schedules pass weight= instead of scaling the returned loss

    def __init__(
        self,
        head: nn.Module | Callable[[], nn.Module],
        loss_fn: Callable[..., Any] | None = None,
        *,
        chunk_tokens: int | None = None,
        num_chunks: int | None = None,
        seq_dim: int = 1,
        normalize: str = "mean",
        ignore_index: int = -100,
    ) -> None:
        if (chunk_tokens is None) == (num_chunks is None):
            raise ValueError("ChunkedLoss: pass exactly one of chunk_tokens or num_chunks")
        for name, value in (("chunk_tokens", chunk_tokens), ("num_chunks", num_chunks)):
            if value is not None and (isinstance(value, bool) or int(value) < 1):
                raise ValueError(f"ChunkedLoss: {name} = {value!r} must be a positive integer")
        if normalize not in ("mean", "none"):
            raise ValueError(f"ChunkedLoss: normalize={normalize!r}: use 'mean' or 'none'")
        self._head = head
        self.loss_fn = loss_fn
        self.chunk_tokens, self.num_chunks = chunk_tokens, num_chunks
        self.seq_dim, self.normalize, self.ignore_index = seq_dim, normalize, ignore_index

    @property
    def head(self) -> nn.Module:
        head = self._head
        return head if isinstance(head, nn.Module) else head()

    def chunk_lengths(self, length: int) -> list[int]:
        """How a call of ``length`` positions is cut: equal chunks, the first ones one longer."""
        n = self.num_chunks or -(-length // self.chunk_tokens)  # type: ignore[operator]
        n = max(1, min(n, length))
        base, extra = divmod(length, n)
        return [base + 1] * extra + [base] * (n - extra)

    def _chunk_loss(self, logits: torch.Tensor, target: torch.Tensor, kwargs: dict) -> Any:
        if self.loss_fn is None:
            return sum_cross_entropy(logits, target, self.ignore_index)
        out = self.loss_fn(logits, target, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # torchtitan's (loss, metrics)

    def __call__(
        self, hidden: torch.Tensor, target: torch.Tensor, weight: float = 1.0, **loss_kwargs: Any
    ) -> torch.Tensor:
        if isinstance(hidden, DTensor):  # tensor parallel: chunk the whole sequence
            return self._call_replicated(hidden, target, weight, loss_kwargs)
        return self._call(hidden, target, weight, loss_kwargs, None)

    def _call_replicated(
        self, hidden: DTensor, target: torch.Tensor, weight: float, loss_kwargs: dict
    ) -> torch.Tensor:
        """A sequence-parallel (``Shard(1)``) or replicated hidden DTensor: every rank chunks
        the full sequence and feeds each chunk to the head as ``Replicate()`` (the placement
        a ``ColwiseParallel`` head expects, as torchtitan 0.3's norm emits it). The hidden
        gradient, the same on every rank, goes back through ``full_tensor``'s backward, which
        keeps each rank's share of it."""
        mesh = hidden.device_mesh
        replicate = [Replicate()] * mesh.ndim

        def as_replicated(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t, mesh, replicate, run_check=False)

        return self._call(hidden.full_tensor(), target, weight, loss_kwargs, as_replicated)

    def _call(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        weight: float,
        loss_kwargs: dict,
        as_replicated: Callable[[torch.Tensor], Any] | None,
    ) -> torch.Tensor:
        head, dim = self.head, self.seq_dim
        scale = float(weight)
        if self.normalize == "mean":
            count = int((target != self.ignore_index).sum())
            scale = scale / count if count else 0.0
        if inferring_metadata():  # the stage's shape inference: plain graph, no backward here
            whole = hidden if as_replicated is None else as_replicated(hidden)
            return self._chunk_loss(head(whole), target, loss_kwargs) * scale
        lengths = self.chunk_lengths(hidden.shape[dim])
        targets = torch.split(target, lengths, dim=dim)
        training = hidden.requires_grad and torch.is_grad_enabled()
        source = hidden.detach()
        grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        starts = accumulate([0, *lengths[:-1]])
        with rt.fsdp_held_unsharded(head):  # reduced once, with the stage's
            for length, tgt, start in zip(lengths, targets, starts, strict=True):
                piece = source.narrow(dim, start, length)
                if as_replicated is not None:
                    piece = as_replicated(piece)
                piece.requires_grad_(training)
                with torch.set_grad_enabled(training):
                    loss = self._chunk_loss(head(piece), tgt, loss_kwargs) * scale
                if training:
                    loss.backward()
                    grad.narrow(dim, start, length).copy_(_local(piece.grad))
                total = total + _local(loss.detach()).float()
        if not training:
            return total
        return _HandBackHidden.apply(hidden, grad, total)
