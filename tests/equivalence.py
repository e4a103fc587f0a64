"""Worker: Seq1F1B on gloo ranks vs a single-process full-sequence reference."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage

from seq1f1b import (
    ContextParallelConfig,
    MemoryCappedSplit,
    ModelShape,
    ScheduleSeq1F1B,
    SequenceSplit,
    packed_documents,
)
from seq1f1b.attention.kv import document_cp_layout, zigzag_runs
from seq1f1b.attention.mask_mods import CausalBigBird, VisiblePrefix
from seq1f1b.attention.masks import document_runs
from seq1f1b.orders.order import OrderSpec
from seq1f1b.registry import lookup
from seq1f1b.schedules.partition import uniform_split
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
    docs: bool = False  # packed documents (DOCS)
    window: int | None = None  # sliding window on the even layers
    sinks: int = 0
    pad: bool = False  # sample 0's targets ignored from position 16 on
    schedule: str = "Seq1F1B"  # a seq-chunked schedule of the registry
    cp: int = 1  # context-parallel degree (the world is pp x cp, pp outer)
    cp_prefix: str = "auto"
    memory_cap: float = 1.0  # seq_split="memory_capped" only
    hybrid: bool = False  # Qwen3.5's stack: three Gated DeltaNet layers, then one attention
    mask: str | None = None  # every attention layer's mask_mod (MASK_MODS)

    @property
    def cfg(self) -> TinyConfig:
        every = 4 if self.hybrid else 1
        mod = None if self.mask is None else MASK_MODS[self.mask]
        return replace(CFG, window=self.window, sinks=self.sinks, full_attention_every=every,
                       mask_mod=mod)  # fmt: skip


#: mask_mods at the grid's size (blocks of 4 positions): BigBird made causal (2 global
#: tokens, a window of 5, random earlier blocks), a shared prefix of 3 beside a window of 4
MASK_MODS = {
    "bigbird": CausalBigBird(global_tokens=2, window=5, density=0.3, seed=1, block=4),
    "prefix": VisiblePrefix(prefix=3, window=4, block=4),
}


# one row per sample of a batch of 6 at 24 tokens: a document over three segments of 8, no
# boundary, a boundary on a segment boundary, short documents, two halves, a 1-token document
# (columns 24..31 for the context-parallel cases, whose segments are multiples of 2*cp)
DOCS = torch.tensor(
    [
        [0] * 3 + [1] * 18 + [2] * 3 + [2] * 2 + [3] * 6,
        [0] * 24 + [0] * 8,
        [0] * 8 + [1] * 16 + [2] * 8,
        [0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6, 6, 6, 7, 7, 8, 9] + [9] * 8,
        [0] * 12 + [1] * 12 + [1] * 5 + [2] * 3,
        [0] + [1] * 23 + [1] * 8,
    ]
)


def documents(case: Case) -> torch.Tensor | None:
    return DOCS[: case.batch, : case.seq_len] if case.docs else None


def _masked(case: Case) -> contextlib.AbstractContextManager:
    ids = documents(case)
    return packed_documents(ids) if ids is not None else contextlib.nullcontext()


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(logits.dtype, torch.float32)  # an fp64 model's stays fp64
    return F.cross_entropy(logits.flatten(0, 1).to(wide), target.flatten())


def data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, CFG.vocab, (case.batch, case.seq_len + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if case.pad:
        y[: case.batch // case.n_microbatches, 16:] = -100  # whole units of sample 0 ignored
    return x, y


def reference(case: Case, num_stages: int) -> tuple[float, dict[str, torch.Tensor]]:
    mods = build_stages(case.cfg, num_stages, checkpointing=case.checkpointing)
    model = full_model(mods)
    x, y = data(case)
    with _masked(case):  # around backward too: checkpointing recomputes attention there
        loss = loss_fn(model(x), y)
        loss.backward()
    grads = {
        f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()
    }
    return loss.item(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _groups(rank: int, world: int, cp: int) -> tuple[int, int, object, object]:
    """(pp rank, pp size, pp group, cp group) of a pp x cp mesh (pp outer); no groups at cp=1."""
    if cp == 1:
        return rank, world, None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("pp", "cp"))
    return rank // cp, world // cp, mesh["pp"].get_group(), mesh["cp"].get_group()


def my_stages(case: Case, pp_rank: int, pp: int) -> list[int]:
    """The stages this pipeline rank holds in the schedule's placement (looped or V)."""
    return lookup(case.schedule).stages_of(pp, pp_rank, case.stages_per_rank)


