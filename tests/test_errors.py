"""Bad input fails at construction with a ValueError naming the constraint and the fix;
order violations and split backward raise instead of producing wrong gradients."""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from equivalence import CFG, data, loss_fn, rel_err
from mockstages import MockStage, mock_stages
from torch.distributed.pipelining import PipelineStage

from seq1f1b import (
    ContextParallelConfig,
    ModelShape,
    ScheduleBitPipe,
    ScheduleInterleavedSeq1F1B,
    ScheduleSeq1F1B,
    SequenceSplit,
    build_bitpipe_stages,
)
from seq1f1b.attention.kv import StageKVState
from seq1f1b.testing import build_stages

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_microbatches": 0}, "n_microbatches must be an integer >= 1"),
        ({"n_microbatches": 2.0}, "n_microbatches must be an integer >= 1"),
        ({"seq_chunks": 0}, "seq_chunks must be an integer >= 1"),
        ({"seq_chunks": True}, "seq_chunks must be an integer >= 1"),
        ({"seq_dim": 0}, "dim 0 is the batch dim"),
        ({"seq_split": "balanced"}, "seq_split='balanced' is unknown"),
        ({"seq_split": "compute"}, "needs the model shape"),
        ({"seq_split": [4, 4, 4]}, "split has 3 lengths but seq_chunks=2"),
        ({"seq_split": SequenceSplit(multiple_of=0)}, r"SequenceSplit\.multiple_of must be an int"),
        ({"seq_split": SequenceSplit(seq_len=1)}, "seq_len"),
        ({"seq_split": SequenceSplit((3, 3), seq_len=10)}, "sum"),
        ({"seq_split": SequenceSplit(multiple_of=4, seq_len=6)}, "multiple"),
        ({"context_parallel": ContextParallelConfig(prefix="ring")}, "cp_prefix='ring' is unknown"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    args = {"n_microbatches": 2, "seq_chunks": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        ScheduleSeq1F1B(mock_stages(2, 1), **args)


def test_compute_split_validated_at_construction() -> None:
    shape = ModelShape(hidden=32, n_heads=4, n_layers=4, vocab=64)
    split = SequenceSplit("compute", model_shape=shape, seq_len=64)
    sched = ScheduleSeq1F1B(mock_stages(2, 1), 2, 4, seq_split=split)
    lengths = sched.split_lengths(64)
    assert sum(lengths) == 64 and lengths == sorted(lengths, reverse=True)


def test_bad_placement() -> None:
    with pytest.raises(ValueError, match="looped placement"):
        ScheduleSeq1F1B([MockStage(1, 4, 2, 0)], 2, 2)  # rank 0 must hold 0 and 2
    with pytest.raises(ValueError, match="looped placement"):
        ScheduleSeq1F1B([MockStage(0, 3, 2, 0)], 2, 2)  # 3 stages cannot loop over 2 ranks
    with pytest.raises(ValueError, match="stages is empty"):
        ScheduleSeq1F1B([], 2, 2)
    with pytest.raises(ValueError, match=">= 2 stages per rank"):
        ScheduleInterleavedSeq1F1B(mock_stages(2, 1), 2, 2)


def test_state_guards_wrong_order() -> None:
    st = StageKVState(stage_index=0, num_segments=3)
    with pytest.raises(RuntimeError, match="forward of sample 0 segment 1"):
        st.begin_forward(0, 1)
    for k in range(3):
        st.begin_forward(0, k)
        st.end_forward(0, k, keep=True)
    with pytest.raises(RuntimeError, match="GPipe-style ascending backward"):
        st.begin_backward(0, 0)
    st.begin_backward(0, 2)
    st.end_backward(0, 2)
    with pytest.raises(RuntimeError, match="segment 1 must run first"):
        st.begin_backward(0, 0)


def data_case():
    from equivalence import Case

    return data(Case(1, 2, 2))


class _PlainSDPA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).unsqueeze(1)
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)
        return self.out(h)


