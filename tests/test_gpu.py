"""GPU-only paths (skip without CUDA; scripts/gpu_check.sh runs them on a lent GPU): the CUDA
block kernels in bf16 against the float32 math reference, a compiled block, Seq1F1B with
several stages on one rank on CUDA tensors against the unpipelined model, and selective
checkpointing keeping the compiled attention on CUDA."""

from __future__ import annotations

import pytest
import torch
from equivalence import Case, data, loss_fn, rel_err
from torch.distributed.pipelining import PipelineStage

import seq1f1b
from seq1f1b.registry import lookup
from seq1f1b.testing import build_stages, full_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# bf16 has an 8-bit mantissa (relative step 2^-8 = 3.9e-3); flash kernels accumulate in fp32,
# so a whole attention output stays within a few steps of the float32 result
BF16_TOL = 2e-2


def test_cuda_attention_bf16_matches_float32_math() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", generator=g) for _ in range(3))
    layer = seq1f1b.ChunkAwareAttention().cuda()
    ref = layer(q.double(), k.double(), v.double()).float()
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = layer(qb, kb, vb)
    assert rel_err(out.float(), ref) <= BF16_TOL
    out.float().square().sum().backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    layer(qr, kr, vr).square().sum().backward()
    for got, want in ((qb, qr), (kb, kr), (vb, vr)):
        assert rel_err(got.grad.float(), want.grad.float()) <= 5 * BF16_TOL


def _seq1f1b_on_cuda(rank: int, world: int, compiled: bool) -> None:
    case = Case(2, 4, 2, seq_len=64, batch=4, checkpointing=True)
    dev = torch.device("cuda")
    ref_mods = [m.to(dev) for m in build_stages(case.cfg, 2, checkpointing=True)]
    x, y = (t.to(dev) for t in data(case))
    ref_loss = loss_fn(full_model(ref_mods)(x), y)
    ref_loss.backward()
    mods = [m.to(dev) for m in build_stages(case.cfg, 2, checkpointing=True)]
    if compiled:
        for mod in mods:
            for block in mod.layers:
                block.compile(fullgraph=True)
    stages = [PipelineStage(mods[s], s, 2, dev) for s in range(2)]
    sched = lookup("Seq1F1B").schedule_class()(stages, 2, 4, loss_fn)
    losses: list[torch.Tensor] = []
    sched.step(x, target=y, losses=losses)
    assert abs(torch.stack(losses).mean().item() - ref_loss.item()) <= 1e-4 * ref_loss.item()
    for a, b in zip(mods, ref_mods, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert rel_err(p.grad, q.grad) <= 1e-4, name


@pytest.mark.parametrize("compiled", [False, True])
def test_seq1f1b_stages_on_one_cuda_rank(compiled: bool) -> None:
    from dist_utils import run_ranks

    run_ranks(_seq1f1b_on_cuda, 1, compiled, fresh=True)


def test_checkpoint_recomputation_on_a_cuda_worker_thread_sees_the_unit() -> None:
    """Autograd runs a CUDA graph's backward, and checkpoint recomputation, on its device
    worker thread: the unit context must be seen there (``AutogradContextVar``)."""
    import threading

    from torch.utils.checkpoint import checkpoint

    from seq1f1b.attention import kv

    seen: list[tuple[bool, kv.UnitContext | None]] = []
    caller = threading.get_ident()

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append((threading.get_ident() != caller, kv.current_unit()))
        return x.sin()

    state = kv.StageKVState(0, 1)
    unit = kv.UnitContext(state, kv.SegmentInfo(0, 0, 1, 0, 4, 4, (0, 4)), "backward", True)
    x = torch.ones(4, device="cuda", requires_grad=True)
    with kv.activate(unit):
        checkpoint(block, x, use_reentrant=False).sum().backward()
    assert [s[1] is unit for s in seen] == [True, True], seen  # forward, then recomputation
    assert seen[1][0], "recomputation ran on the calling thread: the test proves nothing here"


def test_selective_checkpointing_saves_the_compiled_attention_on_cuda() -> None:
    """On CUDA in bf16 (the compiled attention running torch's or flash-attn's kernels): with
    :func:`seq1f1b.checkpoint_save_ops` on the policy's list the backward runs no attention
    forward; without, it runs it again (tests/test_compile.py has the CPU case)."""
    from compile_worker import attention_ops_in_backward

    ops = seq1f1b.checkpoint_save_ops()
    forwards, backwards, grad = attention_ops_in_backward(ops, "cuda", torch.bfloat16)
    assert forwards == 0 and backwards > 0
    again, _, recomputed = attention_ops_in_backward(set(), "cuda", torch.bfloat16)
    assert again > 0
    assert rel_err(grad.float(), recomputed.float()) <= BF16_TOL


def test_fla_gated_delta_rule_with_state_matches_torch() -> None:
    """FLA's chunked gated delta rule with ``initial_state`` / ``output_final_state`` (what
    the Gated DeltaNet layers run on CUDA) equals the pure-torch chunked form, fp32, and a
    sequence run as two segments carrying the state equals one call: outputs, final state
    and every gradient."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from seq1f1b.attention.gated_delta import gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, h, dk, dv = 2, 256, 4, 64, 64
    q, k = (torch.randn(b, n, h, dk, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(b, n, h, dv, device="cuda", generator=g)
    decay = -torch.rand(b, n, h, device="cuda", generator=g)
    beta = torch.rand(b, n, h, device="cuda", generator=g)
    s0 = torch.randn(b, h, dk, dv, device="cuda", generator=g)
    inputs = [t.requires_grad_() for t in (q, k, v, decay, beta, s0)]
    w = torch.randn(b, n, h, dv, device="cuda", generator=g)

    def grads(fn) -> list[torch.Tensor]:
        out, final = fn()
        loss = (out * w).sum() + final.square().sum()
        return [out.detach(), final.detach(), *torch.autograd.grad(loss, inputs)]

    def whole(backend: str):
        return lambda: gated_delta_rule(*inputs, backend=backend)

    def segments():
        a, sa = gated_delta_rule(*(t[:, :96] for t in inputs[:5]), s0, backend="fla")
        c, sc = gated_delta_rule(*(t[:, 96:] for t in inputs[:5]), sa, backend="fla")
        return torch.cat([a, c], 1), sc

    ref = grads(whole("torch"))
    for got in (grads(whole("fla")), grads(segments())):
        for a, r in zip(got, ref, strict=True):
            assert rel_err(a.float(), r.float()) <= 1e-3
