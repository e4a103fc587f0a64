"""seq1f1b.ChunkedLoss: the last stage's head and loss in chunks, each chunk's backward at
once. Exact against the unchunked loss (fp32, 1e-5) under the Seq1F1B schedules, with uneven
segments, ignored targets (token weights) and checkpointing; and what the last stage keeps
for backward drops from vocabulary-wide to hidden-wide."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from equivalence import Case, data, loss_fn, reference, rel_err
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ChunkedLoss
from seq1f1b.registry import lookup
from seq1f1b.testing import build_stages


def _chunked_case(rank: int, world: int, schedule: str, split, checkpointing: bool) -> None:
    case = Case(2, 3, 2, seq_len=24, batch=4, split=split, checkpointing=checkpointing,
                pad=True, schedule=schedule)  # fmt: skip
    num_stages = 2
    ref_loss, ref_grads = reference(case, num_stages)
    mods = build_stages(case.cfg, num_stages, checkpointing=checkpointing)
    mods[-1].skip_head = True  # the stage outputs normed hidden states; the loss runs the head
    mine = lookup(schedule).stages_of(1, 0, num_stages)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    # segments of 8, or 10/8/6: chunks of 3 tokens, uneven
    chunked = ChunkedLoss(mods[-1].head, chunk_tokens=3)
    split_arg = split if isinstance(split, str) else list(split)
    sched = lookup(schedule).schedule_class()(stages, 2, 3, chunked, seq_split=split_arg)
    x, y = data(case)
    losses: list[torch.Tensor] = []
    sched.step(x, target=y, losses=losses)
    loss = torch.stack(losses).mean().item()
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    for s in mine:
        for name, p in mods[s].named_parameters():
            err = rel_err(p.grad, ref_grads[f"{s}.{name}"])
            assert err <= 1e-5, f"{schedule} stage {s} {name}: rel err {err:.2e}"


@pytest.mark.parametrize(
    "schedule,split,checkpointing",
    [("Seq1F1B", (10, 8, 6), False), ("ZBVSeq1F1B", "uniform", True)],
)
def test_chunked_loss_matches_unchunked_reference(schedule, split, checkpointing) -> None:
    run_ranks(_chunked_case, 1, schedule, split, checkpointing)


def test_chunked_loss_value_and_grads_equal_plain_loss() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 11, 16, requires_grad=True)
    target = torch.randint(0, 50, (2, 11))
    target[0, :4] = -100
    want = loss_fn(head(hidden), target)
    want.backward()
    want_h, want_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    for kwargs in ({"chunk_tokens": 4}, {"num_chunks": 3}, {"num_chunks": 20}):
        got = ChunkedLoss(head, **kwargs)(hidden, target)
        got.backward()
        assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
        assert rel_err(hidden.grad, want_h) <= 1e-6 and rel_err(head.weight.grad, want_w) <= 1e-6
        hidden.grad, head.weight.grad = None, None
    with torch.no_grad():  # forward only (evaluation): the value, no backward inside
        assert abs(ChunkedLoss(head, chunk_tokens=4)(hidden, target).item() - want.item()) < 1e-5
    assert head.weight.grad is None


def test_chunked_loss_rejects_bad_settings() -> None:
    head = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="exactly one of chunk_tokens or num_chunks"):
        ChunkedLoss(head)
    with pytest.raises(ValueError, match="chunk_tokens = 0"):
        ChunkedLoss(head, chunk_tokens=0)
    assert ChunkedLoss(head, chunk_tokens=4).chunk_lengths(10) == [4, 3, 3]
