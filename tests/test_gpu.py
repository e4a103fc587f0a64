"""GPU-only paths, run by scripts/gpu_check.sh on a lent GPU (skip without CUDA).

On CUDA: every attention path (torch's CUDA flash kernels, flash-attn where installed, masked
tiles and FlexAttention, packed documents, window + sinks, MLA's narrower value head) in bf16
against the float32 math reference, gradients included, segment by segment; FLA's
``chunk_gated_delta_rule`` with ``initial_state`` / ``output_final_state`` against the torch
kernel, two segments against one call; one rank with several stages (looped and V placements)
under Seq1F1B, ZBVSeq1F1B and torch's Interleaved1F1B, eager and compiled, exact against the
unpipelined model, with step times and ``torch.cuda.max_memory_allocated`` printed; a compiled
block's selective checkpointing; the unit context on autograd's CUDA worker thread.

``SEQ1F1B_GPU_REHEARSAL=1`` (scripts/gpu_check.sh's CPU rehearsal) runs the device-generic
ones on CPU at small sizes, so that the check cannot rot between lent GPUs; the CUDA-only ones
skip, saying why. The schedule tests need torch >= 2.13 (``PIPELINING_RUNTIME``); on older
torch (the lent machine's 2.11) they skip, saying so.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from equivalence import Case, data, loss_fn, rel_err
from torch.distributed.pipelining import PipelineStage

import seq1f1b
from seq1f1b import SegmentInfo, chunk_aware_attention
from seq1f1b._runtime import PIPELINING_RUNTIME
from seq1f1b.attention.kernels import block_attention_kernels
from seq1f1b.attention.kv import StageKVState, UnitContext, activate
from seq1f1b.attention.masks import document_runs
from seq1f1b.registry import lookup
from seq1f1b.schedules.partition import segment_offsets
from seq1f1b.testing import build_stages, full_model

CUDA = torch.cuda.is_available()
REHEARSAL = os.environ.get("SEQ1F1B_GPU_REHEARSAL") == "1"
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or REHEARSAL), reason="needs CUDA (or SEQ1F1B_GPU_REHEARSAL=1)"),
]
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA only: rehearsed on CPU as far as imports")
needs_runtime = pytest.mark.skipif(
    not PIPELINING_RUNTIME,
    reason=f"seq1f1b's schedules need torch >= 2.13 (this is {torch.__version__})",
)

# bf16 has an 8-bit mantissa (relative step 2^-8 = 3.9e-3); flash kernels accumulate in fp32,
# so a whole attention output stays within a few steps of the float32 result, and its
# gradients (sums over a sequence of bf16 products) within a few times that
BF16_TOL = 2e-2
BF16_GRAD_TOL = 5 * BF16_TOL


def _report(line: str) -> None:
    """One result line (scripts/gpu_check.sh runs pytest with -s and collects them)."""
    print(f"gpu_check: {line}", flush=True)


# ------------------------------------------------------------------------------ attention
# (batch, heads, kv heads, sequence, q/k head dim, v head dim, segment lengths) per device
_SHAPE = {
    "cuda": (2, 8, 2, 2048, 128, (384, 640, 1024)),
    "cpu": (2, 4, 2, 96, 32, (24, 40, 32)),
}


def _documents(batch: int, seq: int) -> torch.Tensor:
    """Packed document ids: sample 0 has documents crossing segment boundaries, sample 1 short
    ones and one on a boundary."""
    first = [0] * (seq // 5) + [1] * (seq // 2) + [2] * (seq - seq // 5 - seq // 2)
    second = [i // max(seq // 12, 1) for i in range(seq)]
    return torch.tensor([first, second][:batch]).expand(batch, seq)


def _visible(seq: int, docs: torch.Tensor | None, window: int | None, sinks: int, dev: str):
    """Dense (batch or 1, 1, S, S) visibility: causal, same document, window / sinks."""
    i = torch.arange(seq, device=dev)[:, None]
    j = torch.arange(seq, device=dev)[None]
    vis = j <= i
    if window is not None:
        vis = vis & ((i - j < window) | (j < sinks))
    vis = vis[None]
    if docs is not None:
        d = docs.to(dev)
        vis = vis & (d[:, :, None] == d[:, None, :])
    return vis[:, None]


def _math_reference(q, k, v, vis, scale: float) -> torch.Tensor:
    """float32 softmax attention with a dense mask (grouped-query K/V repeated)."""
    n_rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ vv


def _segmented(q, k, v, lengths, docs, window, sinks, backend: str) -> torch.Tensor:
    """Forward 0..K-1, then backward K-1..0, as the schedule runs one sample's segments;
    gradients land in q, k, v. Returns the output."""
    seq = sum(lengths)
    state = StageKVState(0, len(lengths))
    starts = segment_offsets(lengths)
    groups = None if docs is None else document_runs(docs)
    infos = [
        SegmentInfo(0, s, len(lengths), a, n, seq, (*starts, seq), groups)
        for s, (a, n) in enumerate(zip(starts, lengths, strict=True))
    ]
    kw = {"window": window, "sinks": sinks, "mask_backend": backend}
    outs = []
    for info in infos:
        a, e = info.start, info.end
        state.begin_forward(0, info.segment)
        with activate(UnitContext(state, info, "forward", True)):
            outs.append(
                chunk_aware_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], layer="l", **kw)
            )
        state.end_forward(0, info.segment, keep=True)
    out = torch.cat(outs, 2)
    go = _grad_out(out)
    for info in reversed(infos):
        state.begin_backward(0, info.segment)
        with activate(UnitContext(state, info, "backward", True)):
            torch.autograd.backward(outs[info.segment], go[:, :, info.start : info.end])
        state.end_backward(0, info.segment)
    assert state.is_empty()
    return out.detach()


def _grad_out(out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator(device=out.device).manual_seed(7)
    return torch.randn(out.shape, device=out.device, generator=g).to(out.dtype)


# path: (documents, window, sinks, v head dim differs, mask backends)
_PATHS = {
    "causal": (False, None, 0, False, ("tiles",)),
    "documents": (True, None, 0, False, ("tiles", "flex")),
    "window_sinks": (False, 1 / 3, 4, False, ("tiles", "flex")),
    "documents_window": (True, 1 / 4, 0, False, ("tiles",)),
    "mla_value_head": (False, None, 0, True, ("tiles",)),
}
_CASES = [
    (path, backend, split)
    for path, (*_, backends) in _PATHS.items()
    for backend in backends
    for split in ("whole", "segments")
]


@pytest.mark.parametrize(("path", "backend", "split"), _CASES)
def test_attention_path_bf16_matches_float32_math(path: str, backend: str, split: str) -> None:
    """Each attention path in bf16, one segment or several (the cached prefix merged by LSE),
    against the float32 math reference with the same mask: output and dq, dk, dv."""
    if backend == "flex" and not CUDA:
        pytest.skip("flex on CPU is forward-only eager (tests/test_masks.py covers it)")
    docs_on, window_frac, sinks, mla, _ = _PATHS[path]
    b, h, hkv, seq, d, lengths = _SHAPE[DEVICE]
    dv = d * 2 // 3 if mla else d  # MLA: values narrower than queries and keys (128 vs 192)
    dqk = d * 3 // 2 if mla else d
    window = None if window_frac is None else int(seq * window_frac) + 1
    docs = _documents(b, seq) if docs_on else None
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q32 = torch.randn(b, h, seq, dqk, device=DEVICE, generator=g)
    k32 = torch.randn(b, hkv, seq, dqk, device=DEVICE, generator=g)
    v32 = torch.randn(b, hkv, seq, dv, device=DEVICE, generator=g)
    scale = 1 / math.sqrt(dqk)
    ref_in = [t.clone().requires_grad_() for t in (q32, k32, v32)]
    ref = _math_reference(*ref_in, _visible(seq, docs, window, sinks, DEVICE), scale)
    ref.backward(_grad_out(ref.bfloat16()).float())
    bf = [t.bfloat16().requires_grad_() for t in (q32, k32, v32)]
    out = _segmented(*bf, [seq] if split == "whole" else list(lengths), docs, window, sinks,
                     backend)  # fmt: skip
    errs = [rel_err(out.float(), ref.detach())]
    errs += [rel_err(t.grad.float(), r.grad) for t, r in zip(bf, ref_in, strict=True)]
    kernels = block_attention_kernels(bf[0])[0]
    _report(
        f"attention {path:<17} {backend:<5} {split:<8} {DEVICE} bf16 ({kernels}): rel err out "
        + " ".join(f"{e:.1e}" for e in errs[:1])
        + " dq dk dv "
        + " ".join(f"{e:.1e}" for e in errs[1:])
    )
    assert errs[0] <= BF16_TOL, errs
    assert max(errs[1:]) <= BF16_GRAD_TOL, errs


def test_flash_attn_kernels_when_installed() -> None:
    """flash-attn's block kernels (picked over torch's when installed) on a causal segment
    pair; skipped where flash-attn is absent (no binary wheel travels to the lent machine)."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (PyPI has no binary wheel; source build only)")
    test_attention_path_bf16_matches_float32_math("causal", "tiles", "segments")


