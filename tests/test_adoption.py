"""A model adapted wrongly fails at the first step instead of training silently wrong: a stage
that mixes sequence positions without the chunk-aware attention (attention written by hand, a
convolution over the sequence) is caught; attention-free stages and correct models are not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn
from torch.distributed.pipelining import PipelineStage

import seq1f1b._runtime as rt
from seq1f1b import ScheduleInterleavedSeq1F1B, ScheduleSeq1F1B, verify_model
from seq1f1b.attention.mixing_probe import PositionMixingError
from seq1f1b.schedules.output_check import OutputMismatchError
from seq1f1b.testing import TinyConfig, TinyStage, build_stages, full_model

CFG = TinyConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=4, ffn=64)
CPU = torch.device("cpu")


class HandWrittenAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V under a causal mask: right unpipelined, wrong per segment."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        return s.masked_fill(mask, float("-inf")).softmax(-1) @ v


class SequenceConv(nn.Module):
    """A causal depthwise convolution over the sequence (e.g. a Mamba-style mixer)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch(seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, CFG.vocab, (2, seq_len + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _single_stage(model: nn.Module, k: int = 2) -> ScheduleSeq1F1B:
    return ScheduleSeq1F1B([PipelineStage(model, 0, 1, CPU)], 2, k, _loss)


def _wrong_models(rank: int, world: int) -> None:
    x, y = _batch()
    hand = build_stages(CFG, 1)[0]
    for block in hand.layers:
        block.attn = HandWrittenAttention()
    with pytest.raises(PositionMixingError, match="combines sequence positions in the forward "
                       "of segment 1 without calling the chunk-aware attention"):  # fmt: skip
        _single_stage(hand).step(x, target=y)
    _single_stage(hand, k=1).step(x, target=y)  # K = 1: nothing is cut, nothing to catch
    conv = TinyStage(CFG, True, True, 0)  # embedding, a convolution over the sequence, head
    conv.layers.append(SequenceConv(CFG.dim))
    with pytest.raises(PositionMixingError, match="a convolution, a norm over the sequence"):
        _single_stage(conv).step(x, target=y)


def test_hand_written_attention_and_sequence_mixers_fail_the_first_step() -> None:
    run_ranks(_wrong_models, 1)


def _hand_attention_on_rank_1(rank: int, world: int) -> None:
    """Rank 1's stage attends by hand: both ranks raise the named error after the first step
    (rank 0 learns it by the step's closing all-reduce), neither waits for a timeout."""
    x, y = _batch()
    mods = build_stages(CFG, world)
    for block in mods[1].layers:
        block.attn = HandWrittenAttention()
    stage = PipelineStage(mods[rank], rank, world, CPU)
    named = "stage 1 combines sequence positions in the forward of segment 1 without calling"
    with pytest.raises(PositionMixingError, match=named):
        ScheduleSeq1F1B([stage], 2, 2, _loss).step(
            x if rank == 0 else None, target=y if rank == world - 1 else None
        )


def test_hand_written_attention_fails_the_first_step_on_every_rank() -> None:
    run_ranks(_hand_attention_on_rank_1, 2)


def _attention_free_stages(rank: int, world: int) -> None:
    """Embedding-only and head-only stages (no attention at all) raise nothing, and the step
    equals the unpipelined model."""
    torch.manual_seed(0)
    layers = build_stages(CFG, 1)[0]
    embed = TinyStage(CFG, True, False, 0)  # embedding only
    middle = TinyStage(CFG, False, False, CFG.n_layers)
    head = TinyStage(CFG, False, True, 0)  # norm + head only
    middle.load_state_dict(
        {k: v for k, v in layers.state_dict().items() if k.startswith("layers.")}
    )
    mods = [embed, middle, TinyStage(CFG, False, False, 0), head]
    x, y = _batch(24)
    ref = full_model(mods)
    _loss(ref(x), y).backward()
    want = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(mods) for n, p in m.named_parameters()}
    for m in mods:
        m.zero_grad(set_to_none=True)
    stages = [PipelineStage(m, i, 4, CPU) for i, m in enumerate(mods)]
    ScheduleInterleavedSeq1F1B(stages, 2, 3, _loss).step(x, target=y)
    for i, m in enumerate(mods):
        for n, p in m.named_parameters():
            err = ((p.grad - want[f"{i}.{n}"]).norm() / want[f"{i}.{n}"].norm()).item()
            assert err <= 1e-5, (i, n, err)


def test_attention_free_stages_raise_nothing() -> None:
    run_ranks(_attention_free_stages, 1)


class SegmentRope(nn.Module):
    """A block whose RoPE positions come from ``arange(segment length)`` (the mistake)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import seq1f1b.testing as testing

        real = testing.rope_positions
        testing.rope_positions = lambda h: torch.arange(h.shape[1], device=h.device)
        try:
            return self.block(x)
        finally:
            testing.rope_positions = real


class LearnedPositions(nn.Module):
    """Learned absolute position embeddings, added after the token embedding: correct when
    the positions come from the running segment (``current_segment().positions()``)."""

    def __init__(self, n: int, dim: int, from_segment: bool = True) -> None:
        super().__init__()
        self.table = nn.Embedding(n, dim)
        self.from_segment = from_segment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from seq1f1b import current_segment

        info = current_segment() if self.from_segment else None
        pos = info.positions(x.device) if info else torch.arange(x.shape[1], device=x.device)
        return x + self.table(pos)


def _two_stages(layer_fix=None) -> list[nn.Module]:
    mods = build_stages(CFG, 2)
    if layer_fix is not None:
        mods[1].layers[0] = layer_fix(mods[1].layers[0])
    return mods


def test_verify_model_passes_correct_models_and_names_the_mistakes() -> None:
    x, y = _batch(24)
    docs = torch.arange(24).div(10, rounding_mode="floor").expand(2, 24)
    good = verify_model(_two_stages(), x, y, _loss, document_ids=docs)
    assert good.ok, str(good)
    assert "OK" in str(good) and good.lengths == [8, 8, 8]
    learned = _two_stages()
    learned[0].layers.insert(0, LearnedPositions(24, CFG.dim))
    assert verify_model(learned, x, y, _loss).ok  # learned positions from the segment
    wrong_learned = _two_stages()
    wrong_learned[0].layers.insert(0, LearnedPositions(24, CFG.dim, from_segment=False))
    report = verify_model(wrong_learned, x, y, _loss)
    assert not report.ok and report.stage == 0 and report.segment == 1, str(report)
    assert "positions are probably taken from the segment" in str(report)
    rope = verify_model(_two_stages(SegmentRope), x, y, _loss)
    assert not rope.ok and rope.stage == 1 and rope.segment == 1, str(rope)
    assert "arange(segment length)" in str(rope)
    hand = _two_stages()
    for block in hand[1].layers:
        block.attn = HandWrittenAttention()
    report = verify_model(hand, x, y, _loss)
    assert not report.ok and report.stage == 1, str(report)
    assert "without calling the chunk-aware attention" in str(report)
    assert not torch.distributed.is_initialized()  # its one-rank group is gone again


class CallCounter(nn.Module):
    """Counts the tokens it sees in a buffer, as an MoE layer counts tokens per expert; with
    ``per_call`` it also counts its calls (a count that a segment would add once too often)."""

    def __init__(self, per_call: bool = False) -> None:
        super().__init__()
        self.per_call = per_call
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.seen[0] += x.shape[1]
            if self.per_call:
                self.seen[1] += 1
        return x


class HalfPrecisionHead(nn.Module):
    """A layer whose GEMM runs in bf16 whatever the input's dtype (as torchtitan's experts),
    on a branch small enough that the gradients before it keep fp32's accuracy."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.lin = nn.Linear(CFG.dim, CFG.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(x)
        return x + 1e-2 * (x.bfloat16() @ self.lin.weight.bfloat16().T).type_as(x)


