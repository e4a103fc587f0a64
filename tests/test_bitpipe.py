"""BitPipe: orders (torch's validators, replays, the published example), construction errors,
and gradient equivalence with a single-process run on 2 and 4 gloo ranks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from lowering_checks import check_p2p_matching, lower_all
from mockstages import MockStage
from torch import nn

from seq1f1b import ChunkedLoss, ScheduleBitPipe, build_bitpipe_stages, packed_documents
from seq1f1b import _runtime as rt
from seq1f1b._runtime import Action, ComputationType
from seq1f1b._runtime import reference as torch_ref
from seq1f1b._runtime.replay import replay
from seq1f1b.bitpipe import BitPipeLayout, ReplicaBoundaries, build_bitpipe_orders
from seq1f1b.testing import TinyConfig, build_stages, full_model

FWD, BWD = ComputationType.FORWARD, ComputationType.FULL_BACKWARD
CFG = TinyConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=8, ffn=64)
SEQ = 16


# ---------------------------------------------------------------------------- orders
def _grid(pp: int) -> list[int]:
    return sorted({2, 4, pp, 2 * pp, 3 * pp + pp % 2, 2 * pp + 2} - {0})


def _replica_projection(
    orders: dict[int, list[Action]], layout: BitPipeLayout, replica: int
) -> dict[int, list[Action]]:
    """One replica's actions, relabelled to its own stage ids 0..2pp-1 (a plain V pipeline)."""
    return {
        r: [
            Action(layout.chunk(a.stage_index), a.computation_type, a.microbatch_index)
            for a in acts
            if layout.replica(a.stage_index) == replica
        ]
        for r, acts in orders.items()
    }


