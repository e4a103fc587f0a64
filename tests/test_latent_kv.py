"""The latent K/V cache (:func:`seq1f1b.latent_attention`): multi-head latent attention's
earlier segments cached as the compressed latent, re-expanded by each later segment, equal to
the unpipelined model (and to the expanded cache) with and without checkpointing, compiled
included, with context parallelism, in a fraction of the expanded cache's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn
from torch.distributed.pipelining import PipelineStage

import seq1f1b
from benchmarks.memory.latent_cache import MLA, MLAWidths, run_segments

pytestmark = pytest.mark.fast

#: DeepSeek-V3's shape in miniature: query/key head dim 10, value head dim 5
W = MLAWidths(dim=32, heads=4, rank=8, rope=4, nope=6, v=5)
VOCAB = 50


class Stage(nn.Module):
    def __init__(self, first: bool, last: bool, **kw) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, W.dim) if first else None
        self.layers = nn.ModuleList([MLA(W, **kw), MLA(W, **kw)])
        self.out = nn.Linear(W.dim, VOCAB) if last else None

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


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (2, 48)), torch.randint(0, VOCAB, (2, 48))


@pytest.mark.parametrize("ckpt", [False, True])
def test_latent_cache_trains_exactly_like_the_unpipelined_model(ckpt: bool) -> None:
    """Seq1F1B with the latent cache equals the unpipelined run (loss, every gradient:
    ``wkv_b`` and ``wkv_a`` get what the later segments send back through the re-expansion)."""
    report = seq1f1b.verify_model(_stages(latent=True, ckpt=ckpt), *_batch(), _loss, seq_chunks=4)
    assert report.ok, report


def test_latent_cache_under_torch_compile() -> None:
    """A compiled block runs the latent attention eagerly (a graph break) and stays exact."""
    stages = _stages(latent=True)
    for stage in stages:
        for i, layer in enumerate(stage.layers):
            stage.layers[i] = torch.compile(layer, backend="aot_eager")
    report = seq1f1b.verify_model(stages, *_batch(), _loss, seq_chunks=3)
    assert report.ok, report


def _latent_on_the_ring(rank: int, world: int) -> None:
    """Both layers' latent caches under CP = ``world`` (one stage, the ranks a ring), each
    cache mode of the ring, with checkpointing: loss and every gradient (averaged over the
    ring by the schedule) equal the whole model's in one process."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "cp"))
    torch.manual_seed(1)  # the same batch on every rank
    x, y = (t.repeat(1, 2) for t in _batch())  # 96 tokens: K = 3 segments of 32 = 8 * 2 * cp
    for prefix, ckpt in (("pass_kv", False), ("pass_q", True), ("auto", False)):
        torch.manual_seed(0)
        ref = Stage(True, True, latent=True, ckpt=ckpt)
        want = _loss(ref(x), y)
        want.backward()
        torch.manual_seed(0)
        model = Stage(True, True, latent=True, ckpt=ckpt)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
        cp = seq1f1b.ContextParallelConfig(mesh["cp"].get_group(), prefix)
        losses: list[torch.Tensor] = []
        seq1f1b.ScheduleSeq1F1B([stage], 2, 3, _loss, context_parallel=cp).step(
            x, target=y, losses=losses
        )
        got = torch.stack(losses).mean()
        dist.all_reduce(got)  # each CP rank's loss is its share of the tokens
        got, want = float(got) / world, float(want)
        assert abs(got - want) <= 1e-5 * abs(want), (prefix, got, want)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            err = float((p.grad - r.grad).norm() / r.grad.norm())
            assert err <= 1e-5, (prefix, name, err)


def test_latent_cache_with_context_parallelism_matches_the_whole_model() -> None:
    """The latent cache on a CP ring: each CP rank caches the latent of its own shard of an
    earlier segment's positions and expands it for the ring's tiles (pass-KV sends the
    expanded K/V, pass-Q the queries), and the gradients come back through the expansion."""
    run_ranks(_latent_on_the_ring, 2)


def _peak_and_grads(latent: bool, lengths: list[int]) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    layer = MLA(W, latent)
    peak = run_segments(layer, torch.randn(2, sum(lengths), W.dim), lengths)
    return peak, [p.grad for p in layer.parameters()]


def test_latent_cache_holds_the_latent_bytes_only() -> None:
    """The cache keeps ``rank + rope`` values a token instead of every head's K and V; the
    gradients are those of the expanded cache."""
    lengths = [8, 8, 8, 8]
    expanded, want = _peak_and_grads(False, lengths)
    latent, got = _peak_and_grads(True, lengths)
    assert latent * W.heads * (W.nope + W.rope + W.v) == expanded * (W.rank + W.rope)
    for g, w in zip(got, want, strict=True):  # the same sums, in another order (fp32): an
        # element near zero can differ by a few ulps of the largest, so the norm is compared
        assert float((g - w).norm() / w.norm()) <= 1e-6


def test_latent_tensors_must_be_three_dimensional() -> None:
    q = torch.randn(1, W.heads, 6, W.nope + W.rope)
    with pytest.raises(ValueError, match=r"\(batch, seq, width\)"):
        seq1f1b.latent_attention(q, (torch.randn(1, 6, 1, W.rank), torch.randn(1, 6, W.rope)),
                                 lambda c, p: (c, p), layer="x")  # fmt: skip
