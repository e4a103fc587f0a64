"""Worker: Seq1F1B on gloo ranks vs a single-process full-sequence reference."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ModelShape, ScheduleSeq1F1B
from seq1f1b.testing import TinyConfig, build_stages, full_model

CFG = TinyConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=8, ffn=64)


@dataclass(frozen=True)
class Case:
    stages_per_rank: int
    seq_chunks: int
    n_microbatches: int
    split: str | tuple[int, ...] = "uniform"
    checkpointing: bool = False
    seq_len: int = 24
    batch: int = 6


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, CFG.vocab, (case.batch, case.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference(case: Case, num_stages: int) -> tuple[float, dict[str, torch.Tensor]]:
    mods = build_stages(CFG, num_stages, checkpointing=case.checkpointing)
    model = full_model(mods)
    x, y = data(case)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {
        f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
    }
    return loss.item(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(rank: int, world: int, case: Case, tol: float = 1e-5) -> None:
    num_stages = world * case.stages_per_rank
    ref_loss, ref_grads = reference(case, num_stages)
    mods = build_stages(CFG, num_stages, checkpointing=case.checkpointing)
    mine = list(range(rank, num_stages, world))
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    split = case.split if isinstance(case.split, str) else list(case.split)
    shape = ModelShape(hidden=CFG.dim, n_heads=CFG.n_heads, n_layers=CFG.n_layers, vocab=CFG.vocab)
    sched = ScheduleSeq1F1B(
        stages, case.n_microbatches, case.seq_chunks, loss_fn, split=split, model_shape=shape
    )
    x, y = data(case)
    losses: list[torch.Tensor] = []
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    args = (x,) if has_first else ()
    out = sched.step(*args, target=y if has_last else None, losses=losses if has_last else None)
    assert sched.kv_state_empty(), "K/V state survived step()"
    if has_last:
        assert len(losses) == case.n_microbatches * case.seq_chunks
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (case, loss, ref_loss)
        assert out.shape == (case.batch, case.seq_len, CFG.vocab), out.shape
    for s in mine:
        for n, p in mods[s].named_parameters():
            err = rel_err(p.grad, ref_grads[f"{s}.{n}"])
            assert err <= tol, f"{case} stage {s} {n}: rel err {err:.2e}"


def grid(world: int) -> list[Case]:
    cases = []
    for spr, k, m in itertools.product((1, 2), (1, 2, 4), (1, 2, 3)):
        cases.append(Case(spr, k, m))
    cases += [
        Case(1, 4, 2, split="compute"),
        Case(2, 4, 3, split="compute"),
        Case(1, 3, 2, split=(11, 8, 5)),
        Case(2, 4, 2, split=(9, 7, 5, 3)),
        Case(1, 4, 2, checkpointing=True),
        Case(2, 2, 3, checkpointing=True, split=(15, 9)),
        Case(1, 4, 3, checkpointing=True, split="compute"),
    ]
    return cases


def run_grid(rank: int, world: int, stages_per_rank: int) -> None:
    """Every case of the grid with this many stages per rank; all mismatches reported at once
    (an assertion comes after the step, so the ranks stay in step after a failed case)."""
    failures = []
    for case in grid(world):
        if case.stages_per_rank != stages_per_rank:
            continue
        try:
            run_case(rank, world, case)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, f"{len(failures)} cases differ from the reference:\n" + "\n".join(failures)


def run_eval_case(rank: int, world: int, case: Case) -> None:
    """eval() with K > 1: logits and losses equal the full-sequence forward, no state left."""
    num_stages = world * case.stages_per_rank
    mods = build_stages(CFG, num_stages)
    x, y = data(case)
    with torch.no_grad():
        ref_logits = full_model(mods)(x)
        ref_loss = loss_fn(ref_logits, y).item()
    mine = list(range(rank, num_stages, world))
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    split = case.split if isinstance(case.split, str) else list(case.split)
    sched = ScheduleSeq1F1B(stages, case.n_microbatches, case.seq_chunks, loss_fn, split=split)
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    for _ in range(2):  # twice: the second call reuses the initialised stages
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            out = sched.eval(
                *((x,) if has_first else ()),
                target=y if has_last else None,
                losses=losses if has_last else None,
            )
        assert sched.kv_state_empty()
        if has_last:
            assert rel_err(out, ref_logits) <= 1e-5
            assert abs(torch.stack(losses).mean().item() - ref_loss) <= 1e-5 * ref_loss
    for p in (p for s in mine for p in mods[s].parameters()):
        assert p.grad is None