@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_orders_pass_torch_validators_and_replays(pp: int) -> None:
    layout = BitPipeLayout(pp)
    for m in _grid(pp):
        orders = build_bitpipe_orders(pp, m)
        # torch: every stage runs its replica's M/2 microbatches F then B, on BitPipe's ranks
        assert torch_ref.validate_schedule(orders, pp, 4 * pp, m // 2) == layout.stage_to_rank()
        # torch's lowering and replay on each replica alone (a V pipeline of 2pp stages)
        for replica in (0, 1):
            proj = _replica_projection(orders, layout, replica)
            torch_ref.validate_schedule(proj, pp, 2 * pp, m // 2)
            to_rank = {s: layout.rank_of(layout.stage_id(replica, s)) for s in range(2 * pp)}
            lowered = torch_ref.add_send_recv(proj, to_rank.__getitem__, 2 * pp)
            torch_ref.simulate_comms_compute(lowered, to_rank.__getitem__, 2 * pp)
        # both replicas together: dependency replay, replica-aware lowering and its replay
        assert not replay(orders, layout.topology()).stuck  # no rank left waiting
        lowered = lower_all(orders, layout.topology(), m // 2)
        assert replay(lowered, layout.topology()).finished
        check_p2p_matching(lowered, layout.topology())
        # partners are mirror images (A <-> B): their gradient all-reduces line up
        for r in range(pp):
            mirrored = [
                (a.computation_type, layout.twin(a.stage_index), (a.microbatch_index + m // 2) % m)
                for a in orders[r]
            ]
            partner = orders[layout.partner(r)]
            assert mirrored == [
                (a.computation_type, a.stage_index, a.microbatch_index) for a in partner
            ]
        if m % pp == 0:  # the published bubble (pp-2)/(4M+pp-2) with F = B = 1
            unit = replay(orders, layout.topology())  # forward = backward = 1, free comms
            assert unit.finished and unit.makespan == 4 * m + pp - 2, (pp, m)


def test_lowering_never_crosses_replicas() -> None:
    layout = BitPipeLayout(4)
    lowered = lower_all(build_bitpipe_orders(4, 8), layout.topology(), 4)
    kinds = ComputationType
    for acts in lowered.values():
        for a in acts:
            g = a.stage_index
            assert not (a.computation_type == kinds.SEND_F and layout.is_last(g)), a
            assert not (a.computation_type == kinds.RECV_F and layout.is_first(g)), a
            assert not (a.computation_type == kinds.SEND_B and layout.is_first(g)), a
            assert not (a.computation_type == kinds.RECV_B and layout.is_last(g)), a
    # the V turns (s = pp-1 <-> pp, on one rank) pass tensors locally: no send either way
    sends = {(a.stage_index, a.computation_type) for acts in lowered.values() for a in acts}
    assert not sends & {
        (3, kinds.SEND_F),
        (11, kinds.SEND_F),
        (4, kinds.SEND_B),
        (12, kinds.SEND_B),
    }


def test_published_example_p4_m4_rank0() -> None:
    # REFERENCE's chunks are rank-local: c0 = A stage r, c1 = B stage pp-1-r, c2 = A stage
    # 2pp-1-r, c3 = B stage pp+r (rank 0: global ids 0, 11, 7, 12); its microbatch labels
    # number the passes per chunk, label = 2*c + j for local microbatch j of that replica
    # (A's j is global j, B's is global 2 + j here).
    layout = BitPipeLayout(4)
    chunk_of = {0: 0, 11: 1, 7: 2, 12: 3}

    def label(a: Action) -> str:
        c = chunk_of[a.stage_index]
        j = a.microbatch_index - 2 * layout.replica(a.stage_index)
        return f"{a.computation_type.value}{2 * c + j}c{c}"

    got = " ".join(label(a) for a in build_bitpipe_orders(4, 4)[0])
    assert got == (
        "F0c0 F1c0 F2c1 F6c3 F3c1 F7c3 F4c2 B4c2 F5c2 B5c2 B6c3 B2c1 B7c3 B3c1 B0c0 B1c0"
    )


def test_layout_pairs_hold_the_same_layers() -> None:
    for pp in (2, 4, 8):
        layout = BitPipeLayout(pp)
        for r in range(pp):
            mine = layout.stages_of(r)
            assert [layout.rank_of(g) for g in mine] == [r] * 4
            assert len({layout.chunk(g) for g in mine}) == 4
            twins = sorted(layout.twin(g) for g in mine)
            assert twins == layout.stages_of(layout.partner(r))
        for g in range(layout.num_stages):  # neighbours are on the same or an adjacent rank
            nxt = layout.next_stage(g)
            if nxt is not None:
                assert abs(layout.rank_of(nxt) - layout.rank_of(g)) <= 1


# ---------------------------------------------------------------------------- construction errors
class _Stage(ReplicaBoundaries, MockStage):
    pass


def _mocks(pp: int, rank: int, indices: Sequence[int] | None = None, cls=_Stage) -> list:
    layout_stages = indices if indices is not None else BitPipeLayout(pp).stages_of(rank)
    return [cls(g, 4 * pp, pp, rank) for g in layout_stages]


@pytest.mark.parametrize(
    ("stages", "kwargs", "match"),
    [
        (lambda: [_Stage(g, 12, 3, 0) for g in (0, 5, 8, 9)], {}, "even pp"),
        (lambda: _mocks(4, 0, [0, 4, 8, 12]), {}, "must hold exactly"),
        (lambda: _mocks(4, 0)[:2], {}, "must hold exactly"),
        (lambda: _mocks(4, 0, cls=MockStage), {}, "BitPipeStage"),
        (lambda: _mocks(4, 0), {"n_microbatches": 3}, "even n_microbatches"),
        (lambda: _mocks(4, 0), {"n_microbatches": 0}, "even n_microbatches"),
        (lambda: _mocks(4, 0), {"n_microbatches": True}, "even n_microbatches"),
        (lambda: _mocks(4, 0), {"pair_group": None}, "pair_group is required"),
        (lambda: [], {}, "stages is empty"),
    ],
)
def test_invalid_construction(stages, kwargs: dict, match: str) -> None:
    args = {"n_microbatches": 4, "pair_group": None} | kwargs
    with pytest.raises(ValueError, match=match):
        ScheduleBitPipe(stages(), args.pop("n_microbatches"), **args)


def test_layout_and_order_errors() -> None:
    with pytest.raises(ValueError, match="even pp"):
        BitPipeLayout(5)
    with pytest.raises(ValueError, match="pp >= 2"):
        BitPipeLayout(1)
    with pytest.raises(ValueError, match="even n_microbatches"):
        build_bitpipe_orders(4, 5)


# ---------------------------------------------------------------------------- multi-process
def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _chunks(pp: int, tied: bool) -> list[nn.Module]:
    mods = build_stages(CFG, 2 * pp)
    if tied:  # embedding of chunk 0 is the output head of chunk 2pp-1
        mods[-1].head.weight = mods[0].embed.weight
    return list(mods)


def _batch(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab, (m, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(sched: ScheduleBitPipe, stages, x, y, train: bool = True):
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    call = sched.step if train else sched.eval
    out = call(*((x,) if has_first else ()), target=y if has_last else None, losses=losses)
    return out, losses, has_last


def _check_step(rank: int, pp: int, tied: bool, m: int) -> None:
    x, y = _batch(m, seed=m)
    ref = _chunks(pp, tied)
    logits = full_model(ref)(x)
    ref_loss = _loss_fn(logits, y)
    ref_loss.backward()
    ref_grads = {
        (c, n): p.grad
        for c, mod in enumerate(ref)
        for n, p in mod.named_parameters(remove_duplicate=False)
    }
    stages, pair = build_bitpipe_stages(_chunks(pp, tied), torch.device("cpu"))
    sched = ScheduleBitPipe(stages, m, _loss_fn, pair_group=pair)
    out, losses, has_last = _run(sched, stages, x, y)
    case = f"pp={pp} M={m} tied={tied} rank {rank}"
    if has_last:  # ranks 0 and pp-1: all M losses; outputs of their replica's half
        assert len(losses) == m, case
        assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
        half = slice(0, m // 2) if rank == 0 else slice(m // 2, m)
        assert _rel(out, logits[half].detach()) <= 1e-5, case
    else:
        assert losses == [] and out is None, case
    for stage in stages:
        c = stage.stage_index % (2 * pp)
        for n, p in stage.submod.named_parameters(remove_duplicate=False):
            err = _rel(p.grad, ref_grads[(c, n)])
            assert err <= 1e-5, f"{case} stage {stage.stage_index} {n}: rel err {err:.2e}"
    # forward-only: losses equal the reference, no gradient sync, gradients untouched
    before = [p.grad.clone() for s in stages for p in s.submod.parameters()]
    _, losses, has_last = _run(sched, stages, x, y, train=False)
    if has_last:
        assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    after = [p.grad for s in stages for p in s.submod.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _params_by_chunk(stages, pp: int) -> dict[int, torch.Tensor]:
    return {
        s.stage_index % (2 * pp): torch.cat([p.detach().flatten() for p in s.submod.parameters()])
        for s in stages
    }


def _assert_replicas_identical(stages, pair: dist.ProcessGroup, pp: int) -> None:
    for c, flat in sorted(_params_by_chunk(stages, pp).items()):  # same chunks on partners
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat, group=pair)
        assert torch.equal(both[0], both[1]), f"chunk {c} differs between the replicas"


def _check_training(rank: int, pp: int, m: int) -> None:
    """2 SGD steps equal the reference; 2 AdamW steps from per-rank random init stay paired."""
    ref = _chunks(pp, tied=True)
    ref_params = list(dict.fromkeys(p for mod in ref for p in mod.parameters()))
    ref_opt = torch.optim.SGD(ref_params, lr=0.5)
    stages, pair = build_bitpipe_stages(_chunks(pp, tied=True), torch.device("cpu"))
    sched = ScheduleBitPipe(stages, m, _loss_fn, pair_group=pair)
    params = list(dict.fromkeys(p for s in stages for p in s.submod.parameters()))
    opt = torch.optim.SGD(params, lr=0.5)
    for step in range(2):
        x, y = _batch(m, seed=100 + step)
        ref_opt.zero_grad()
        _loss_fn(full_model(ref)(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        _run(sched, stages, x, y)
        opt.step()
    for s in stages:
        mod = ref[s.stage_index % (2 * pp)]
        for (n, p), q in zip(s.submod.named_parameters(), mod.parameters(), strict=True):
            assert _rel(p.detach(), q.detach()) <= 1e-5, f"rank {rank} stage {s.stage_index} {n}"
    _assert_replicas_identical(stages, pair, pp)

    def random_chunks(indices: Sequence[int]) -> list[nn.Module]:
        # every rank initialises differently: the start-up broadcast aligns the replicas
        return [build_stages(CFG, 2 * pp, seed=1000 + rank)[c] for c in indices]

    stages, pair = build_bitpipe_stages(random_chunks, torch.device("cpu"), pair_group=pair)
    _assert_replicas_identical(stages, pair, pp)
    sched = ScheduleBitPipe(stages, m, _loss_fn, pair_group=pair)
    opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-2)
    for step in range(2):
        x, y = _batch(m, seed=200 + step)
        opt.zero_grad()
        _run(sched, stages, x, y)
        opt.step()
    _assert_replicas_identical(stages, pair, pp)


def _check_csv_round_trip(rank: int, pp: int) -> None:
    stages, pair = build_bitpipe_stages(_chunks(pp, tied=False), torch.device("cpu"))
    sched = ScheduleBitPipe(stages, 4, _loss_fn, pair_group=pair)
    lowered = dict(sched.pipeline_order_with_comms)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "order.csv")
        sched.dump_csv(path, format="compute_only")
        sched.load_csv(path)
    assert sched.pipeline_order_with_comms == lowered


def _check_documents(rank: int, pp: int, m: int) -> None:
    """Packed documents, different in every microbatch (whole-batch and per-microbatch
    ``document_ids``), with ChunkedLoss on the last stages: loss and every gradient equal the
    unpipelined model inside ``packed_documents``; without the documents they would not."""
    x, y = _batch(m, seed=7)
    docs = torch.zeros(m, SEQ, dtype=torch.long)
    for i in range(m):  # a cut at a different place in every row (one row stays whole)
        docs[i, 3 + 4 * i :] = 1 if i < m - 1 else 0
    ref = _chunks(pp, tied=False)
    with packed_documents(docs):
        ref_loss = _loss_fn(full_model(ref)(x), y)
        ref_loss.backward()
    causal = _loss_fn(full_model(_chunks(pp, tied=False))(x), y)
    assert abs(causal.item() - ref_loss.item()) > 1e-4  # the documents change the loss
    ref_grads = {(c, n): p.grad for c, mod in enumerate(ref) for n, p in mod.named_parameters()}
    chunks = _chunks(pp, tied=False)
    chunks[-1].skip_head = True  # the loss runs the head in chunks of 5 positions
    stages, pair = build_bitpipe_stages(chunks, torch.device("cpu"))
    last = [s.submod for s in stages if s.is_last]  # this rank's replica's copy, if any
    loss = ChunkedLoss(lambda: last[0].head, chunk_tokens=5)
    sched = ScheduleBitPipe(stages, m, loss, pair_group=pair)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    for split in (False, True):
        for s in stages:
            s.submod.zero_grad()
        losses: list[torch.Tensor] = []
        if split:  # torch 2.14+'s pre-split inputs, one document tensor per microbatch
            if not rt.STEP_TAKES_MICROBATCHES:
                continue
            sched.step(arg_mbs=[(x[i : i + 1],) for i in range(m)] if has_first else None,
                       kwarg_mbs=[{}] * m,
                       target_mbs=[y[i : i + 1] for i in range(m)] if has_last else None,
                       losses=losses, document_ids=[docs[i : i + 1] for i in range(m)])  # fmt: skip
        else:
            sched.step(*((x,) if has_first else ()), target=y if has_last else None,
                       losses=losses, document_ids=docs)  # fmt: skip
        if has_last:
            mean = torch.stack(losses).mean().item()
            assert abs(mean - ref_loss.item()) <= 1e-5 * ref_loss.item(), (split, rank)
        for stage in stages:
            c = stage.stage_index % (2 * pp)
            for n, p in stage.submod.named_parameters():
                err = _rel(p.grad, ref_grads[(c, n)])
                assert err <= 1e-5, f"split={split} rank {rank} stage {c} {n}: {err:.2e}"


def _four_ranks(rank: int, world: int) -> None:
    for tied, m in ((False, 4), (True, 8), (False, 6)):
        _check_step(rank, world, tied, m)
    _check_training(rank, world, m=4)


def _two_ranks(rank: int, world: int) -> None:
    for tied, m in ((False, 2), (True, 4)):
        _check_step(rank, world, tied, m)
    _check_training(rank, world, m=4)
    _check_csv_round_trip(rank, world)
    _check_documents(rank, world, m=4)


def test_equivalence_four_ranks() -> None:
    # pp=4: 8 chunks of 1 layer; untied M=4 and M=6 (not a multiple of pp), tied M=8;
    # then 2 optimizer steps (SGD vs the reference, AdamW from per-rank random init)
    run_ranks(_four_ranks, 4)


def test_equivalence_two_ranks() -> None:
    # pp=2: 4 chunks of 2 layers; partners are ranks 0 and 1, both holding first and last stages
    run_ranks(_two_ranks, 2)
