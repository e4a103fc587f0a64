"""Trainer pieces both torchtitan versions share (no torchtitan import here).

The PP loss on every rank (:class:`LossBroadcast`), the BitPipe train step
(:class:`TrainerCore`, mixed into both versions' trainers), the TensorBoard run stamp, and
process-group clean-up on failure.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from seq1f1b import ScheduleBitPipe

from .bitpipe import sync_twins
from .patches import applied


@contextlib.contextmanager
def process_groups_destroyed() -> Iterator[None]:
    """Destroy the process groups when training ends, also when it fails.

    Both torchtitan releases destroy them only after a successful run; a failing rank then
    reaches interpreter finalization with gloo still holding its groups, whose worker threads
    may hold work with Python-owned tensors, and tearing those down there can abort the process
    (SIGABRT instead of the Python error; pytorch/pytorch#179291 describes the mechanism).
    """
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def loss_on_every_pp_rank(
    loss: Any, group: dist.ProcessGroup, device: torch.device, src: int | None = None
) -> Any:
    """The loss of PP rank ``src`` (default: the last one, where looped placements put the
    last stage) on every PP rank, so that rank 0 logs it as unpipelined runs do (torchtitan
    logs -1 on ranks without the last stage and warns that the loss is not visible)."""
    full = getattr(loss, "full_tensor", None)  # TP's loss parallel: a replicated DTensor
    if callable(full):
        loss = full()
    value = loss.detach().reshape(()) if loss is not None else torch.zeros((), device=device)
    value = value.clone()
    src = dist.get_world_size(group) - 1 if src is None else src
    dist.broadcast(value, group=group, group_src=src)
    return value


def last_stage_rank(group: dist.ProcessGroup, has_last: bool, device: torch.device) -> int:
    """The lowest PP rank holding the last stage (any placement; V-shaped ones put it on 0)."""
    size = dist.get_world_size(group)
    t = torch.tensor(dist.get_rank(group) if has_last else size, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class RunStamp:
    """``datetime.now()`` for torchtitan's metrics module: its TensorBoard folder name
    (``%Y%m%d-%H%M``) gains this launch's rendezvous port, the same on every rank, so two runs
    in one minute get two folders and no folder level is added (no double time stamp).
    Installed by each version's patch list for the trainer's ``__init__``."""

    def __init__(self, now: datetime.datetime) -> None:
        self._now = now

    @classmethod
    def now(cls) -> RunStamp:
        return cls(datetime.datetime.now())

    def strftime(self, fmt: str) -> str:
        run = os.environ.get("MASTER_PORT") or str(os.getpid())
        return f"{self._now.strftime(fmt)}-{run}"


def no_pp_loss_warning(*args: Any, **kwargs: Any) -> None:
    """torchtitan's ``ensure_pp_loss_visible`` without its "Pipeline Parallel loss is not
    visible" warning: these trainers give rank 0 the loss (:class:`LossBroadcast`)."""
    del args, kwargs


def fsdp_reductions_for_gloo(model: torch.nn.Module, sum_only: bool = False) -> None:
    """FSDP reductions gloo can run, after torchtitan's ``parallelize_fn``: a gradient divide
    factor becomes ``ReduceOp.PREMUL_SUM``, which gloo lacks; summing gives the same numbers.
    ``sum_only``: also no division at all (DP replicate through FSDP2's ``replicate``, whose
    loss is already divided by the global token count)."""
    from torch.distributed.fsdp import FSDPModule

    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if sum_only:
                m.set_gradient_divide_factor(1.0)
            if gloo:
                m.set_force_sum_reduction_for_comms(True)


class LossBroadcast:
    """The last stage's loss on every PP rank (:func:`loss_on_every_pp_rank`); the source
    rank (the last one looped, rank 0 in a V) is found once, at the first call."""

    def __init__(self, group: dist.ProcessGroup, has_last: bool, device: torch.device) -> None:
        self.group, self.has_last, self.device = group, has_last, device
        self._src: int | None = None

    def __call__(self, loss: Any) -> torch.Tensor:
        """``loss``: this rank's loss tensor, or None where it has no last stage."""
        if self._src is None:
            self._src = last_stage_rank(self.group, self.has_last, self.device)
        return loss_on_every_pp_rank(loss, self.group, self.device, self._src)

    def of_units(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        """The sum of the schedule's unit losses (each already token-sum / global tokens, so
        the sum is the mean loss), on every PP rank."""
        loss = torch.sum(torch.stack(losses)).to(self.device) if losses else None
        return self(loss)


class TrainerCore:
    """Mixed into both versions' Seq1F1B trainers (before torchtitan's ``Trainer``).

    ``patch_list`` is the version's ``patches`` module: its ``BITPIPE_STEP`` scope (torchtitan's
    ``clip_grad_norm_`` counting each BitPipe chunk once) holds for each BitPipe train step.
    """

    patch_list: Any = None
    _twins_synced = False
    _loss_broadcast: LossBroadcast | None = None

    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's; under BitPipe the twins start identical (after torchtitan's
        init or checkpoint load) and clipping counts each chunk once."""
        schedule = getattr(self, "pp_schedule", None)
        if not isinstance(schedule, ScheduleBitPipe):
            return super().train_step(data_iterator)  # type: ignore[misc]
        if not self._twins_synced:
            sync_twins(schedule)
            self._twins_synced = True
        with applied(self.patch_list.BITPIPE_STEP, schedule):
            return super().train_step(data_iterator)  # type: ignore[misc]

    def pp_loss(self) -> LossBroadcast:
        """This trainer's :class:`LossBroadcast` over its PP group."""
        if self._loss_broadcast is None:
            group = self.parallel_dims.get_mesh("pp").get_group()  # type: ignore[attr-defined]
            has_last = self.pp_has_last_stage  # type: ignore[attr-defined]
            self._loss_broadcast = LossBroadcast(group, has_last, self.device)  # type: ignore[attr-defined]
        return self._loss_broadcast
