"""``LossChecks``: what a schedule checks of its ``loss_fn`` and of a step's targets, so that a
wrong loss or a misplaced target fails by name on every rank, and a sum-reduced loss is never
scaled down silently.

At construction: the loss takes ``(output, target)``, and a loss that says it sums
(``reduction="sum"``) is refused unless the schedule runs sums. Before a step's traffic (the
pre-flight raises what this rank finds on every rank): the last stage has a target, the loss
takes the step's ``loss_kwargs``, gradients are enabled. At the first unit: a loss meant as a
mean is tested for a sum (:func:`~.preflight.sum_reduced`). The checks themselves are in
:mod:`.preflight`; this class holds what they need between calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .preflight import (
    check_loss_call,
    check_loss_fn,
    check_targets,
    declared_sum,
    sum_loss_error,
    sum_reduced,
)

__all__ = ["LossChecks"]


class LossChecks:
    """One schedule's loss checks (see the module docstring). ``fix``: what the refusal of a
    sum loss advises (``loss_reduction='sum'``, or ``scale_grads=False`` for BitPipe)."""

    def __init__(self, loss_fn: Callable[..., Any] | None, n_units: int, fix: str,
                 scales_a_mean: bool = True) -> None:  # fmt: skip
        self.loss_fn, self.n_units, self.fix = loss_fn, n_units, fix
        self.signature = check_loss_fn(loss_fn)  # on every rank, before any traffic
        if scales_a_mean and declared_sum(loss_fn):
            raise sum_loss_error(n_units, fix)
        #: the first unit still has to show that the loss is a mean (a loss that takes the
        #: unit weight is the library's own, a mean)
        self.unchecked = scales_a_mean and not getattr(loss_fn, "takes_unit_weight", False)

    def before_step(self, schedule: Any, target: Any, target_mbs: Any,
                    loss_kwargs: Mapping[str, Any] | None = None,
                    needs_grad: bool | None = None) -> tuple[Exception | None, str | None]:
        """What this rank can tell is wrong with ``schedule``'s step before any traffic: a
        last stage without a target, a loss that does not take this step's ``loss_kwargs``,
        training under ``no_grad`` (``needs_grad`` None: the schedule's backward needs
        autograd). Returns (error, a note for the other ranks' errors)."""
        stages: Sequence[Any] = schedule.local_stages
        rank, has_target = schedule.rank, target is not None or target_mbs is not None
        if needs_grad is None:
            needs_grad = schedule.has_backward and schedule.backward_requires_autograd
        has_last = any(s.is_last for s in stages)
        loss = self.loss_fn
        error, note = check_targets(has_last, loss is not None, has_target, rank,
                                    [s.stage_index for s in stages])  # fmt: skip
        if error is None and has_last and loss is not None:
            takes = getattr(loss, "takes_unit_weight", False)
            error = check_loss_call(loss, self.signature, loss_kwargs, takes)
        if error is None and needs_grad and not torch.is_grad_enabled():
            error = RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should "
                "not be used under torch.no_grad() context. Please call eval() instead."
            )
        return error, note

    def after_unit(self, output: Any, target: Any, loss: torch.Tensor,
                   loss_kwargs: Mapping[str, Any] | None, seq_dim: int | None,
                   weight: float = 1.0) -> torch.Tensor:  # fmt: skip
        """The unit's loss, a 0-weight unit's NaN (0/0) mean as 0; at the first unit that
        tells, a loss meant as a mean that sums is refused (``seq_dim`` None: the sequence is
        dim 1 of a 3-d output, else dim 0)."""
        if weight == 0.0:
            loss = torch.where(loss.isnan(), torch.zeros_like(loss), loss)
        if not self.unchecked or loss_kwargs or self.loss_fn is None:
            return loss
        if seq_dim is None:
            seq_dim = 1 if isinstance(output, torch.Tensor) and output.dim() > 2 else 0
        verdict = sum_reduced(self.loss_fn, output, target, loss, seq_dim)
        if verdict is not None:  # one unit that tells is enough
            self.unchecked = False
        if verdict:
            raise sum_loss_error(self.n_units, self.fix)
        return loss

    @classmethod
    def of_reduction(cls, loss_fn: Callable[..., Any] | None, n_units: int, reduction: str,
                     scale_grads: bool, context_parallel: Any) -> tuple[LossChecks, bool]:
        """The checks of a Seq1F1B schedule run with ``loss_reduction=reduction``, and its
        ``scale_grads`` (a sum: each unit's loss as it is, the gradient of the step's sum)."""
        _check_reduction(reduction, context_parallel)
        scale = scale_grads and reduction == "mean"
        return cls(loss_fn, n_units, "loss_reduction='sum'", scale), scale


def _check_reduction(reduction: str, context_parallel: Any) -> None:
    """``loss_reduction`` is "mean" or "sum"; "sum" is not combined with context parallelism
    (its gradients are averaged over the CP group, a mean's rule)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"loss_reduction={reduction!r}: use 'mean' (loss_fn averages over its tokens, the "
            "default) or 'sum' (loss_fn sums over its tokens)"
        )
    if reduction == "sum" and context_parallel is not None:
        raise ValueError(
            "loss_reduction='sum' with context_parallel is not supported (the CP group "
            "averages its gradients): use a mean loss, or scale_grads=False with your own "
            "reduction of the gradients over the CP group (context_parallel="
            "ContextParallelConfig(group, reduce_grads=False))"
        )