def run_case(rank: int, world: int, case: Case, tol: float = 1e-5) -> None:
    pp_rank, pp, pp_group, cp_group = _groups(rank, world, case.cp)
    num_stages = pp * case.stages_per_rank
    ref_loss, ref_grads = reference(case, num_stages)
    mods = build_stages(case.cfg, num_stages, checkpointing=case.checkpointing)
    mine = my_stages(case, pp_rank, pp)
    dev = torch.device("cpu")
    stages = [PipelineStage(mods[s], s, num_stages, dev, group=pp_group) for s in mine]
    split = case.split if isinstance(case.split, str) else list(case.split)
    shape = ModelShape(hidden=CFG.dim, n_heads=CFG.n_heads, n_layers=CFG.n_layers, vocab=CFG.vocab)
    grouped_split = (
        capped_split(case)
        if case.split == "memory_capped"
        else SequenceSplit(split if isinstance(split, str) else tuple(split), model_shape=shape)
    )
    cls = lookup(case.schedule).schedule_class()
    sched = cls(
        stages,
        case.n_microbatches,
        case.seq_chunks,
        loss_fn,
        seq_split=grouped_split,
        context_parallel=ContextParallelConfig(cp_group, case.cp_prefix),
    )
    x, y = data(case)
    losses: list[torch.Tensor] = []
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    args = (x,) if has_first else ()
    out = sched.step(
        *args,
        target=y if has_last else None,
        losses=losses if has_last else None,
        document_ids=documents(case),
    )
    assert sched.unit_actions.kv_state_empty(), "K/V state survived step()"
    if has_last:
        assert len(losses) == case.n_microbatches * case.seq_chunks
        assert all(bool(torch.isfinite(x)) for x in losses), losses
        loss_t = torch.stack(losses).mean()
        if cp_group is not None:  # each CP rank's loss is its share: their mean is the loss
            torch.distributed.all_reduce(loss_t, group=cp_group)
            loss_t /= case.cp
        loss = loss_t.item()
        assert abs(loss - ref_loss) <= tol * abs(ref_loss), (case, loss, ref_loss)
        assert out.shape == (case.batch, case.seq_len // case.cp, CFG.vocab), out.shape
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


def mask_grid() -> list[Case]:
    """Packed documents, windows (smaller than, equal to, larger than a segment), sinks,
    all-padding units and checkpointing, for one and two stages per rank."""
    cases = []
    for spr in (1, 2):
        cases += [Case(spr, k, 2, docs=True) for k in (1, 2, 3, 4)]
        cases += [
            Case(spr, 3, 2, docs=True, split=(11, 8, 5)),
            Case(spr, 4, 2, window=5),
            Case(spr, 4, 2, window=6),
            Case(spr, 2, 3, window=15, split=(14, 10)),
            Case(spr, 3, 2, docs=True, window=5, sinks=2),
            Case(spr, 4, 2, docs=True, checkpointing=True, split=(9, 7, 5, 3)),
            Case(spr, 3, 2, window=5, sinks=2, checkpointing=True, split=(11, 8, 5)),
            Case(spr, 3, 2, docs=True, pad=True),
            Case(spr, 3, 1, docs=True, window=4, pad=True, checkpointing=True),
        ]
    return cases


def zb_grid() -> list[Case]:
    """ZBSeq1F1B (split backward): K in {1,2,4}, uneven splits, checkpointing, documents."""
    cases = []
    for spr in (1, 2):
        cases += [Case(spr, k, m, schedule="ZBSeq1F1B") for k, m in ((1, 2), (2, 3), (4, 2))]
        cases += [
            Case(spr, 3, 2, split=(11, 8, 5), schedule="ZBSeq1F1B"),
            Case(spr, 4, 2, checkpointing=True, split=(9, 7, 5, 3), schedule="ZBSeq1F1B"),
            Case(spr, 2, 2, checkpointing=True, schedule="ZBSeq1F1B"),
            Case(spr, 3, 2, docs=True, window=5, schedule="ZBSeq1F1B"),
        ]
    return cases


def zbv_grid() -> list[Case]:
    """ZBVSeq1F1B (V placement, two stages per rank, split backward): K in {1,2,4} and 3,
    M in {1,2,3}, uneven and compute splits, checkpointing, documents + window, padding."""
    z = "ZBVSeq1F1B"
    return [
        *(Case(2, k, m, schedule=z) for k, m in ((1, 1), (1, 3), (2, 2), (4, 1), (4, 2))),
        Case(2, 4, 3, split="compute", schedule=z),
        Case(2, 3, 2, split=(11, 8, 5), schedule=z),
        Case(2, 4, 2, checkpointing=True, split=(9, 7, 5, 3), schedule=z),
        Case(2, 2, 3, checkpointing=True, schedule=z),
        Case(2, 3, 2, docs=True, window=5, schedule=z),
        Case(2, 4, 2, docs=True, checkpointing=True, schedule=z),
        Case(2, 3, 2, docs=True, pad=True, schedule=z),
    ]


def mask_mod_grid() -> list[Case]:
    """Causal ``mask_mod``s (BigBird's global + window + random blocks, a visible prefix)
    under every Seq1F1B-family schedule, with packed documents, checkpointing, uneven splits,
    padding, and context parallelism (cp = 2, pp = 1: the ring plans the same tiles)."""
    b, p = {"mask": "bigbird"}, {"mask": "prefix"}
    return [
        Case(1, 4, 2, **b),
        Case(1, 3, 2, docs=True, split=(11, 8, 5), **b),
        Case(1, 4, 2, checkpointing=True, **p),
        Case(2, 3, 2, docs=True, schedule="InterleavedSeq1F1B", **b),
        Case(2, 4, 1, checkpointing=True, pad=True, schedule="InterleavedSeq1F1B", **p),
        Case(1, 4, 2, docs=True, schedule="ZBSeq1F1B", **b),
        Case(1, 3, 2, checkpointing=True, schedule="ZBSeq1F1B", **p),
        Case(2, 4, 2, docs=True, schedule="ZBVSeq1F1B", **b),
        Case(2, 2, 3, checkpointing=True, schedule="ZBVSeq1F1B", **p),
        Case(1, 4, 2, cp=2, seq_len=32, cp_prefix="pass_q", **b),
        Case(1, 2, 2, cp=2, seq_len=32, docs=True, cp_prefix="pass_kv", checkpointing=True, **p),
    ]


def run_mask_mod_grid(rank: int, world: int) -> None:
    run_cases(rank, world, mask_mod_grid())


def hybrid_grid() -> list[Case]:
    """Gated DeltaNet layers (their state carried between segments) beside attention, under
    every Seq1F1B-family schedule: K in {1,2,3,4}, uneven splits shorter than the
    convolution, checkpointing, documents (a reset at and inside segments), padding; with two
    stages per rank, stages 0 and 2 hold no attention layer."""
    h = {"hybrid": True}
    return [
        Case(1, 4, 2, **h),
        Case(1, 3, 2, split=(2, 17, 5), checkpointing=True, **h),
        Case(1, 3, 2, docs=True, **h),
        Case(1, 4, 1, docs=True, checkpointing=True, pad=True, **h),
        Case(2, 4, 2, schedule="InterleavedSeq1F1B", **h),
        Case(2, 3, 2, docs=True, checkpointing=True, schedule="InterleavedSeq1F1B", **h),
        Case(1, 4, 2, checkpointing=True, schedule="ZBSeq1F1B", **h),
        Case(2, 3, 2, docs=True, split=(11, 3, 10), schedule="ZBVSeq1F1B", **h),
        Case(2, 2, 3, checkpointing=True, schedule="ZBVSeq1F1B", **h),
        Case(1, 1, 2, **h),
    ]


def run_hybrid_grid(rank: int, world: int) -> None:
    run_cases(rank, world, hybrid_grid())


def run_zbv_grid(rank: int, world: int) -> None:
    run_cases(rank, world, zbv_grid())


def run_zb_grid(rank: int, world: int, stages_per_rank: int) -> None:
    run_cases(rank, world, [c for c in zb_grid() if c.stages_per_rank == stages_per_rank])


def run_cases(rank: int, world: int, cases: list[Case]) -> None:
    """Every case; all mismatches reported at once (assertions come after the step)."""
    failures = []
    for case in cases:
        try:
            run_case(rank, world, case)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, f"{len(failures)} cases differ from the reference:\n" + "\n".join(failures)


def run_mask_grid(rank: int, world: int, stages_per_rank: int) -> None:
    run_cases(rank, world, [c for c in mask_grid() if c.stages_per_rank == stages_per_rank])


def run_grid(rank: int, world: int, stages_per_rank: int) -> None:
    """Every case of the grid with this many stages per rank (the assertion comes after the
    step, so the ranks stay in step after a failed case)."""
    run_cases(rank, world, [c for c in grid(world) if c.stages_per_rank == stages_per_rank])


def run_eval_case(rank: int, world: int, case: Case) -> None:
    """eval() with K > 1: logits and losses equal the full-sequence forward, no state left
    (with CP: this rank's share of the logits, and the CP mean of the losses)."""
    pp_rank, pp, pp_group, cp_group = _groups(rank, world, case.cp)
    num_stages = pp * case.stages_per_rank
    mods = build_stages(case.cfg, num_stages)
    x, y = data(case)
    with torch.no_grad(), _masked(case):
        ref_logits = full_model(mods)(x)
        ref_loss = loss_fn(ref_logits, y).item()
    mine = list(range(pp_rank, num_stages, pp))
    dev = torch.device("cpu")
    stages = [PipelineStage(mods[s], s, num_stages, dev, group=pp_group) for s in mine]
    split = case.split if isinstance(case.split, str) else list(case.split)
    sched = ScheduleSeq1F1B(
        stages, case.n_microbatches, case.seq_chunks, loss_fn, seq_split=split,
        context_parallel=ContextParallelConfig(cp_group),
    )  # fmt: skip
    if cp_group is not None:  # this rank's positions, segment by segment
        lengths = sched.split_lengths(case.seq_len)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        cp_rank = torch.distributed.get_rank(cp_group)
        ids, rows = documents(case), case.batch // case.n_microbatches
        shards = []  # each sample's rows at its positions (the layout follows its documents)
        for m in range(case.n_microbatches):
            groups = None if ids is None else document_runs(ids[m * rows : (m + 1) * rows])
            pos = [
                i
                for s, n in zip(starts, lengths, strict=True)
                for a, b in (
                    zigzag_runs(s, s + n, cp_rank, case.cp)
                    if groups is None
                    else document_cp_layout(s, s + n, case.cp, groups)[cp_rank]
                )
                for i in range(a, b)
            ]
            shards.append(ref_logits[m * rows : (m + 1) * rows, pos])
        ref_logits = torch.cat(shards)
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    for _ in range(2):  # twice: the second call reuses the initialised stages
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            out = sched.eval(
                *((x,) if has_first else ()),
                target=y if has_last else None,
                losses=losses if has_last else None,
                document_ids=documents(case),
            )
        assert sched.unit_actions.kv_state_empty()
        if has_last:
            assert rel_err(out, ref_logits) <= 1e-5
            loss = torch.stack(losses).mean()
            if cp_group is not None:
                torch.distributed.all_reduce(loss, group=cp_group)
                loss /= case.cp
            assert abs(loss.item() - ref_loss) <= 1e-5 * ref_loss
    for p in (p for s in mine for p in mods[s].parameters()):
        assert p.grad is None


def cp_grid(pp: int) -> list[Case]:
    """Context parallelism (cp=2) with Seq1F1B: K in {1,2,4}, 1 and 2 stages per rank, uneven
    segments, checkpointing, GQA (the model's K/V heads are half its query heads), packed
    documents and windows, each prefix mode."""
    base = {"cp": 2, "seq_len": 32}
    cases = [
        Case(1, 1, 2, **base),
        Case(1, 2, 2, **base, cp_prefix="pass_q"),
        Case(1, 4, 2, **base, cp_prefix="pass_kv"),
        Case(2, 4, 3, **base),
        Case(2, 3, 2, **base, split=(12, 8, 12), cp_prefix="pass_q"),
        Case(1, 4, 2, **base, split=(12, 8, 4, 8), checkpointing=True, cp_prefix="pass_kv"),
        Case(2, 2, 2, **base, checkpointing=True, cp_prefix="pass_q"),
        Case(1, 4, 2, **base, docs=True, cp_prefix="pass_q"),
        Case(2, 2, 3, **base, docs=True, window=6, sinks=2, cp_prefix="pass_kv"),
        Case(1, 4, 2, **base, window=5, checkpointing=True),
    ]
    if pp > 1:
        cases.append(Case(1, 4, 2, **base, schedule="ZBSeq1F1B", cp_prefix="pass_q"))
    return cases


def wide_cp_grid(cp: int) -> list[Case]:
    """cp = 3 or 4 on as many ranks (pp = 1): the ring's middle hops, where partial outputs and
    gradient accumulators travel along with the blocks."""
    base = {"cp": cp, "seq_len": 24 if cp == 3 else 32}
    return [
        Case(1, 1, 2, **base),
        Case(1, 2, 2, **base, cp_prefix="pass_q"),
        Case(1, 2, 2, **base, cp_prefix="pass_kv", checkpointing=True),
        Case(2, 2, 1, **base, docs=True, window=5, sinks=2),
    ]


def run_wide_cp_grid(rank: int, world: int) -> None:
    run_cases(rank, world, wide_cp_grid(world))


def run_cp_grid(rank: int, world: int) -> None:
    run_cases(rank, world, cp_grid(world // 2))
    for case in (
        Case(1, 4, 2, cp=2, seq_len=32),
        Case(2, 3, 2, cp=2, seq_len=32, docs=True, window=5, sinks=2, pad=True),
    ):
        run_eval_case(rank, world, case)


def run_changing_lengths(
    rank: int, world: int, seq_lens: list[int], stages_per_rank: int, split: str = "uniform"
) -> None:
    """One schedule, steps of different sequence lengths (and an eval at yet another): each
    equals the full-sequence reference at its length (receive sizes follow the step); then a
    length the explicit split cannot cut fails on every rank before any traffic."""
    num_stages = world * stages_per_rank
    mods = build_stages(CFG, num_stages)
    mine = list(range(rank, num_stages, world))
    dev = torch.device("cpu")
    stages = [PipelineStage(mods[s], s, num_stages, dev) for s in mine]
    cls = lookup("Seq1F1B").schedule_class()
    shape = ModelShape(hidden=CFG.dim, n_heads=CFG.n_heads, n_layers=CFG.n_layers, vocab=CFG.vocab)
    sched = cls(stages, 2, 3, loss_fn, seq_split=SequenceSplit(split, model_shape=shape))
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    for seq_len in seq_lens:
        case = Case(stages_per_rank, 3, 2, seq_len=seq_len, batch=4)
        ref_loss, ref_grads = reference(case, num_stages)
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        x, y = data(case)
        losses: list[torch.Tensor] = []
        sched.step(
            *((x,) if has_first else ()),
            target=y if has_last else None,
            losses=losses if has_last else None,
        )
        if has_last:
            loss = torch.stack(losses).mean().item()
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (seq_len, loss, ref_loss)
        for s in mine:
            for n, p in mods[s].named_parameters():
                err = rel_err(p.grad, ref_grads[f"{s}.{n}"])
                assert err <= 1e-5, f"seq_len {seq_len} stage {s} {n}: rel err {err:.2e}"
    case = Case(stages_per_rank, 3, 2, seq_len=18, batch=4)
    x, y = data(case)
    with torch.no_grad():
        want = loss_fn(full_model(build_stages(CFG, num_stages))(x), y).item()
        losses = []
        sched.eval(
            *((x,) if has_first else ()),
            target=y if has_last else None,
            losses=losses if has_last else None,
        )
    if has_last:
        got = torch.stack(losses).mean().item()
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    fixed = cls(stages, 2, 3, loss_fn, seq_split=[12, 7, 5])
    x, y = data(Case(stages_per_rank, 3, 2, seq_len=36, batch=4))
    try:
        fixed.step(*((x,) if has_first else ()), target=y if has_last else None)
    except (ValueError, RuntimeError) as exc:
        assert "36" in str(exc) or "another pipeline rank rejected" in str(exc), exc
    else:
        raise AssertionError("a 36-token step with a 24-token split ran")


def run_with_instance_override(rank: int, world: int) -> None:
    """A user's instance-level override of ``forward_one_chunk`` (e.g. tracing) is called for
    every unit, the step stays exact, and the override is still there after the step."""
    case = Case(2, 3, 2)
    num_stages = world * case.stages_per_rank
    ref_loss, _ = reference(case, num_stages)
    mods = build_stages(CFG, num_stages)
    mine = list(range(rank, num_stages, world))
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    calls: list[int] = []
    overrides = {}
    for stage in stages:
        inner = stage.forward_one_chunk

        def traced(chunk_id, *args, _inner=inner, **kwargs):
            calls.append(chunk_id)
            return _inner(chunk_id, *args, **kwargs)

        stage.forward_one_chunk = traced
        overrides[stage] = traced
    sched = lookup("Seq1F1B").schedule_class()(stages, 2, 3, loss_fn, seq_split="uniform")
    x, y = data(case)
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []
    sched.step(*((x,) if has_first else ()), target=y if has_last else None,
               losses=losses if has_last else None)  # fmt: skip
    assert sorted(calls) == sorted(list(range(6)) * len(stages)), calls
    assert all(vars(st)["forward_one_chunk"] is fn for st, fn in overrides.items())
    if has_last:
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)


# The memory-capped split's cost model only picks lengths; an attention-heavy shape (wide heads
# at 24 tokens) makes it pick uneven ones, which is what these cases must exercise.
ATTENTION_HEAVY = ModelShape(hidden=32, n_heads=4, n_layers=8, vocab=64, head_dim=512)


def capped_split(case: Case) -> SequenceSplit:
    return MemoryCappedSplit(model_shape=ATTENTION_HEAVY, memory_cap=case.memory_cap)


def capped_grid() -> list[Case]:
    """split="memory_capped": K in {1,2,4}, caps 1.0 and 1.3, checkpointing, documents +
    window, ZBSeq1F1B, for one and two stages per rank."""
    cases = []
    for spr in (1, 2):
        cases += [Case(spr, k, 2, split="memory_capped", memory_cap=1.3) for k in (1, 2, 4)]
        cases += [
            Case(spr, 4, 2, split="memory_capped"),
            Case(spr, 4, 3, split="memory_capped", memory_cap=1.3, checkpointing=True),
            Case(spr, 4, 2, split="memory_capped", memory_cap=1.3, docs=True, window=5),
            Case(spr, 2, 2, split="memory_capped", memory_cap=1.3, schedule="ZBSeq1F1B"),
        ]
    cases.append(Case(2, 4, 2, split="memory_capped", memory_cap=1.3, schedule="ZBVSeq1F1B"))
    return cases


def capped_lengths(case: Case, pp: int) -> list[int]:
    """The lengths the schedule will use (the same search, on its order)."""
    entry = lookup(case.schedule)
    spec = OrderSpec(pp, case.stages_per_rank, case.n_microbatches, case.seq_chunks,
                     entry.split_backward, "v" if entry.placement == "v" else "looped")  # fmt: skip
    return capped_split(case).lengths(case.seq_len, case.seq_chunks, 1, spec)


def run_capped_grid(rank: int, world: int, stages_per_rank: int) -> None:
    """The capped cases with this many stages per rank; some must really be uneven."""
    cases = [c for c in capped_grid() if c.stages_per_rank == stages_per_rank]
    uneven = [
        c for c in cases if capped_lengths(c, world) != uniform_split(c.seq_len, c.seq_chunks)
    ]
    assert len(uneven) >= 2, f"the search kept the uniform split in {cases}"
    run_cases(rank, world, cases)


def packed_layout(batch: int, seq_len: int, seed: int, mean_doc: float) -> torch.Tensor:
    """(batch, seq_len) document ids of documents with exponential lengths (mean
    ``mean_doc``), packed one after another: a different layout for every seed."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        draws = torch.empty(seq_len).exponential_(1 / mean_doc, generator=g) + 1
        lengths = draws.clamp(max=seq_len).long()
        rows.append(torch.repeat_interleave(torch.arange(seq_len), lengths)[:seq_len])
    return torch.stack(rows)


def run_mask_split_steps(rank: int, world: int, schedule: str, stages_per_rank: int,
                         checkpointing: bool = False, cp: int = 1,
                         window: int | None = None) -> None:  # fmt: skip
    """``split="compute"`` with documents that change every step: each step's lengths are
    balanced for its own document mask (they change between steps and differ from the causal
    split), and every step (and an ``eval()``) equals the full-sequence reference."""
    from seq1f1b.schedules.mask_split import mask_balanced_split
    from seq1f1b.schedules.partition import compute_balanced_split, segment_multiple

    pp_rank, pp, pp_group, cp_group = _groups(rank, world, cp)
    num_stages = pp * stages_per_rank
    seq_len, batch, m, k = 48 * cp, 4, 2, 3
    case = Case(stages_per_rank, k, m, seq_len=seq_len, batch=batch, schedule=schedule,
                checkpointing=checkpointing, cp=cp)  # fmt: skip
    cfg = replace(CFG, window=window, sinks=2 if window else 0)  # windows on even layers
    mods = build_stages(cfg, num_stages, checkpointing=checkpointing)
    mine = my_stages(case, pp_rank, pp)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu"), group=pp_group)
              for s in mine]  # fmt: skip
    shape = ModelShape(hidden=CFG.dim, n_heads=CFG.n_heads, n_layers=CFG.n_layers, vocab=CFG.vocab,
                       window=window, sinks=cfg.sinks,
                       window_layers=CFG.n_layers // 2 if window else None)  # fmt: skip
    sched = lookup(schedule).schedule_class()(
        stages, m, k, loss_fn, seq_split=SequenceSplit("compute", model_shape=shape),
        context_parallel=ContextParallelConfig(cp_group),
    )  # fmt: skip
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    causal = compute_balanced_split(seq_len, k, shape, segment_multiple(1, cp))
    seen = []
    for step, mean_doc in enumerate((4.0, 1e9, 12.0)):  # short, one per row, mid
        docs = packed_layout(batch, seq_len, seed=step, mean_doc=mean_doc)
        ref = build_stages(cfg, num_stages, checkpointing=checkpointing)
        for s in mine:  # the pipeline's weights start each step equal to the reference's
            ref[s].load_state_dict(mods[s].state_dict())
            mods[s].zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CFG.vocab, (batch, seq_len + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with packed_documents(docs):
            ref_loss = loss_fn(full_model(ref)(x), y)
            ref_loss.backward()
        lengths = sched.sample_lengths(seq_len, docs)
        want = [
            mask_balanced_split(d, k, shape, multiple_of=segment_multiple(1, cp))
            for d in docs.tensor_split(m)
        ]
        assert lengths == want, (step, lengths, want)
        seen += lengths
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if has_first else ()), target=y if has_last else None,
                   losses=losses if has_last else None, document_ids=docs)  # fmt: skip
        assert sched.segment_lengths == [tuple(ls) for ls in lengths]  # each sample its own cut
        if has_last:
            loss_t = torch.stack(losses).mean()
            if cp_group is not None:
                torch.distributed.all_reduce(loss_t, group=cp_group)
                loss_t /= cp
            assert abs(loss_t.item() - ref_loss.item()) <= 1e-5 * ref_loss.item(), step
        for s in mine:
            for n, p in mods[s].named_parameters():
                err = rel_err(p.grad, dict(ref[s].named_parameters())[n].grad)
                assert err <= 1e-5, f"step {step} stage {s} {n}: rel err {err:.2e}"
        if step == 2:  # forward-only, same documents
            with torch.no_grad():
                losses = []
                sched.eval(*((x,) if has_first else ()), target=y if has_last else None,
                           losses=losses if has_last else None, document_ids=docs)  # fmt: skip
            if has_last and cp_group is None:
                got = torch.stack(losses).mean().item()
                assert abs(got - ref_loss.item()) <= 1e-5 * ref_loss.item(), (got, ref_loss)
    assert len({tuple(s) for s in seen}) > 1, seen  # the split follows the documents
    assert any(s != causal for s in seen), (seen, causal)
