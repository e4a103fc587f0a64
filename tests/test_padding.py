"""Padding: units whose targets are all ignore_index add nothing, and never a NaN.

A padded sample's last segment often has no target at all; a mean loss over it is 0/0. The
reported per-unit losses stay finite, their mean equals the full-sequence mean over the real
tokens, and every gradient equals the reference (uneven explicit split, step and eval). A batch
with no target at all is refused on every rank, before any pipeline traffic.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from equivalence import CFG, Case, data, loss_fn, rel_err
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ScheduleSeq1F1B
from seq1f1b.testing import build_stages, full_model

CASE = Case(1, 3, 2, split=(11, 8, 5))


def _padded_target() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(CASE)
    y = y.clone()
    y[3:6, 19:] = -100  # sample 1 (rows 3-5)'s last segment: no target at all
    y[0, 11:15] = -100  # sample 0's middle segment: partly padded
    return x, y


def _worker(rank: int, world: int, checkpointing: bool) -> None:
    x, y = _padded_target()
    mods = build_stages(CFG, world, checkpointing=checkpointing)
    ref_mods = build_stages(CFG, world, checkpointing=checkpointing)
    ref_loss = loss_fn(full_model(ref_mods)(x), y)
    ref_loss.backward()
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], CASE.n_microbatches, 3, loss_fn, seq_split=list(CASE.split))
    for train in (True, False):
        losses: list[torch.Tensor] = []
        if rank == 0:
            (sched.step if train else sched.eval)(x)
        else:
            (sched.step if train else sched.eval)(target=y, losses=losses)
            assert all(torch.isfinite(t).item() for t in losses), losses
            assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= 1e-5 * ref_loss
            assert losses[5].item() == 0.0  # the unit with no target
        if train:
            for (n, p), ref in zip(
                mods[rank].named_parameters(), ref_mods[rank].parameters(), strict=True
            ):
                assert rel_err(p.grad, ref.grad) <= 1e-5, n


@pytest.mark.parametrize("checkpointing", [False, True])
def test_all_ignored_unit_gives_finite_loss_and_exact_grads(checkpointing: bool) -> None:
    run_ranks(_worker, 2, checkpointing)


def _all_ignored(rank: int, world: int) -> None:
    x, y = data(CASE)
    stage = PipelineStage(build_stages(CFG, world)[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], CASE.n_microbatches, 3, loss_fn, seq_split=list(CASE.split))
    if rank == 0:
        with pytest.raises(RuntimeError, match="another pipeline rank rejected its inputs"):
            sched.step(x)
    else:
        with pytest.raises(ValueError, match="every target of this batch is ignore_index"):
            sched.step(target=torch.full_like(y, -100))


def test_batch_without_targets_is_refused_on_every_rank() -> None:
    run_ranks(_all_ignored, 2)