def _plain_sdpa_rejected(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _PlainSDPA()
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    x, y = data_case()
    with pytest.raises(
        RuntimeError, match=r"called torch\.nn\.functional\.scaled_dot_product_attention"
    ):
        ScheduleSeq1F1B([stage], 2, 2, loss_fn).step(x, target=y)
    # K = 1 is plain 1F1B: nothing to chunk, so plain SDPA is fine
    sched = ScheduleSeq1F1B([PipelineStage(_PlainSDPA(), 0, 1, torch.device("cpu"))], 2, 1, loss_fn)
    sched.step(x, target=y)
    # ... unless the batch has packed documents, which plain SDPA would attend across
    docs = torch.arange(x.shape[1]).div(7, rounding_mode="floor").expand_as(x)
    with pytest.raises(RuntimeError, match="would ignore the document_ids"):
        sched.step(x, target=y, document_ids=docs)
    with pytest.raises(ValueError, match=r"document_ids cover 5 positions"):
        sched.step(x, target=y, document_ids=docs[:, :5])


def test_plain_sdpa_inside_chunked_unit_raises() -> None:
    run_ranks(_plain_sdpa_rejected, 1)


def _no_growth(rank: int, world: int) -> None:
    mods = build_stages(CFG, world)
    x, y = data_case()
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 2, 4, loss_fn, seq_split=[9, 7, 5, 3])
    first, last = rank == 0, rank == world - 1
    counts = []
    for _ in range(5):
        stage.submod.zero_grad(set_to_none=False)
        sched.step(*((x,) if first else ()), target=y if last else None)
        assert sched.unit_actions.kv_state_empty() and sched.unit_actions.kv_state_bytes() == 0
        gc.collect()
        counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    assert counts[-1] <= counts[1], counts


def test_repeated_steps_do_not_grow_memory() -> None:
    run_ranks(_no_growth, 2)


def _bad_input_fails_every_rank(rank: int, world: int) -> None:
    mods = build_stages(CFG, world)
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn)
    x, y = data_case()
    if rank == 0:  # batch 5 is not divisible by n_microbatches=2
        with pytest.raises(ValueError, match="not divisible by n_microbatches=2"):
            sched.step(x[:5])
    else:
        with pytest.raises(RuntimeError, match="another pipeline rank rejected its inputs"):
            sched.step(target=y)  # this message, not a timeout: no rank waited for traffic
    # whole-batch and pre-split inputs mixed: refused in the same pre-flight, on every rank
    if rank == 0:
        with pytest.raises(ValueError, match="either whole-batch inputs"):
            sched.step(x, arg_mbs=list(x.chunk(2)))
    else:
        with pytest.raises(RuntimeError, match="another pipeline rank rejected its inputs"):
            sched.step(target=y)
    # the schedule stays usable after the rejected steps
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)


def test_bad_input_on_one_rank_fails_all_ranks_fast() -> None:
    run_ranks(_bad_input_fails_every_rank, 2)


def _docs_on_one_rank(rank: int, world: int) -> None:
    mods = build_stages(CFG, world)
    x, y = data_case()
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn)
    docs = torch.zeros_like(x) if rank == 0 else None
    with pytest.raises(ValueError, match="on some pipeline ranks but not on others"):
        sched.step(*((x,) if rank == 0 else ()), target=y if rank else None, document_ids=docs)


def test_document_ids_on_some_ranks_only_fail_everywhere() -> None:
    run_ranks(_docs_on_one_rank, 2)