def test_verify_model_compares_updated_buffers_and_bounds_low_precision_gradients() -> None:
    x, y = _batch(24)
    counted = _two_stages()
    counted[1].layers.insert(0, CallCounter())
    assert verify_model(counted, x, y, _loss).ok  # 24 tokens a row, however they are cut
    twice = _two_stages()
    twice[1].layers.insert(0, CallCounter(per_call=True))
    report = verify_model(twice, x, y, _loss)
    assert not report.ok and report.worst_buffer is not None, str(report)
    assert report.worst_buffer[0].endswith("seen") and report.worst_gradient[1] <= 1e-4
    assert "a buffer the forward updates does not" in str(report)
    half = _two_stages(HalfPrecisionHead)
    report = verify_model(half, x, y, _loss)
    assert not report.ok and "lin.weight" in report.worst_gradient[0], str(report)
    assert 1e-4 < report.worst_gradient[1] < 1e-2
    assert verify_model(half, x, y, _loss, tolerances={".lin.": 1e-2}).ok


def _first_step_checks(rank: int, world: int) -> None:
    """The first step compares each stage's outputs with the stage over the whole sequence:
    segment-relative RoPE (stage 1) and learned positions (stage 0, in bf16 too) fail it on
    every rank naming the stage and segment, with no call to verify_model; a correct model
    passes, its buffers untouched by the check, which runs again only for a new length."""
    import seq1f1b.schedules.output_check as output_check

    def step(mods: list[nn.Module], seq_len: int = 24, **kw) -> ScheduleSeq1F1B:
        x, y = _batch(seq_len)
        stage = PipelineStage(mods[rank], rank, world, CPU)
        schedule = ScheduleSeq1F1B([stage], 2, 3, _loss, **kw)
        schedule.step(x if rank == 0 else None, target=y if rank == world - 1 else None)
        return schedule

    torch.manual_seed(0)
    rope = _two_stages(SegmentRope)
    with pytest.raises(OutputMismatchError, match="stage 1's outputs differ in segment 1") as e:
        step(rope)
    assert (e.value.stage_index, e.value.segment) == (1, 1) and e.value.error > 1e-3
    assert "arange(segment length)" in str(e.value)
    step(rope, check_attention=False)  # switched off: it trains (silently wrong)
    learned = _two_stages()
    learned[0].layers.insert(0, LearnedPositions(48, CFG.dim, from_segment=False))
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(OutputMismatchError, match="stage 0's outputs differ in segment 1"):
            step([m.to(dtype) for m in learned])
    counted = _two_stages()
    counted[rank].layers.insert(0, CallCounter())
    runs = []
    real = output_check.WholeSequenceCheck.run
    output_check.WholeSequenceCheck.run = lambda self, *a: runs.append(1) or real(self, *a)
    try:
        schedule = step(counted)
        assert counted[rank].layers[0].seen[0] == 2 * 24  # the check's forward left no count
        for n in (24, 24, 48, 48):
            x, y = _batch(n)
            schedule.step(x if rank == 0 else None, target=y if rank == world - 1 else None)
    finally:
        output_check.WholeSequenceCheck.run = real
    assert len(runs) == 2  # the first step and the first at 48 tokens, one stage each


