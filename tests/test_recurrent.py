"""Carried (recurrent) state: the gated delta rule and the short convolution with an initial
and a final state equal the sequence in one call (fp32, values and every gradient), packed
documents restart them, a recurrent layer whose state is not carried fails the first step
instead of training silently wrong, and under context parallelism the state passes over the
CP ranks (a scan of affine maps) exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from equivalence import Case, run_case, run_eval_case
from torch.distributed.pipelining import PipelineStage

from seq1f1b import ChunkAwareGatedDeltaNet, ScheduleSeq1F1B
from seq1f1b.attention.carried import Piece, document_pieces
from seq1f1b.attention.causal_conv import causal_conv1d, tail_transition
from seq1f1b.attention.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    gated_delta_rule_affine,
    gated_delta_rule_pieces,
    recurrent_gated_delta_rule,
)
from seq1f1b.attention.masks import document_runs
from seq1f1b.attention.mixing_probe import PositionMixingError
from seq1f1b.schedules.output_check import OutputMismatchError
from seq1f1b.testing import TinyConfig, build_stages

B, L, H, DK, DV = 2, 37, 3, 8, 6


def _inputs(
    seed: int = 0, dtype: torch.dtype = torch.float32, strength: float = 2.0
) -> list[torch.Tensor]:
    """q, k, v, log decays in ``[-strength, 0]``, write strengths, an initial state."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, L, H, DK, generator=g), torch.randn(B, L, H, DK, generator=g)
    v = torch.randn(B, L, H, DV, generator=g)
    decay = -strength * torch.rand(B, L, H, generator=g)
    beta = torch.rand(B, L, H, generator=g)
    s0 = torch.randn(B, H, DK, DV, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, decay, beta, s0)]


def _grads(outs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in outs)
    return list(torch.autograd.grad(loss, inputs))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol, err


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_chunked_delta_rule_equals_the_recurrence(chunk: int) -> None:
    """The chunked form (whole chunks, a ragged last one, one chunk) equals the step-by-step
    definition: output, final state and the gradient of every input, the initial state's
    included."""
    inputs = _inputs()
    ref = recurrent_gated_delta_rule(*inputs)
    out = chunk_gated_delta_rule(*inputs, chunk=chunk)
    for a, b in zip(out, ref, strict=True):
        _close(a, b)
    for a, b in zip(_grads(out, inputs), _grads(ref, inputs), strict=True):
        _close(a, b)