def _cp_errors(rank: int, world: int) -> None:
    import torch.distributed as dist

    cp = ContextParallelConfig(dist.group.WORLD)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    mods = build_stages(CFG, 1)
    stage = PipelineStage(mods[0], 0, 1, torch.device("cpu"), group=singles[rank])
    # each segment must split into 2 * cp chunks: refused at construction, naming the fix
    with pytest.raises(ValueError, match=r"multiple of 4 tokens \(context parallelism over 2"):
        ScheduleSeq1F1B([stage], 1, 2, loss_fn, seq_split=SequenceSplit(seq_len=30),
                        context_parallel=cp)  # fmt: skip
    with pytest.raises(ValueError, match="split lengths must be a multiple of multiple_of=4"):
        ScheduleSeq1F1B([stage], 1, 2, loss_fn, seq_split=SequenceSplit((14, 10), seq_len=24),
                        context_parallel=cp)  # fmt: skip
    # ... or at the first step when the length comes with the batch (on every CP rank alike)
    sched = ScheduleSeq1F1B([stage], 1, 2, loss_fn, context_parallel=cp)
    x = torch.zeros(2, 30, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of 4"):
        sched.step(x, target=x)
    # with CP even K = 1 must route attention through chunk_aware_attention (the ring)
    plain = PipelineStage(_PlainSDPA(), 0, 1, torch.device("cpu"), group=singles[rank])
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention directly"):
        ScheduleSeq1F1B([plain], 1, 1, loss_fn, context_parallel=cp).step(ids, target=ids)


def test_context_parallel_errors() -> None:
    run_ranks(_cp_errors, 2)


def _disagreeing_ranks(rank: int, world: int) -> None:
    mods = build_stages(CFG, world)
    x, y = data_case()
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    k = 2 if rank == 0 else 3  # rank 1 built K = 3
    sched = ScheduleSeq1F1B([stage], 2, k, loss_fn)
    mine, other = (2, 3) if rank == 0 else (3, 2)
    with pytest.raises(
        ValueError, match=f"seq_chunks is {mine} on this rank and {other} on another"
    ):
        sched.step(*((x,) if rank == 0 else ()), target=y if rank else None)
    split = ScheduleSeq1F1B([stage], 2, 2, loss_fn, seq_split="uniform" if rank else [20, 12])
    with pytest.raises(ValueError, match=r"seq_split is SequenceSplit.* on this rank and another"):
        split.step(*((x,) if rank == 0 else ()), target=y if rank else None)


def test_ranks_that_built_different_schedules_fail_together_before_traffic() -> None:
    """A rank with another K (or split) fails the first step on every rank with one error
    naming the setting and both values, not a shape error on one rank and a closed
    connection on the others."""
    run_ranks(_disagreeing_ranks, 2)


class _PlainSDPAStage(torch.nn.Module):
    """A first stage that calls plain SDPA (not chunk-aware), and a head for the last."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16) if first else None
        self.out = torch.nn.Linear(16, 16 if first else 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is None:
            return self.out(x)
        h = self.emb(x).unsqueeze(1)
        return self.out(F.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1))


def _raised(fn, *args, **kwargs) -> tuple[BaseException, str]:
    """The error ``fn`` raises and its whole text (message, notes, chained causes)."""
    import traceback

    with pytest.raises(Exception) as info:  # each caller checks the text
        fn(*args, **kwargs)
    return info.value, "".join(traceback.format_exception(info.value))


def _failures_named_on_every_rank(rank: int, world: int) -> None:
    """Each mistake of the trial (issue 60) raises on both ranks, naming the failing rank and
    its cause; each case runs on a fresh pipeline group (a failed step leaves it unusable)."""
    import torch.distributed as dist

    cpu = torch.device("cpu")
    last = rank == world - 1
    x, y = data_case()

    def stage_of(mods: list, group: object) -> PipelineStage:
        return PipelineStage(mods[rank], rank, world, cpu, group=group)

    # 1. a direct F.scaled_dot_product_attention in the model: found in rank 0's forward
    group = dist.new_group(list(range(world)))
    stage = stage_of([_PlainSDPAStage(True), _PlainSDPAStage(False)], group)
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn)
    exc, text = _raised(sched.step, *((x,) if rank == 0 else ()), target=y if last else None)
    assert "scaled_dot_product_attention" in text and "pipeline rank 0 of 2" in text, text
    if rank:  # the peer: the failing rank's report, not gloo's closed connection alone
        assert isinstance(exc, RuntimeError) and "failed in ScheduleSeq1F1B.step()" in str(exc)
        assert "scaled_dot_product_attention" in str(exc)

    # 2. a loss_fn with the wrong signature: refused at construction, on every rank
    mods = build_stages(CFG, world)
    stage = stage_of(mods, dist.new_group(list(range(world))))
    with pytest.raises(TypeError, match=r"cannot be called as loss_fn\(output, target\)"):
        ScheduleSeq1F1B([stage], 2, 2, lambda logits: logits.sum())
    # ... or, with a parameter only step(loss_kwargs=...) could give, before any traffic
    sched = ScheduleSeq1F1B([stage], 2, 2, lambda out, tgt, *, scale: loss_fn(out, tgt) * scale)
    exc, text = _raised(sched.step, *((x,) if rank == 0 else ()), target=y if last else None)
    assert "pipeline rank 1" in text and "missing a required argument: 'scale'" in text, text

    # 3. the targets on rank 0 instead of the last rank: before any traffic, on both ranks
    sched = ScheduleSeq1F1B([stage], 2, 2, loss_fn)
    exc, text = _raised(sched.step, *((x,) if rank == 0 else ()), target=y if rank == 0 else None)
    assert "pipeline rank 1" in text and "loss_fn and target required for last stage" in text
    assert "Pipeline rank 0 got a target= but holds no last stage" in text, text
    # (the pre-flight's errors leave the schedule usable)
    sched.step(*((x,) if rank == 0 else ()), target=y if last else None)

    # 4. a sum loss under the default mean scaling: refused at the first step, on both ranks
    def summed(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), tgt.flatten(), reduction="sum")

    stage = stage_of(build_stages(CFG, world), dist.new_group(list(range(world))))
    sched = ScheduleSeq1F1B([stage], 2, 2, summed)
    exc, text = _raised(sched.step, *((x,) if rank == 0 else ()), target=y if last else None)
    assert "pipeline rank 1" in text and "loss_fn sums over tokens" in text, text
    assert "loss_reduction='sum'" in text, text
    with pytest.raises(ValueError, match="loss_fn sums over tokens"):  # said, so at once
        ScheduleSeq1F1B([stage], 2, 2, torch.nn.CrossEntropyLoss(reduction="sum"))

    # 5. loss_reduction="sum": the gradients of the sum over the step's tokens, exactly
    mods = build_stages(CFG, world)
    stage = stage_of(mods, dist.new_group(list(range(world))))
    sched = ScheduleSeq1F1B([stage], 2, 4, summed, seq_split=[9, 7, 5, 3], loss_reduction="sum")
    losses: list = []
    sched.step(*((x,) if rank == 0 else ()), target=y if last else None, losses=losses)
    ref = build_stages(CFG, world)
    full = x
    for mod in ref:
        full = mod(full)
    ref_loss = summed(full, y)
    ref_loss.backward()
    for (name, p), q in zip(mods[rank].named_parameters(), ref[rank].parameters(), strict=True):
        assert rel_err(p.grad, q.grad) <= 1e-5, name
    if last:
        assert abs(sum(v.item() for v in losses) - ref_loss.item()) <= 1e-5 * ref_loss.item()

    # 6. BitPipe: a loss that fails on rank 0 only names rank 0 on rank 1 too
    def fails_on_rank0(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        if rank == 0:
            raise RuntimeError("the loss failed on purpose")
        return loss_fn(out, tgt)

    group = dist.new_group(list(range(world)))
    stages, pair = build_bitpipe_stages(build_stages(CFG, 2 * world), cpu, group)
    bitpipe = ScheduleBitPipe(stages, 2, fails_on_rank0, pair_group=pair)
    exc, text = _raised(bitpipe.step, x[:2], target=y[:2])
    assert "pipeline rank 0 of 2" in text and "the loss failed on purpose" in text, text
    assert "ScheduleBitPipe.step()" in text, text


def test_failures_name_the_failing_rank_on_every_rank() -> None:
    """A direct SDPA call, a loss_fn of the wrong signature, the target on the wrong rank and a
    sum loss under mean scaling each fail both ranks, naming the failing rank and the cause;
    loss_reduction='sum' gives the gradients of the summed loss (issue 60)."""
    run_ranks(_failures_named_on_every_rank, 2)


@dataclass(frozen=True)
class _PrefixLM:
    """A prefix LM's mask: the first ``prefix`` positions see each other both ways (looks
    forward, so it cannot be cut into segments)."""

    prefix: int

    def __call__(self, b, h, q, k):
        return (k <= q) | ((q < self.prefix) & (k < self.prefix))


@dataclass(frozen=True)
class _NextKeyFrom:
    """Causal, except that queries from ``start`` on also see the next key."""

    start: int

    def __call__(self, b, h, q, k):
        return (k <= q) | ((q >= self.start) & (k == q + 1))


def _forward_looking_mask(rank: int, world: int) -> None:
    import torch.distributed as dist

    with pytest.raises(ValueError, match="mask_mod lets query 0 see key 1, a later position"):
        build_stages(replace(CFG, mask_mod=_PrefixLM(prefix=5)), world)
    # looking forward only far into the sequence: the first step that plans it fails, on
    # the rank that found it with its message, on the other naming that rank
    from equivalence import Case

    mods = build_stages(replace(CFG, mask_mod=_NextKeyFrom(start=300)), world)
    x, y = data(Case(1, 3, 2, seq_len=320, batch=2))
    group = dist.new_group(list(range(world)))  # a failed step leaves its group unusable
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"), group=group)
    sched = ScheduleSeq1F1B([stage], 2, 3, loss_fn)
    _, text = _raised(sched.step, *((x,) if rank == 0 else ()), target=y if rank else None)
    assert "mask_mod lets query 300 see key 301, a later position" in text or (
        rank == 1 and "pipeline rank 0 of 2 failed" in text), text  # fmt: skip


def test_a_forward_looking_mask_mod_fails_on_every_rank() -> None:
    """A mask_mod under which a query sees a later key (a bidirectional prefix) is refused on
    every rank when its layers are built, naming the first such pair (docs/masks.md); one
    that looks forward only beyond the positions checked then fails the first step that
    plans it, on every rank, not a hang on the rank waiting for the one that raised."""
    run_ranks(_forward_looking_mask, 2)