@needs_cuda
def test_compiled_block_attention_bf16() -> None:
    """The attention module under torch.compile (the library's custom op) in bf16 equals the
    float32 math reference, gradients included."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", generator=g) for _ in range(3))
    layer = torch.compile(seq1f1b.ChunkAwareAttention().cuda(), fullgraph=True)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _math_reference(qr, kr, vr, _visible(256, None, None, 0, "cuda"), 64**-0.5)
    ref.square().sum().backward()
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = layer(qb, kb, vb)
    out.float().square().sum().backward()
    assert rel_err(out.float(), ref.detach()) <= BF16_TOL
    for got, want in ((qb, qr), (kb, kr), (vb, vr)):
        assert rel_err(got.grad.float(), want.grad) <= BF16_GRAD_TOL


# -------------------------------------------------------------------------- Gated DeltaNet
def test_fla_kernels_import() -> None:
    """fla-core (carried as a wheel) imports on this torch and triton: on CPU this is all the
    rehearsal can check of it."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    assert callable(chunk_gated_delta_rule)


@needs_cuda
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

    def grads(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        out, final = fn()
        loss = (out * w).sum() + final.square().sum()
        return [out.detach(), final.detach(), *torch.autograd.grad(loss, inputs)]

    def whole(backend: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        return lambda: gated_delta_rule(*inputs, backend=backend)

    def segments() -> tuple[torch.Tensor, torch.Tensor]:
        a, sa = gated_delta_rule(*(t[:, :96] for t in inputs[:5]), s0, backend="fla")
        c, sc = gated_delta_rule(*(t[:, 96:] for t in inputs[:5]), sa, backend="fla")
        return torch.cat([a, c], 1), sc

    ref = grads(whole("torch"))
    for name, got in (("one call", grads(whole("fla"))), ("two segments", grads(segments()))):
        errs = [rel_err(a.float(), r.float()) for a, r in zip(got, ref, strict=True)]
        _report(
            f"fla chunk_gated_delta_rule {name}: max rel err {max(errs):.1e} (out, state, 6 grads)"
        )
        assert max(errs) <= 1e-3, errs


# ------------------------------------------------------------- several stages on one rank
#: (registry name, stages per rank, seq_chunks): looped, V and torch's interleaved baseline
STEP_SCHEDULES = (("Seq1F1B", 2, 4), ("ZBVSeq1F1B", 2, 4), ("Interleaved1F1B", 2, 1))


def _step_case() -> Case:
    return Case(2, 4, 2, seq_len=256 if CUDA else 32, batch=4, checkpointing=True)


def _build(name: str, spr: int, k: int, dev: torch.device, compiled: bool) -> tuple[Any, list]:
    entry = lookup(name)
    case = _step_case()
    n = entry.model_stages(1, spr)
    mods = [m.to(dev) for m in build_stages(case.cfg, n, checkpointing=True)]
    if compiled:
        for mod in mods:
            for block in mod.layers:
                block.compile(fullgraph=True)
    mine = entry.stages_of(1, 0, spr)
    stages = [PipelineStage(mods[s], s, n, dev) for s in mine]
    cls = entry.schedule_class()
    m = case.n_microbatches
    sched = cls(stages, m, k, loss_fn) if entry.seq_chunked else cls(stages, m, loss_fn=loss_fn)
    return sched, mods


def _one_rank_steps(rank: int, world: int, compiled: bool, out_path: str | None,
                    predicted: dict[str, int] | None = None) -> None:  # fmt: skip
    """Each schedule: one step checked against the unpipelined model (loss and every gradient),
    then timed steps; prints step time, its ratio to Interleaved1F1B and the peak memory."""
    dev = torch.device(DEVICE)
    case = _step_case()
    x, y = (t.to(dev) for t in data(case))
    rows = []
    for name, spr, k in STEP_SCHEDULES:
        sched, mods = _build(name, spr, k, dev, compiled)
        ref = [m.to(dev) for m in build_stages(case.cfg, len(mods), checkpointing=True)]
        ref_loss = loss_fn(full_model(ref)(x), y)
        ref_loss.backward()
        losses: list[torch.Tensor] = []
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        sched.step(x, target=y, losses=losses)
        peak = torch.cuda.max_memory_allocated() if CUDA else 0
        loss = torch.stack(losses).mean().item()
        assert abs(loss - ref_loss.item()) <= 1e-4 * ref_loss.item(), (name, loss, ref_loss)
        for a, b in zip(mods, ref, strict=True):
            for (pname, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
                assert rel_err(p.grad, q.grad) <= 1e-4, (name, pname)
        times = []
        for _ in range(3 if CUDA else 1):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            if CUDA:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sched.step(x, target=y)
            if CUDA:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rows.append((name, spr, k, sorted(times)[len(times) // 2], peak))
    base = rows[-1][3]
    mode = "compiled" if compiled else "eager"
    lines = [
        f"one rank, {DEVICE}, {mode}: schedule, stages/rank, K, step s, / Interleaved1F1B, peak MiB"
    ]
    lines += [f"  {n:<16} {s} {k} {t:.4f} {t / base:.2f} {p / 2**20:.1f}" for n, s, k, t, p in rows]
    lines.append("  dry run: " + _dry_run_comparison(rows, predicted))
    for line in lines:
        _report(line)
    if out_path:
        with open(out_path, "a") as f:
            f.write("\n".join(lines) + "\n")


def _dry_run_comparison(rows: list[tuple[str, int, int, float, int]],
                        predicted: dict[str, int] | None) -> str:  # fmt: skip
    """The measured peaks beside the dry run's for the same step (``predicted``: made before
    the process group, :func:`_dry_run_peaks`; None where this torch cannot dry-run)."""
    if predicted is None:
        return f"not run (the dry run needs torch >= 2.15; this is {torch.__version__})"
    return "; ".join(f"{n} measured {p / 2**20:.1f} MiB (the reference model's weights and "
                     f"gradients too), dry run " + (f"{predicted[n] / 2**20:.1f} MiB"
                                                    if n in predicted else "n/a (split backward)")
                     for n, _s, _k, _t, p in rows)  # fmt: skip


def _dry_run_peaks() -> dict[str, int] | None:
    """Each timed schedule's step dry-run on this rank (seq1f1b.planning.dryrun, fake tensors
    and the fake process group), as the GPU runs it: peak bytes by schedule name."""
    from seq1f1b._runtime import HAS_WARMUP_P2P
    from seq1f1b.planning.dryrun import RankStep, dry_run_rank, static_stage

    if HAS_WARMUP_P2P:
        return None
    case = _step_case()
    out = {}
    for name, spr, k in STEP_SCHEDULES:
        entry = lookup(name)

        def build(rank: int, entry: Any = entry, spr: int = spr, k: int = k) -> RankStep:
            n = entry.model_stages(1, spr)
            mods = build_stages(case.cfg, n, checkpointing=True)
            seq, m = case.seq_len, case.n_microbatches
            unit = seq // k if entry.seq_chunked else seq
            example = torch.zeros(case.batch // m, seq, dtype=torch.long)[:, :unit]
            stages = []
            for s in range(n):  # one rank: every stage, each fed the one before
                stage, example = static_stage(mods[s], s, n, example)
                stages.append(stage)
            cls = entry.schedule_class()
            sched = cls(stages, m, k, loss_fn) if entry.seq_chunked else cls(stages, m,
                                                                             loss_fn=loss_fn)
            x, y = data(case)
            return RankStep(sched, stages, mods, None, (x,), y, seq_len=seq)

        if not entry.split_backward:  # the dry run runs whole backwards only (for now)
            out[name] = dry_run_rank(build, 0, 1).peak.total
    return out


@needs_runtime
@pytest.mark.parametrize("compiled", [False, True])
def test_stages_on_one_rank_exact_and_timed(compiled: bool) -> None:
    """One rank, two stages per rank: Seq1F1B (looped), ZBVSeq1F1B (V) and torch's
    Interleaved1F1B, eager and compiled, loss and gradients exact against the unpipelined
    model; step times (ratio to Interleaved1F1B) and peak memory printed."""
    from dist_utils import run_ranks

    predicted = _dry_run_peaks()  # here, before any process group (the dry run makes its own)
    run_ranks(_one_rank_steps, 1, compiled, os.environ.get("SEQ1F1B_GPU_NUMBERS"), predicted,
              fresh=True)  # fmt: skip


# --------------------------------------------------------------------- autograd on CUDA
@needs_cuda
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


@needs_cuda
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
