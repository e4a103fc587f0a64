"""The per-action context hook (``register_action_context``): what torch's runtime would call
around each F / B / I / W. It composes (first registered outermost), sees the stage and the
action, can be removed, and leaves every stage exactly as it found it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import run_ranks
from equivalence import CFG, Case, data, loss_fn, reference
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ScheduleSeq1F1B, ScheduleZBSeq1F1B
from seq1f1b._runtime import Action
from seq1f1b.testing import build_stages

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds


def _stages(n: int) -> list[PipelineStage]:
    mods = build_stages(CFG, n)
    return [PipelineStage(m, s, n, torch.device("cpu")) for s, m in enumerate(mods)]


def _recorder(name: str, log: list):
    @contextlib.contextmanager
    def factory(stage, action: Action):
        assert action.stage_index == stage.stage_index
        log.append((name, "enter", str(action)))
        yield
        log.append((name, "exit", str(action)))

    return factory


def _composes(rank: int, world: int, zero_bubble: bool) -> None:
    case = Case(2, 3, 2)
    ref_loss, _ = reference(case, 2)
    stages = _stages(2)
    cls = ScheduleZBSeq1F1B if zero_bubble else ScheduleSeq1F1B
    sched = cls(stages, 2, 3, loss_fn)
    log: list = []
    outer = sched.register_action_context(_recorder("outer", log))
    sched.register_action_context(_recorder("inner", log))
    x, y = data(case)
    losses: list[torch.Tensor] = []
    sched.step(x, target=y, losses=losses)
    assert abs(torch.stack(losses).mean().item() - ref_loss) <= 1e-5 * abs(ref_loss)
    compute = [str(a) for acts in sched.pipeline_order.values() for a in acts if a is not None]
    entered = [a for who, what, a in log if who == "outer" and what == "enter"]
    assert sorted(entered) == sorted(compute)  # every compute action, once
    # nested: outer enter, inner enter, inner exit, outer exit, per action
    for i in range(0, len(log), 4):
        assert [(w, e) for w, e, _ in log[i : i + 4]] == [
            ("outer", "enter"),
            ("inner", "enter"),
            ("inner", "exit"),
            ("outer", "exit"),
        ]
    kinds = {a.rstrip("0123456789")[-1] for a in compute}  # "1I3" -> "I"
    assert ("I" in kinds and "W" in kinds) == zero_bubble, kinds
    outer.remove()
    log.clear()
    sched.step(x, target=y)
    assert log and all(who == "inner" for who, _, _ in log)
    for stage in stages:  # no instance attribute left behind
        assert not {"forward_one_chunk", "backward_one_chunk"} & set(vars(stage))


@pytest.mark.parametrize("zero_bubble", [False, True])
def test_action_contexts_compose_and_see_every_action(zero_bubble: bool) -> None:
    run_ranks(_composes, 1, zero_bubble)


def _restored_after_failure(rank: int, world: int) -> None:
    stages = _stages(2)
    sched = ScheduleSeq1F1B(stages, 1, 2, loss_fn)
    user = stages[1].forward_one_chunk  # an instance override of the user's stays

    def traced(chunk_id, *args, **kwargs):
        return user(chunk_id, *args, **kwargs)

    stages[1].forward_one_chunk = traced

    @contextlib.contextmanager
    def failing(stage, action):
        if stage.stage_index == 1:
            raise RuntimeError("boom in an action context")
        yield

    sched.register_action_context(failing)
    x, y = data(Case(1, 2, 1))
    with pytest.raises(RuntimeError, match="boom"):
        sched.step(x, target=y)
    assert vars(stages[1])["forward_one_chunk"] is traced
    assert "forward_one_chunk" not in vars(stages[0])


def test_stage_left_as_found_when_an_action_fails() -> None:
    run_ranks(_restored_after_failure, 1)
