"""torch.compile under the Seq1F1B schedules: blocks compiled as torchtitan compiles them
(``fullgraph=True``) are exact against the eager full-sequence run, with checkpointing and
packed documents, over steps of different lengths and K, and compile a bounded number of
graphs; zero-bubble orders run compiled backwards whole (with donated buffers on); CPU
inductor (gcc). Few and small: compiling is slow on 2 cores."""

from __future__ import annotations

import json

import pytest
import torch
from compile_worker import (
    CP_CASES,
    attention_ops_in_backward,
    compiled_cp_schedule_steps,
    compiled_schedule_steps,
    fsdp_wider_grads_through_a_recompile,
    refuses_compiled_on_some_ranks_only,
)
from dist_utils import run_ranks
from test_attention import _sinks_on_the_ring

import seq1f1b
from seq1f1b.attention.attention_op import segment_positions


@pytest.mark.parametrize(
    "schedule,checkpointing,docs,hybrid",
    [
        ("Seq1F1B", True, True, False),
        ("ZBVSeq1F1B", True, False, False),
        ("ZBSeq1F1B", False, True, False),
        # Gated DeltaNet blocks: the carried state through the compiled op pair
        ("InterleavedSeq1F1B", True, False, True),
    ],
)
def test_compiled_blocks_match_eager_reference(
    schedule: str, checkpointing: bool, docs: bool, hybrid: bool
) -> None:
    run_ranks(compiled_schedule_steps, 1, schedule, checkpointing, docs, hybrid, fresh=True)


def test_compiled_on_some_ranks_only_is_refused_on_every_rank() -> None:
    run_ranks(refuses_compiled_on_some_ranks_only, 2, fresh=True)


def test_compiled_attention_needs_a_layer_key() -> None:
    q = torch.randn(1, 2, 4, 8)

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q):
        return seq1f1b.chunk_aware_attention(q, q, q, layer="layer-0")

    with pytest.raises(Exception, match="add_layer_key"):
        attend(q)


def test_segment_positions_outside_a_unit() -> None:
    x = torch.zeros(2, 5, 3)
    assert torch.equal(segment_positions(x), torch.arange(5))
    assert torch.equal(segment_positions(x, dim=-1), torch.arange(3))


def test_selective_checkpointing_saves_the_compiled_attention() -> None:
    """Under an op-level selective checkpointing policy (torchtitan's kind), the compiled
    chunk-aware attention is one op: a policy that does not save it runs its forward again in
    the backward; with :func:`seq1f1b.checkpoint_save_ops` on its save list the backward runs
    only the attention's backward op, with the same gradients."""
    ops = seq1f1b.checkpoint_save_ops()
    assert torch.ops.seq1f1b.segment_attention.default in ops
    forwards, backwards, grad = attention_ops_in_backward(ops, "cpu", torch.float32)
    assert (forwards, backwards > 0) == (0, True)
    again, backwards, recomputed = attention_ops_in_backward(set(), "cpu", torch.float32)
    assert again > 0 and backwards > 0
    torch.testing.assert_close(grad, recomputed, rtol=0, atol=0)


def test_fsdp_bf16_gradients_are_hidden_from_a_recompile(tmp_path) -> None:
    """FSDP2 (2.15) keeps a step's accumulated gradients of bf16 parameters in fp32, which
    dynamo refuses to trace; the runtime's context hides them during a (re)compile, so a
    compiled block called on a new length after a backward compiles, and its gradients come
    back and keep accumulating."""
    result = tmp_path / "outcome.json"
    run_ranks(fsdp_wider_grads_through_a_recompile, 1, str(result), fresh=True)
    outcome = json.loads(result.read_text())
    if not outcome["wider"]:
        pytest.skip(f"FSDP2 on torch {torch.__version__} keeps no wider gradient on a parameter")
    assert outcome["failed_without"], "dynamo traced the wider gradient: the workaround can go"


def test_compiled_lse_carries_its_gradient() -> None:
    """``return_lse=True`` under torch.compile: the custom op's LSE output has a gradient (an
    ``out_transform`` such as GPT-OSS's learned sinks reads it), equal to eager attention's."""
    layer = seq1f1b.add_layer_key(torch.nn.Module())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, generator=g, requires_grad=True)

    def sinked(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(lse - sink.view(1, -1, 1)).unsqueeze(-1)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def attend(q, k, v):
        return sinked(*seq1f1b.chunk_aware_attention(q, k, v, layer=layer, return_lse=True))

    s = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(
        torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf")
    )
    ref = sinked(torch.softmax(s, -1) @ v, torch.logsumexp(s, -1))
    go = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v, sink), go)
    got = torch.autograd.grad(attend(q, k, v), (q, k, v, sink), go)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_blocks_under_context_parallelism_match_eager() -> None:
    """PP x CP compiled (cp = 2 over gloo, two stages on the pipeline rank): Seq1F1B with
    packed documents and K = 4 (pass-Q), ZBVSeq1F1B with a window + sinks, checkpointing and
    an uneven K = 3 (pass-KV); the ring runs inside the compiled attention's custom ops. Loss
    and every gradient equal the eager full-sequence reference and the eager CP run."""
    run_ranks(compiled_cp_schedule_steps, 2, CP_CASES, fresh=True)


def test_compiled_learned_sinks_on_the_ring_equal_full_attention() -> None:
    """tests/test_attention.py's learned sinks on the ring (cp = 2: pass-Q, pass-KV, auto;
    window or not; fp64 and fp32) with the attention compiled (``fullgraph=True``): the custom
    op's LSE is merged over the ring and every cached segment, and its gradient reaches the
    ring's backward, as in eager."""
    run_ranks(_sinks_on_the_ring, 2, True, fresh=True)
