"""GPT-OSS's PP=2 / PP=1 difference is precision, not the sinks or the windows (issue 60).

torchtitan 0.3's GPT-OSS differs between PP=2 under the Seq1F1B schedules and PP=1 by about
2e-5 in the step-1 loss, where Llama3 and DeepSeek-V3 agree to every printed digit. Measured
on its debug model (``debugmodel_cpu``, 448 tokens, batch 4, M = 2, K = 3, 2 stages, AdamW),
PP=2 against PP=1: torchtitan's routed experts run their GEMMs in bf16 in any run, so one
fp32 ulp of a sum taken over segments can round to a bf16 ulp. Step 1: loss 2.9e-6 off, 1 of
7168 token-layer routings flips (a 2nd/3rd score gap of 9e-6); Adam turns the bf16 gradient
noise into different weights, so near ties flip more (45, 122, 355 at steps 2-4) and the loss
is 4.6e-4 off at step 4. With PP=1's routing replayed in PP=2 it is still 5e-5 off at step 4
(the bf16 GEMMs); with the bf16 casts off (fp32 experts) and routing free, no token flips in
4 steps and the loss stays within one fp32 ulp (9.5e-7). In fp64 with torchtitan's own fp32
casts off too (the experts' combine, RoPE), sinks of std 2, K = 3 uneven: loss 1.8e-15 and
every gradient 4e-15 off. So neither the sinks nor the windows are the cause.

The test below is the same attention path, fp64 end to end: transformers' GPT-OSS (learned
sinks, sliding windows of 12 on alternate layers, top-2 of 4 experts) in two stages under
Seq1F1B with K = 3 uneven segments equals transformers' unpipelined model to 1e-10 (loss and
every gradient), and routes every token to the same experts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch.distributed.pipelining import PipelineStage
from torch.overrides import TorchFunctionMode

from seq1f1b import ScheduleSeq1F1B, current_segment
from seq1f1b.huggingface import decoder_stages, register_attention

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.default_release_only

SEQ_LEN, BATCH, VOCAB = 80, 4, 96  # K = 3: segments of 27, 27 and 26 positions
TOL = 1e-10
TOP_K = 2


def _gpt_oss() -> torch.nn.Module:
    """A tiny GPT-OSS in fp64: windows of 12 (they cut every segment boundary), sinks of
    std 2 (large enough to matter), experts run expert by expert (no fp64 grouped GEMM)."""
    register_attention()
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, attention_dropout=0.0, num_local_experts=4,
        num_experts_per_tok=TOP_K, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    config._attn_implementation = "seq1f1b"
    config._experts_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


class _KeepFp64(TorchFunctionMode):
    """Within it, ``t.to(torch.float32)`` of an fp64 tensor returns ``t``: transformers'
    ``GptOssRMSNorm`` computes in fp32 whatever the model's dtype, and its fp32 sum over the
    hidden dim is ordered by the tensor's shape (a segment's or the batch's), which leaves
    7e-8 in every gradient of an fp64 run (measured: 1e-12 and below without the cast)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.to and len(args) == 2 and not kwargs:
            if args[1] is torch.float32 and args[0].dtype == torch.float64:
                return args[0]
        return func(*args, **kwargs)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # fp64 throughout


def _record_routing(model: torch.nn.Module, into: dict) -> None:
    """Record every router call's top-k expert indices, sorted, as ``(batch, seq, k)``
    tokens of the whole batch: ``into[layer]`` a tensor filled unit by unit (a pipelined
    run: the running segment's positions of its sample's rows), calls outside a unit of a
    pipelined run (the stages' shape inference) left out."""

    def hook(module, args, out) -> None:  # type: ignore[no-untyped-def]
        del args
        ids = out[2].sort(-1).values
        info = current_segment()
        full = into.setdefault(module.seq1f1b_index, torch.full((BATCH, SEQ_LEN, TOP_K), -1))
        if info is None:
            if not into.get("pipelined"):
                full.copy_(ids.view(BATCH, SEQ_LEN, TOP_K))
            return
        per_sample = ids.shape[0] // info.length  # rows of a sample (microbatch)
        rows = slice(info.microbatch * per_sample, (info.microbatch + 1) * per_sample)
        full[rows, info.start : info.end] = ids.view(per_sample, info.length, TOP_K)

    for index, layer in enumerate(model.model.layers):
        layer.mlp.router.seq1f1b_index = index
        layer.mlp.router.register_forward_hook(hook)


def _fp64_window_sinks_and_routing(rank: int, world: int) -> None:
    del rank, world
    with _KeepFp64():
        _compare()


def _compare() -> None:
    """The pipelined fp64 run against transformers' unpipelined one (see the module doc)."""
    model = _gpt_oss()
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"  # transformers' own sinks and window masks
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ref_routes: dict = {}
    _record_routing(ref, ref_routes)
    ref_loss = _loss(ref(input_ids=x, use_cache=False).logits, y)
    ref_loss.backward()
    routes: dict = {"pipelined": True}
    _record_routing(model, routes)
    stages = decoder_stages(model, 2)
    pipe = [PipelineStage(stages[s], s, 2, torch.device("cpu")) for s in range(2)]
    sched = ScheduleSeq1F1B(pipe, 2, 3, _loss, check_attention=False)
    losses: list[torch.Tensor] = []
    sched.step(x, target=y, losses=losses)
    lengths = sched.segment_lengths[0]
    assert len(set(lengths)) > 1, lengths  # uneven: the token weights are exercised too
    # the pipelined loss: each unit's mean weighted by its share of the tokens
    loss = torch.stack(losses).mean()
    assert abs(loss.item() - ref_loss.item()) <= TOL * ref_loss.item(), (loss, ref_loss)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = grads[name].grad
        err = ((p.grad - want).norm() / want.norm()).item()
        assert err <= TOL, f"{name}: relative error {err:.2e}"
    for index in range(len(model.model.layers)):  # every token's experts, every layer
        assert (routes[index] >= 0).all() and (ref_routes[index] >= 0).all()  # all recorded
        flips = (routes[index] != ref_routes[index]).any(-1)
        assert not flips.any(), f"layer {index}: tokens {flips.nonzero().tolist()} flip"


def test_gpt_oss_pipelined_equals_unpipelined_in_fp64() -> None:
    """Sinks, windows and the experts' routing under K = 3 uneven segments: 1e-10 in fp64."""
    run_ranks(_fp64_window_sinks_and_routing, 1)