@pytest.mark.fast
@pytest.mark.parametrize("with_state", [True, False])
def test_the_opaque_op_equals_the_chunks_and_is_what_a_dry_run_takes(with_state: bool) -> None:
    """``backend="op"`` (one custom op pair, inputs kept, the rest recomputed) equals the
    pure-torch chunks: outputs, final state, every gradient (the initial state's when there
    is one). Over fake tensors ``"auto"`` takes it: a handful of ops, not the chunks' hundreds,
    shapes and dtypes as the chunks give them, and FLOPs counted by torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from seq1f1b import _runtime as rt

    *qkvgb, s0 = inputs = _inputs()
    init = s0 if with_state else None
    every = inputs if with_state else qkvgb
    ref = chunk_gated_delta_rule(*qkvgb, init)
    got = gated_delta_rule(*qkvgb, init, backend="op")
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype
        _close(a, b)
    for a, b in zip(_grads(got, every), _grads(ref, every), strict=True):
        _close(a, b)

    class Count(rt.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.namespace != "prim":  # ``t.device`` reads
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    plain = [t.detach() for t in every]
    with rt.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t).requires_grad_() for t in plain]
        count, flops = Count(), FlopCounterMode(display=False)
        with count, flops:
            out, final = gated_delta_rule(*fake[:5], fake[5] if with_state else None)
            (out.sum() + final.sum()).backward()
    assert "seq1f1b.gated_delta_rule.default" in count.ops
    assert "seq1f1b.gated_delta_rule_backward.default" in count.ops
    assert len(count.ops) < 20, count.ops
    assert (out.shape, out.dtype, final.shape, final.dtype) == (
        ref[0].shape, ref[0].dtype, ref[1].shape, ref[1].dtype,
    )  # fmt: skip
    assert all(t.grad is not None and t.grad.shape == t.shape for t in fake)
    # forward plus a backward of twice its FLOPs: 3x the forward's count
    forward = B * H * L * (4 * L * DK + 3 * L * DV + 6 * DK * DV)
    assert flops.get_total_flops() == 3 * forward


@pytest.mark.fast
@pytest.mark.parametrize(
    ("dtype", "strength", "tol"), [(torch.float32, 2.0, 1e-5), (torch.float64, 25.0, 1e-12)]
)
def test_segments_carrying_state_equal_one_call(
    dtype: torch.dtype, strength: float, tol: float
) -> None:
    """Three segments (2, 22 and 13 positions: one shorter than the convolution), each
    starting from the state and convolution tail the previous one ended with, equal the
    sequence in one call: outputs, the final state and every gradient; in fp64 with decays as
    strong as Qwen3.5's (A up to 16) to 1e-12, so the fp32 differences are rounding only."""
    q, k, v, decay, beta, s0 = inputs = _inputs(dtype=dtype, strength=strength)
    x = torch.randn(B, L, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 1, 4, dtype=dtype, requires_grad=True)
    ref = (*chunk_gated_delta_rule(q, k, v, decay, beta, s0), *causal_conv1d(x, w, None))
    outs, convs, state, tail = [], [], s0, None
    for a, b in ((0, 2), (2, 24), (24, L)):
        whole = [Piece(0, B, 0, b - a, a > 0)]
        o, state = gated_delta_rule_pieces(
            q[:, a:b], k[:, a:b], v[:, a:b], decay[:, a:b], beta[:, a:b], state,
            [Piece(0, B, 0, b - a, True)],
        )  # fmt: skip
        y, tail = causal_conv1d(x[:, a:b], w, tail, whole)
        outs.append(o)
        convs.append(y)
    got = (torch.cat(outs, 1), state, torch.cat(convs, 1), tail)
    for a, b in zip(got, ref, strict=True):
        _close(a, b, tol)
    every = [*inputs, x, w]
    for a, b in zip(_grads(got, every), _grads(ref, every), strict=True):
        _close(a, b, tol)


@pytest.mark.fast
def test_documents_restart_the_state_and_the_convolution() -> None:
    """Packed rows: each document of a segment starts from zeros unless it began in an
    earlier segment, where it continues the carried state; equal to running each document
    alone."""
    ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 12, [0] * 30 + [1] * 7])
    groups = document_runs(ids)
    q, k, v, decay, beta, _ = _inputs()
    x, w = torch.randn(B, L, 5), torch.randn(5, 1, 4)
    ref_out, ref_conv = torch.zeros(B, L, H, DV), torch.zeros(B, L, 5)
    for row in range(B):
        for a, b in document_runs(ids[row : row + 1])[0][2]:
            sl = (slice(row, row + 1), slice(a, b))
            ref_out[sl] = chunk_gated_delta_rule(q[sl], k[sl], v[sl], decay[sl], beta[sl])[0]
            ref_conv[sl] = causal_conv1d(x[sl], w, None)[0]
    outs, convs, state, tail = [], [], None, None
    for a, b in ((0, 10), (10, 25), (25, L)):  # a document starts at position 25 of row 0
        pieces = document_pieces(groups, a, b)
        assert any(p.a == 0 and not p.continues for p in pieces) == (a in (0, 25))
        o, state = gated_delta_rule_pieces(
            q[:, a:b], k[:, a:b], v[:, a:b], decay[:, a:b], beta[:, a:b], state, pieces
        )
        y, tail = causal_conv1d(x[:, a:b], w, tail, pieces)
        outs.append(o)
        convs.append(y)
    _close(torch.cat(outs, 1), ref_out)
    _close(torch.cat(convs, 1), ref_conv)


