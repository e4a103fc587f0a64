"""Patch 6's ``ScheduleSeq1F1B``, verbatim (seq1f1b/schedules/upstream.py), over the seam's
``UnitRuntime`` on this torch: where the series is absent the runtime gives the class what it
takes from a patched torch (``SPLIT_TARGET_HOOK``, ``RECV_META_HOOK``, ``LOSSES_BY_INDEX``...),
and the loss and every gradient equal the full-sequence model's (fp32, rel. error <= 1e-5),
over two steps and an ``eval()``.

The package's attention learns the running unit from its unit context, layered on the class
here as an action context (the shape the package's schedule will take over it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from equivalence import CFG, Case, data, loss_fn, reference, rel_err
from mockstages import mock_stages
from torch.distributed.pipelining import PipelineStage

import seq1f1b._runtime as rt
from seq1f1b.attention.kv import metadata_inference
from seq1f1b.schedules.receives import ReceiveCheck
from seq1f1b.schedules.unit_actions import UnitActions
from seq1f1b.schedules.upstream import ScheduleInterleavedSeq1F1B, ScheduleSeq1F1B
from seq1f1b.testing import build_stages

pytestmark = pytest.mark.fast


class LayeredSeq1F1B(ScheduleSeq1F1B):
    """Patch 6's class with the package's per-action unit context (K/V state, guards)."""

    def __init__(self, stages: Any, n_microbatches: int, seq_chunks: int,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(stages, n_microbatches, seq_chunks, loss_fn, **kwargs)
        stages = self.local_stages
        sizing = {s.stage_index: r for s, r in zip(stages, self._recv_metas, strict=True)}
        self.unit_actions = UnitActions(
            self.local_stages, seq_chunks, ReceiveCheck(self.seq_dim, sizing), None
        )
        self.register_action_context(self.unit_actions)
        self.per_sample: list[tuple[int, ...]] | None = None

    def _lengths_for(self, seq_len: int) -> list[tuple[int, ...]]:
        """Each sample cut its own way when a test sets ``per_sample`` (packed documents)."""
        return self.per_sample or super()._lengths_for(seq_len)

    def stage_init_scope(self) -> contextlib.AbstractContextManager[None]:
        return metadata_inference()

    @contextlib.contextmanager
    def unit_scope(self) -> Iterator[None]:
        self.unit_actions.begin_step([list(s) for s in self.segment_lengths], None)
        with self.unit_actions.step_scope(self.local_stages[0], self.pp_group_size):
            yield


def _check(loss: float, ref: float, what: str) -> None:
    assert abs(loss - ref) <= 1e-5 * abs(ref), (what, loss, ref)


Split = tuple[int, ...] | list[tuple[int, ...]] | None


def _run(rank: int, world: int, spr: int, k: int, split: Split) -> None:
    case = Case(spr, k, 3)
    n = world * spr
    ref_loss, ref_grads = reference(case, n)
    mods = build_stages(CFG, n)
    mine = list(range(rank, n, world))
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    cls = ScheduleInterleavedSeq1F1B if spr > 1 else ScheduleSeq1F1B
    layered = type("Layered", (LayeredSeq1F1B, cls), {})
    # torch 2.15's runtime options at their defaults: taken on any torch
    per_sample = split if isinstance(split, list) else None
    sched = layered(stages, case.n_microbatches, k, loss_fn,
                    seq_split=None if per_sample else split,
                    max_active_stages=3, unshard_lookahead="full")  # fmt: skip
    sched.per_sample = per_sample  # the _lengths_for hook: one cut per sample
    # the stage method is the runtime's only where torch lacks it (patch 5)
    assert ("register_recv_meta_fn" in vars(stages[0])) != rt.RECV_META_HOOK
    x, y = data(case)
    first, last = 0 in mine, n - 1 in mine
    inputs = (x,) if first else ()
    out = None
    for step in range(2):
        for m in mods:
            m.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        out = sched.step(*inputs, target=y if last else None, losses=losses if last else None)
        assert sched.unit_actions.kv_state_empty(), "K/V state survived step()"
        if per_sample:  # the cuts ran (the unit context checks each received length)
            assert [tuple(x) for x in sched.segment_lengths] == per_sample
        if last:
            assert len(losses) == case.n_microbatches * k
            _check(torch.stack(losses).mean().item(), ref_loss, f"step {step}")
            assert out.shape == (case.batch, case.seq_len, CFG.vocab), out.shape
    for s in mine:
        for name, p in mods[s].named_parameters():
            err = rel_err(p.grad, ref_grads[f"{s}.{name}"])
            assert err <= 1e-5, f"stage {s} {name}: rel err {err:.2e}"
    losses = []
    evaluated = sched.eval(*inputs, target=y if last else None, losses=losses if last else None)
    if last:
        _check(torch.stack(losses).mean().item(), ref_loss, "eval")
        assert torch.allclose(out, evaluated, atol=1e-5)


CASES = [
    (1, 2, None),
    (1, 3, (10, 8, 6)),
    (2, 2, (14, 10)),
    (2, 3, None),
    (1, 2, [(14, 10), (9, 15), (12, 12)]),  # per sample, through the _lengths_for hook
    (2, 3, [(10, 8, 6), (6, 8, 10), (8, 8, 8)]),
]


@pytest.mark.parametrize(("stages_per_rank", "seq_chunks", "seq_split"), CASES)
def test_patch_class_matches_reference(
    stages_per_rank: int, seq_chunks: int, seq_split: Split
) -> None:
    run_ranks(_run, 2, stages_per_rank, seq_chunks, seq_split)


def test_the_runtime_emulates_only_what_torch_lacks() -> None:
    """The target split (patch 6) and 2.13's ``step()`` are the runtime's only without them."""
    assert ("_split_target" in vars(rt.UnitRuntime)) != rt.SPLIT_TARGET_HOOK
    assert ("_get_microbatch_inputs" in vars(rt.UnitRuntime)) != rt.SPLIT_TARGET_HOOK
    assert ("step" in vars(rt.UnitRuntime)) != rt.MICROBATCH_INPUTS_HOOK


def test_a_registered_recv_meta_fn_can_be_removed() -> None:
    if rt.RECV_META_HOOK:
        pytest.skip("torch's own register_recv_meta_fn (patch 5)")
    stages = mock_stages(2, 1)
    sched = ScheduleSeq1F1B(stages, 2, 2)
    fns = sched._recv_meta_fns[stages[0].stage_index]
    assert sched.pipeline_order[0] == sched._calculate_single_rank_operations(0)
    handle = stages[0].register_recv_meta_fn(lambda *a: a[-1])
    assert len(fns) == 2  # the class's _SequenceRecvMeta and this one
    handle.remove()
    assert len(fns) == 1
