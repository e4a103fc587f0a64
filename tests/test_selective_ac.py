"""The planner's price of torchtitan's selective activation checkpointing against torchtitan's
own policy on its own Llama block: which matmuls it keeps and which its backward recomputes.

Runs the installed torchtitan's ``SelectiveAC`` on a small Llama 3 block (its debug width) on
CPU and records every decision the policy makes; the planner's
:func:`~seq1f1b.planning.costmodel.selective_ac_layer` must name the same matmuls, for the
fused ``wqkv`` block torchtitan 0.3 builds and for the separate ``wq wk wv`` of 0.2.2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seq1f1b.planning.costmodel import selective_ac_layer
from seq1f1b.schedules.partition import ModelShape

tac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
llama3 = pytest.importorskip("torchtitan.models.llama3")
pytestmark = pytest.mark.fast

from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

DIM, HEADS, FFN, TOKENS = 256, 16, 768, 64


class _CausalSDPA(nn.Module):
    """Stands in for the block's flex attention, which has no CPU backward: causal SDPA on the
    same ``(B, L, N, H)`` layout. Its ops are not matmuls, so the policy's matmul count (what
    decides which matmul is kept) is the real block's."""

    def forward(self, q, k, v, attention_masks=None, scale=None, enable_gqa=False):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
        return out.transpose(1, 2)


def _block(fuse_qkv: bool) -> nn.Module:
    cfg = llama3._debugmodel("flex")
    layer_cfg = llama3._build_llama3_layers(
        n_layers=1, dim=DIM, n_heads=HEADS, n_kv_heads=4,
        hidden_dim=FFN, rope=cfg.layers[0].attention.rope,
        attn_backend="flex", fuse_qkv=fuse_qkv,
    )[0]  # fmt: skip
    block = layer_cfg.build()
    block.attention.inner_attention = _CausalSDPA()
    return block


def _decisions(block: nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(recompute pass, matmul input rows, inner width, output width, decision) of every
    matmul the policy decided on in one forward and backward of the checkpointed block."""
    seen: list[tuple] = []
    make = tac.create_selective_checkpoint_contexts

    def spying(policy_fn, *args, **kwargs):
        def policy(ctx, func, *fargs, **fkwargs):
            decision = policy_fn(ctx, func, *fargs, **fkwargs)
            if func == torch.ops.aten.mm.default:
                (m, k), (_, n) = fargs[0].shape, fargs[1].shape
                seen.append((ctx.is_recompute, m, k, n, decision))
            return decision

        return make(policy, *args, **kwargs)

    monkeypatch.setattr(tac, "create_selective_checkpoint_contexts", spying)
    wrapped = tac.SelectiveAC(tac.SelectiveAC.Config())._wrap_block(block)
    x = torch.randn(1, TOKENS, DIM, requires_grad=True)
    wrapped(x, None, None).sum().backward()
    return seen


@pytest.mark.parametrize("fuse_qkv", [True, False], ids=["torchtitan-0.3", "torchtitan-0.2"])
def test_selective_ac_prices_the_policys_matmuls(
    fuse_qkv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = _block(fuse_qkv)
    ffn = block.feed_forward.w1.weight.shape[0]
    shape = ModelShape(DIM, HEADS, 1, 2048, ffn_hidden=ffn, n_kv_heads=4, gated_ffn=True)
    seen = _decisions(block, monkeypatch)
    forward = [d for d in seen if not d[0]]
    assert len(forward) == (5 if fuse_qkv else 7)  # the block's matmuls, once each
    saved = [d for d in forward if d[4] == CheckpointPolicy.MUST_SAVE]
    recomputed = [d for d in forward if d[4] == CheckpointPolicy.PREFER_RECOMPUTE]
    assert len(saved) + len(recomputed) == len(forward)
    sac = selective_ac_layer(shape, 1, 2, fused_qkv=fuse_qkv)
    q = shape.n_heads * shape.head_dim
    # what the planner keeps per token beyond the matmuls: the block input, attention out, lse
    kept_mm_bytes = sac.saved_bytes - (2 * DIM + 2 * q + 4 * HEADS)
    assert kept_mm_bytes == sum(2 * n for _, _, _, n, _ in saved)
    assert sac.recompute_flops == sum(2 * k * n for _, _, k, n, _ in recomputed)


def test_torchtitans_policy_keeps_attention() -> None:
    """The planner prices no attention recompute under selective AC: torchtitan's save list
    holds every attention kernel its Llama runs (flash/efficient SDPA, flex, varlen)."""
    names = {str(op) for op in tac.SelectiveAC(tac.SelectiveAC.Config()).get_save_ops()}
    assert "aten._scaled_dot_product_flash_attention.default" in names
    assert any("flex_attention" in name for name in names)