class ForgetfulGatedDeltaNet(ChunkAwareGatedDeltaNet):
    """Gated DeltaNet that restarts every segment from zeros (a layer not made chunk-aware)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        n_k, dk, n_v, dv = self.head_dims
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        mixed, _ = causal_conv1d(self.in_proj_qkv(x), self.conv.weight, None)
        q, k, v = mixed.split((n_k * dk, n_k * dk, n_v * dv), dim=-1)
        rep = n_v // n_k
        q = q.view(b, n, n_k, dk).repeat_interleave(rep, 2)
        k = k.view(b, n, n_k, dk).repeat_interleave(rep, 2)
        out, _ = chunk_gated_delta_rule(q, k, v.view(b, n, n_v, dv), g, self.in_proj_b(x).sigmoid())
        out = self.norm(out) * F.silu(self.in_proj_z(x).view(b, n, n_v, dv))
        return self.out_proj(out.reshape(b, n, n_v * dv))


def _forgetful(rank: int, world: int) -> None:
    cfg = TinyConfig(n_layers=4, full_attention_every=2)  # GDN, attention, GDN, attention
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.vocab, (2, 17), generator=g)
    x, y = t[:, :-1], t[:, 1:]

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    def step(num_stages: int) -> None:
        mods = build_stages(cfg, num_stages)
        for m in mods:
            for block in m.layers:
                if block.delta_net is not None:
                    block.delta_net.__class__ = ForgetfulGatedDeltaNet
        stages = [PipelineStage(m, i, num_stages, torch.device("cpu")) for i, m in enumerate(mods)]
        ScheduleSeq1F1B(stages, 2, 2, loss).step(x, target=y)

    # a stage of recurrent layers only: the mixing probe names the forgotten state
    with pytest.raises(PositionMixingError, match="a recurrent layer whose state is not carried"):
        step(4)
    # beside attention: the output check, naming the zero state
    with pytest.raises(OutputMismatchError, match="restarts each segment from a zero state"):
        step(2)


def test_a_state_not_carried_fails_the_first_step() -> None:
    run_ranks(_forgetful, 1)


def _eval_hybrid(rank: int, world: int) -> None:
    run_eval_case(rank, world, Case(1, 4, 2, hybrid=True))
    run_eval_case(rank, world, Case(2, 3, 2, docs=True, hybrid=True, split=(2, 12, 10)))


def test_eval_with_recurrent_state_matches_reference() -> None:
    """eval() (forward only): the carried state flows forward without gradients and is gone
    after the step."""
    run_ranks(_eval_hybrid, 2)


@pytest.mark.fast
def test_kept_state_is_a_copy() -> None:
    """What a segment keeps for the next one is a copy: the convolution tail is a view of the
    layer's input, and a compiled graph reuses that buffer once the op returns (under
    compile(checkpoint_wrapper(block)) the next segment read overwritten values)."""
    from seq1f1b.attention.carried import carried_state
    from seq1f1b.attention.kv import SegmentInfo, StageKVState, UnitContext, activate

    state = StageKVState(0, 2)
    info = SegmentInfo(0, 0, 2, 0, 8, 16, (0, 8, 16))
    x = torch.randn(2, 8, 5)
    tail = x[:, -3:]
    with activate(UnitContext(state, info, "forward", True)):
        carried_state("layer").keep(x, tail)
    kept = state.layer_entries(0, ("carried", "layer"))[0].tensors[0]
    assert kept.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    before = kept.clone()
    x.zero_()
    assert torch.equal(kept, before) and kept.requires_grad


@pytest.mark.fast
def test_a_run_is_an_affine_map_of_its_start() -> None:
    """What the CP scan composes: a run of the delta rule from an unknown start state is
    ``o0 + qp S`` and ``trans S + add``, and a run's convolution tail ``M tail + E``; equal to
    running from ``S`` (and the tail) directly, with a document start inside the run (its
    rows' later pieces, and their final state, do not depend on the start) and tails longer
    than a row's last piece."""
    q, k, v, decay, beta, s0 = (t.detach() for t in _inputs())
    ids = torch.tensor([[0] * 20 + [1] * 17, [0] * 36 + [1]])
    for pieces in ((Piece(0, B, 0, L, True),), document_pieces(document_runs(ids), 0, L)):
        pieces = tuple(Piece(p.r0, p.r1, p.a, p.b, p.a == 0) for p in pieces)  # all continue
        want_out, want_final = gated_delta_rule_pieces(q, k, v, decay, beta, s0, pieces)
        o0, qp, trans, add = gated_delta_rule_affine(q, k, v, decay, beta, pieces)
        _close(o0 + torch.einsum("blhk,bhkv->blhv", qp, s0), want_out)
        _close(trans @ s0 + add, want_final)
        x, w, tail = torch.randn(B, L, 5), torch.randn(5, 1, 4), torch.randn(B, 3, 5)
        for n in (L, 2, 1):  # runs shorter than the tail keep part of the one they start from
            run = tuple(Piece(p.r0, p.r1, 0, n, True) for p in pieces if p.a == 0)
            m, e = tail_transition(x[:, :n], run, 4)
            _close(m @ tail + e, causal_conv1d(x[:, :n], w, tail, run)[1])


@contextlib.contextmanager
def _float64() -> Iterator[None]:
    """Models built (and run) in fp64, on a long-lived rank: restored after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


#: Qwen3.5-style stacks (three Gated DeltaNet layers, then attention) under context
#: parallelism, by world: 2 ranks are cp = 2 alone; 4 are pp = 2 x cp = 2 and cp = 4. At 32
#: tokens with K >= 2 a CP rank's chunk (2 or 4 tokens) can be shorter than the convolution's
#: tail of 3, which then spans several runs and ranks; packed documents move the CP layout
#: off the head-tail one and reset the state inside runs
CP_HYBRID = {
    2: (
        Case(1, 3, 2, cp=2, seq_len=32, batch=4, hybrid=True, split=(12, 8, 12), docs=True),
        Case(1, 2, 2, cp=2, seq_len=32, batch=4, hybrid=True, checkpointing=True,
             schedule="ZBSeq1F1B"),
        Case(2, 2, 2, cp=2, seq_len=32, batch=4, hybrid=True, docs=True,
             schedule="InterleavedSeq1F1B"),
    ),
    4: (
        Case(1, 4, 2, cp=2, seq_len=32, batch=4, hybrid=True, docs=True, schedule="ZBSeq1F1B"),
        Case(1, 2, 2, cp=4, seq_len=32, batch=4, hybrid=True, docs=True, checkpointing=True),
    ),
}  # fmt: skip


def _cp_hybrid(rank: int, world: int) -> None:
    if world == 2:  # eval's forward, fp32 (logits and losses to 1e-5)
        run_eval_case(rank, world, Case(1, 4, 2, cp=2, seq_len=32, hybrid=True, docs=True))
    # the gradients in fp64: fp32's rounding in this small stack reaches 1e-5 without CP
    # already (the hybrid grid's K = 4 case), a rounding of the scan's sums more or less
    # crosses it either way
    with _float64():
        for case in CP_HYBRID[world]:
            run_case(rank, world, case, tol=1e-9)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.default_release_only)])
def test_recurrent_state_with_context_parallel_matches_reference(world: int) -> None:
    """Gated DeltaNet's state and convolution tail passed from CP rank to CP rank within each
    segment and from segment to segment, their gradients in reverse, equal the unsegmented
    model in one process (loss and every parameter gradient, in fp64 to 1e-9; eval's logits in
    fp32): Seq1F1B,
    InterleavedSeq1F1B (stages of Gated DeltaNet layers only) and ZBSeq1F1B (the scan's
    gradient in the input half), uneven splits, checkpointing (the scan recomputed), packed
    documents; 4 ranks: PP 2 x CP 2 and a ring of 4."""
    run_ranks(_cp_hybrid, world)
