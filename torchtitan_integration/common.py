"""Trainer pieces both torchtitan versions share (no torchtitan import here)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


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


class _RunStamp:
    """``datetime.now()`` for torchtitan's metrics module: its TensorBoard folder name
    (``%Y%m%d-%H%M``) gains this launch's rendezvous port, the same on every rank, so two runs
    in one minute get two folders and no folder level is added (no double time stamp)."""

    def __init__(self, now: datetime.datetime) -> None:
        self._now = now

    @classmethod
    def now(cls) -> _RunStamp:
        return cls(datetime.datetime.now())

    def strftime(self, fmt: str) -> str:
        run = os.environ.get("MASTER_PORT") or str(os.getpid())
        return f"{self._now.strftime(fmt)}-{run}"


@contextlib.contextmanager
def torchtitan_metrics_for_this_trainer(metrics: Any, trainer_module: Any) -> Iterator[None]:
    """For the length of the trainer's ``__init__`` (on both torchtitan versions): one
    TensorBoard folder per run (:class:`_RunStamp`), and no "Pipeline Parallel loss is not
    visible" warning, since this trainer gives rank 0 the loss (:func:`loss_on_every_pp_rank`).
    Listed in cpu.py / v03/cpu.py (patches on any device)."""
    saved = (metrics.datetime, trainer_module.ensure_pp_loss_visible)
    metrics.datetime = _RunStamp
    trainer_module.ensure_pp_loss_visible = lambda *args, **kwargs: None
    try:
        yield
    finally:
        metrics.datetime, trainer_module.ensure_pp_loss_visible = saved
