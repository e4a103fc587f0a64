"""The seam to torch's internals (seq1f1b/_runtime/): one place, and what it guards.

* no private ``torch.distributed.pipelining`` name is used outside the seam;
* a receive that was not sized per unit is an error, never silently wrong data;
* pre-split samples (torch's ``step(arg_mbs=..., target_mbs=...)``) give the same gradients;
* torch 2.15's runtime options pass through (and are refused clearly before 2.15).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from equivalence import CFG, Case, data, loss_fn, reference, rel_err
from mockstages import mock_stages
from torch.distributed.pipelining import PipelineStage

import seq1f1b._runtime as rt
from seq1f1b import ScheduleSeq1F1B
from seq1f1b.testing import build_stages

ROOT = Path(__file__).resolve().parent.parent
PROSE = re.compile(r"``[^`]*``|#.*$")  # names mentioned in docstrings and comments
PRIVATE = re.compile(
    r"torch\.distributed\.pipelining\.\w+ import[^\n]*\b_[A-Za-z]|"
    r"\b_(Action|ComputationType|PipelineScheduleRuntime|PipelineStageBase|PipelineContext|"
    r"RecvInfo|validate_schedule|add_send_recv|simulate_comms_compute|add_unshard_reshard|"
    r"add_reduce_grad|add_wait_send|defer_recv_ops|format_pipeline_order|warmup_p2p|"
    r"prepare_schedule_with_comms|maybe_compute_loss|maybe_get_loss|update_losses|"
    r"step_microbatches|initialize_stages|internal_losses|load_csv|dump_csv)\b|"
    r"torch\._utils\._|torch\.ops\.aten\._|distributed_c10d\._|torch\.distributed\._composable"
)


def test_no_private_torch_name_outside_the_seam() -> None:
    offenders = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[:2] == ("seq1f1b", "_runtime"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(PROSE.sub("", line)):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "torch internals outside seq1f1b/_runtime/:\n" + "\n".join(offenders)


def test_seam_detects_this_release() -> None:
    # features, not version numbers; the send waits and per-receive buffers came together
    assert rt.HAS_SEND_WAITS == (rt.WAIT_SEND_F is not None)
    assert rt.RECV_BUFFER_PER_RECEIVE == rt.HAS_SEND_WAITS
    assert rt.HAS_WARMUP_P2P != rt.HAS_SEND_WAITS


def test_newer_runtime_options() -> None:
    if rt.RUNTIME_OPTIONS:
        sched = ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, max_active_stages=2)
        assert sched.lowering_options()["max_active_stages"] == 2
        expected = rt.torch_lowering(
            mock_stages(2, 2), sched.pipeline_order, 4, max_active_stages=2
        )
        assert sched.pipeline_order_with_comms[0] == expected[0]
        # options the fast lowering does not model go to torch's own lowering
        other = ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, unshard_lookahead="auto")
        assert isinstance(other.pipeline_order_with_comms, dict)
    else:
        with pytest.raises(ValueError, match=r"need torch >= 2\.15"):
            ScheduleSeq1F1B(mock_stages(2, 2), 2, 2, max_active_stages=2)


def _unsized_receive_fails(rank: int, world: int) -> None:
    case = Case(1, 3, 1, split=(12, 8, 4))
    mods = build_stages(CFG, world)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 1, 3, loss_fn, split=list(case.split))
    rt.set_recv_length = lambda info, dim, length: None  # as if a torch release ignored it
    x, y = data(case)
    if rank == 1:
        with pytest.raises(RuntimeError, match="received an activation with 12 positions"):
            sched.step(target=y[:1])
        os._exit(0)  # leave at once: the sender's wait then fails instead of timing out
    with pytest.raises(Exception):  # noqa: B017 - the peer is gone; how gloo says it varies
        sched.step(x[:1])
    os._exit(0)


def test_unsized_receive_is_an_error_not_wrong_data() -> None:
    run_ranks(_unsized_receive_fails, 2)


def _presplit(rank: int, world: int) -> None:
    case = Case(1, 2, 2, split=(14, 10))
    ref_loss, ref_grads = reference(case, world)
    mods = build_stages(CFG, world)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn, split=list(case.split))
    x, y = data(case)
    xs, ys = list(torch.tensor_split(x, 2)), list(torch.tensor_split(y, 2))
    losses: list[torch.Tensor] = []
    if rank == 0:
        sched.step(arg_mbs=[(t,) for t in xs])
    else:
        sched.step(target_mbs=ys, losses=losses)
        assert abs(torch.stack(losses).mean().item() - ref_loss) <= 1e-5 * ref_loss
    for n, p in mods[rank].named_parameters():
        assert rel_err(p.grad, ref_grads[f"{rank}.{n}"]) <= 1e-5, n


def test_presplit_samples_match_reference() -> None:
    run_ranks(_presplit, 2)


def test_presplit_needs_one_entry_per_sample() -> None:
    sched = ScheduleSeq1F1B(mock_stages(1, 1), 2, 2)
    with pytest.raises(ValueError, match="n_microbatches=2 samples"):
        sched.step(arg_mbs=[(torch.zeros(1, 4),)])
    with pytest.raises(ValueError, match="not both"):
        sched.step(torch.zeros(2, 4), arg_mbs=[(torch.zeros(1, 4),)] * 2)