def _compiled_first_step(rank: int, world: int) -> None:
    """Stages with compiled blocks: the first step's guard, probe and output check run on the
    checked units only, eagerly, so a correct model compiles no graph that the unchecked run
    does not (the guard's mode would make a variant of every block), and a segment-relative
    RoPE is still named."""
    counters = rt.dynamo_counters()

    def compiled(mods: list[nn.Module], **kw) -> list[nn.Module]:
        for block in mods[rank].layers:
            block.compile(backend="eager", **kw)
        return mods

    def steps(mods: list[nn.Module], n: int = 1, **kw) -> None:
        x, y = _batch(24)
        schedule = ScheduleSeq1F1B([PipelineStage(mods[rank], rank, world, CPU)], 2, 3, _loss,
                                   **kw)  # fmt: skip
        for _ in range(n):
            schedule.step(x if rank == 0 else None, target=y if rank == world - 1 else None)

    graphs = []
    try:
        for check in (True, False):
            torch.compiler.reset()
            counters.clear()
            torch.manual_seed(0)
            steps(compiled(_two_stages(), fullgraph=True), 2, check_attention=check)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] == graphs[1] > 0, graphs
        torch.compiler.reset()
        with pytest.raises(OutputMismatchError, match="stage 1's outputs differ in segment 1"):
            steps(compiled(_two_stages(SegmentRope)))
    finally:
        torch.compiler.reset()


class ColumnShard(nn.Module):
    """Each rank's columns of a linear map as a DTensor sharded along the last dimension (as
    torchtitan's vocabulary-parallel logits); ``offset`` adds the segment's own positions
    (0, 1, ...) instead of the sequence's, a position mistake the check must see."""

    def __init__(self, mesh, offset: bool = False) -> None:
        super().__init__()
        self.mesh, self.offset = mesh, offset
        self.proj = nn.Linear(CFG.dim, 4)

    def forward(self, x: torch.Tensor):
        from torch.distributed.tensor import DTensor, Shard

        y = self.proj(x)
        if self.offset:
            y = y + torch.arange(x.shape[1], dtype=y.dtype)[:, None]
        return DTensor.from_local(y, self.mesh, [Shard(2)])


def _sharded_outputs(rank: int, world: int) -> None:
    """Outputs sharded along the vocabulary are compared by each rank's columns (a position
    mistake is caught); inputs shorter than the segment (sequence-parallel shards) skip the
    check, since two segments' shards do not join into the sequence's shard."""
    from torch.distributed.device_mesh import init_device_mesh

    from seq1f1b.schedules.output_check import WholeSequenceCheck

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank)
    x = torch.randn(2, 12, CFG.dim)
    for offset, mismatch in ((False, None), (True, 1)):
        check, module = WholeSequenceCheck(seq_dim=1), ColumnShard(mesh, offset)
        for seg in (x[:, :6], x[:, 6:]):
            check.keep(0, 6, (seg,), {}, module(seg))
        got = check.run(0, module, None)
        assert got is not None and got[0] == mismatch, (offset, got)
    check = WholeSequenceCheck(seq_dim=1)
    for seg in (x[:, :3], x[:, 6:9]):  # half of each 6-position segment
        check.keep(0, 6, (seg,), {}, module(seg))
    assert check.run(0, module, None) is None


def test_the_first_step_compares_stage_outputs_with_the_whole_sequence() -> None:
    run_ranks(_first_step_checks, 2)
    run_ranks(_sharded_outputs, 2)
    run_ranks(_compiled_first_step, 2)
