"""The latent K/V cache (:func:`seq1f1b.latent_attention`): multi-head latent attention's
earlier segments cached as the compressed latent, re-expanded by each later segment, equal to
the unpipelined model (and to the expanded cache) with and without checkpointing, compiled
included, in a fraction of the expanded cache's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import seq1f1b
from seq1f1b.attention.kv import SegmentInfo, StageKVState, UnitContext, activate
from seq1f1b.schedules.partition import segment_offsets

pytestmark = pytest.mark.fast

DIM, HEADS, RANK, ROPE, NOPE, VDIM, VOCAB = 32, 4, 8, 4, 6, 5, 50


class MLA(nn.Module):
    """A small multi-head latent attention block shaped like DeepSeek-V3's: K and V of every
    head expanded from a ``RANK``-wide latent, plus a ``ROPE``-wide key shared by the heads
    (value head dim 5, query/key head dim 10)."""

    def __init__(self, latent: bool, ckpt: bool = False) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * (NOPE + ROPE), bias=False)
        self.wkv_a = nn.Linear(DIM, RANK + ROPE, bias=False)
        self.norm = nn.RMSNorm(RANK)
        self.wkv_b = nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=False)
        self.wo = nn.Linear(HEADS * VDIM, DIM, bias=False)
        self.latent, self.ckpt = latent, ckpt

    def expand(self, c: torch.Tensor, pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = c.shape
        k_nope, v = self.wkv_b(c).view(b, s, HEADS, NOPE + VDIM).split([NOPE, VDIM], -1)
        k = torch.cat([k_nope, pe.unsqueeze(2).expand(-1, -1, HEADS, -1)], -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, -1).transpose(1, 2)
        c, pe = self.wkv_a(x).split([RANK, ROPE], -1)
        c, pe = self.norm(c), torch.sin(pe)  # (a stand-in for the rotation)
        if self.latent:
            out = seq1f1b.latent_attention(q, (c, pe), self.expand, layer=self)
        else:
            out = seq1f1b.chunk_aware_attention(q, *self.expand(c, pe), layer=self)
        return x + self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.attend, x, use_reentrant=False) if self.ckpt else self.attend(x)


class Stage(nn.Module):
    def __init__(self, first: bool, last: bool, **kw) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleList([MLA(**kw), MLA(**kw)])
        self.out = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x) if self.emb is not None else x
        for layer in self.layers:
            x = layer(x)
        return self.out(x) if self.out is not None else x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _stages(**kw) -> list[Stage]:
    torch.manual_seed(0)
    return [Stage(True, False, **kw), Stage(False, True, **kw)]


@pytest.mark.parametrize("ckpt", [False, True])
def test_latent_cache_trains_exactly_like_the_unpipelined_model(ckpt: bool) -> None:
    """Seq1F1B with the latent cache equals the unpipelined run (loss, every gradient:
    ``wkv_b`` and ``wkv_a`` get what the later segments send back through the re-expansion)."""
    x, t = torch.randint(0, VOCAB, (2, 48)), torch.randint(0, VOCAB, (2, 48))
    report = seq1f1b.verify_model(_stages(latent=True, ckpt=ckpt), x, t, _loss, seq_chunks=4)
    assert report.ok, report


def test_latent_cache_under_torch_compile() -> None:
    """A compiled block runs the latent attention eagerly (a graph break) and stays exact."""
    stages = _stages(latent=True)
    for stage in stages:
        for i, layer in enumerate(stage.layers):
            stage.layers[i] = torch.compile(layer, backend="aot_eager")
    x, t = torch.randint(0, VOCAB, (2, 48)), torch.randint(0, VOCAB, (2, 48))
    report = seq1f1b.verify_model(stages, x, t, _loss, seq_chunks=3)
    assert report.ok, report


def _cache_bytes(latent: bool, lengths: list[int]) -> tuple[int, list[torch.Tensor]]:
    """Run one MLA layer segment by segment (forwards 0..K-1, backwards K-1..0, as the
    schedule does): the peak K/V cache bytes and the layer's gradients."""
    torch.manual_seed(0)
    layer = MLA(latent)
    x = torch.randn(2, sum(lengths), DIM)
    state, starts = StageKVState(0, len(lengths)), segment_offsets(lengths)
    outs = []
    for seg, (a, n) in enumerate(zip(starts, lengths, strict=True)):
        info = SegmentInfo(0, seg, len(lengths), a, n, sum(lengths), (*starts, sum(lengths)))
        state.begin_forward(0, seg)
        with activate(UnitContext(state, info, "forward", True)):
            outs.append(layer(x[:, a : a + n]))
        state.end_forward(0, seg, keep=True)
    for seg in reversed(range(len(lengths))):
        state.begin_backward(0, seg)
        info = SegmentInfo(0, seg, len(lengths), starts[seg], lengths[seg], sum(lengths),
                           (*starts, sum(lengths)))  # fmt: skip
        with activate(UnitContext(state, info, "backward", True)):
            outs[seg].square().sum().backward()
        state.end_backward(0, seg)
    assert state.is_empty()
    return state.peak_bytes, [p.grad for p in layer.parameters()]


def test_latent_cache_holds_the_latent_bytes_only() -> None:
    """The cache keeps ``RANK + ROPE`` values a token instead of ``HEADS * (NOPE + ROPE +
    VDIM)``; the gradients are those of the expanded cache."""
    lengths = [8, 8, 8, 8]
    expanded, want = _cache_bytes(False, lengths)
    latent, got = _cache_bytes(True, lengths)
    assert latent * HEADS * (NOPE + ROPE + VDIM) == expanded * (RANK + ROPE)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_latent_tensors_must_be_three_dimensional() -> None:
    q = torch.randn(1, HEADS, 6, NOPE + ROPE)
    with pytest.raises(ValueError, match=r"\(batch, seq, width\)"):
        seq1f1b.latent_attention(q, (torch.randn(1, 6, 1, RANK), torch.randn(1, 6, ROPE)),
                                 lambda c, p: (c, p), layer="x")  # fmt: skip
