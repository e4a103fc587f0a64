"""Trainer pieces both torchtitan versions share (no torchtitan import here)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def loss_on_every_pp_rank(loss: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
    """The last PP rank's loss on every PP rank, so that rank 0 logs it as unpipelined runs
    do (torchtitan logs -1 on ranks without the last stage and warns that the loss is not
    visible)."""
    full = getattr(loss, "full_tensor", None)  # TP's loss parallel: a replicated DTensor
    if callable(full):
        loss = full()
    value = loss.detach().reshape(()) if loss is not None else torch.zeros((), device=device)
    value = value.clone()
    dist.broadcast(value, group=group, group_src=dist.get_world_size(group) - 1)
    return value
