"""The compute split of the step's real mask (seq1f1b.schedules.mask_split): the vectorized profile
equals the reference per-position count, the split is never worse than uniform or causal
compute, the cache follows the layout, and pipelines that re-split every step stay exact."""

from __future__ import annotations

import random

import pytest
import torch
from dist_utils import run_ranks
from equivalence import packed_layout, run_mask_split_steps

from seq1f1b import SequenceSplit
from seq1f1b.schedules.mask_split import (
    MaskSplitCache,
    attended_keys_per_position,
    mask_balanced_split,
    segment_costs,
)
from seq1f1b.schedules.partition import (
    ModelShape,
    attended_keys,
    compute_balanced_split,
    profile_balanced_split,
    profile_flops,
    token_cost,
    uniform_split,
)

SHAPE_8B = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=128256, ffn_hidden=14336,
                      n_kv_heads=8, gated_ffn=True)  # fmt: skip


def _random_rows(rng: random.Random, rows: int, length: int, p_new: float) -> list[list[int]]:
    out = []
    for _ in range(rows):
        row, doc = [], 0
        for i in range(length):
            doc += int(i > 0 and rng.random() < p_new)
            row.append(doc)
        out.append(row)
    return out


def test_vectorized_keys_equal_the_reference_count() -> None:
    rng = random.Random(0)
    for _ in range(60):
        length, rows = rng.randint(1, 50), rng.randint(1, 3)
        ids = _random_rows(rng, rows, length, rng.choice([0.0, 0.1, 0.4]))
        window, sinks = rng.choice([None, 1, 4, 9]), rng.choice([0, 1, 3])
        want = attended_keys(length, ids, window, sinks)
        got = attended_keys_per_position(torch.tensor(ids), window=window, sinks=sinks)
        assert got.tolist() == pytest.approx(want, abs=1e-12), (ids, window, sinks)
    assert attended_keys_per_position(None, seq_len=4).tolist() == [1, 2, 3, 4]


def _max_cost(keys: torch.Tensor, lengths: list[int]) -> float:
    base, per_key = token_cost(SHAPE_8B)
    return max(segment_costs(torch.cumsum(base + per_key * keys, 0), lengths))


@pytest.mark.parametrize("mean_doc", [64.0, 512.0, 4096.0, 1e9])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_never_worse_than_uniform_or_causal_compute(mean_doc: float, k: int) -> None:
    seq_len = 8192
    docs = packed_layout(4, seq_len, seed=k, mean_doc=mean_doc)
    lengths = mask_balanced_split(docs, k, SHAPE_8B, multiple_of=8)
    assert sum(lengths) == seq_len and all(x > 0 and x % 8 == 0 for x in lengths)
    keys = attended_keys_per_position(docs)
    mine = _max_cost(keys, lengths)
    uniform = _max_cost(keys, uniform_split(seq_len, k, 8))
    causal = _max_cost(keys, compute_balanced_split(seq_len, k, SHAPE_8B, 8))
    assert mine <= min(uniform, causal) * (1 + 1e-12)
    if mean_doc >= 1e9:  # one document per row: today's causal compute split (or better)
        assert mine <= causal
    if mean_doc <= 512:  # short documents: nearly flat, far better than the causal split
        assert mine < 0.95 * causal


def test_equals_the_reference_profile_split() -> None:
    docs = [[i // 100 for i in range(800)]]
    want = profile_balanced_split(profile_flops(attended_keys(800, docs), SHAPE_8B), 4, 8)
    assert mask_balanced_split(torch.tensor(docs), 4, SHAPE_8B, multiple_of=8) == want


def test_cache_follows_the_layout() -> None:
    cache = MaskSplitCache(max_entries=2)
    a = packed_layout(2, 4096, seed=1, mean_doc=300.0)
    b = packed_layout(2, 4096, seed=2, mean_doc=3000.0)
    first = cache.lengths(a, 4, SHAPE_8B)
    assert cache.lengths(a.clone() + 7, 4, SHAPE_8B) == first  # same layout, other ids
    assert cache.lengths(b, 4, SHAPE_8B) == mask_balanced_split(b, 4, SHAPE_8B)
    assert cache.lengths([a[:1], a[1:]], 4, SHAPE_8B) == first  # one tensor per sample
    cache.lengths(packed_layout(2, 4096, seed=3, mean_doc=50.0), 4, SHAPE_8B)
    assert len(cache._entries) == 2  # bounded


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank", "checkpointing"),
    [("Seq1F1B", 1, False),
     *(pytest.param(*case, marks=pytest.mark.default_release_only)  # (CI time: one release)
       for case in (("InterleavedSeq1F1B", 2, True), ("ZBSeq1F1B", 1, True),
                    ("ZBVSeq1F1B", 2, False)))],
)  # fmt: skip
def test_per_step_split_is_exact_two_ranks(schedule, stages_per_rank, checkpointing) -> None:
    run_ranks(run_mask_split_steps, 2, schedule, stages_per_rank, checkpointing)


def test_per_step_split_with_declared_windows_is_exact() -> None:
    # sliding windows of 6 (+2 sinks) on half the layers, declared on ModelShape
    run_ranks(run_mask_split_steps, 2, "Seq1F1B", 1, False, 1, 6)


def test_windows_alone_move_the_split_without_documents() -> None:
    plain = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=32000)
    windowed = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=32000, window=4096)
    causal = SequenceSplit("compute", model_shape=plain).lengths(32768, 4)
    assert causal == compute_balanced_split(32768, 4, plain)  # unchanged without a window
    lengths = SequenceSplit("compute", model_shape=windowed).lengths(32768, 4)
    assert lengths == mask_balanced_split(None, 4, windowed, seq_len=32768)
    assert max(lengths) - min(lengths) < max(causal) - min(causal)  # flatter than causal
    half = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=32000, window=4096,
                      window_layers=16)  # fmt: skip
    mixed = mask_balanced_split(None, 4, half, seq_len=32768)
    assert max(lengths) - min(lengths) < max(mixed) - min(mixed) < max(causal) - min(causal)
    with pytest.raises(ValueError, match=r"window_layers = 33 must be in 1\.\.n_layers"):
        ModelShape(hidden=64, n_heads=4, n_layers=32, vocab=10, window=8, window_layers=33)


@pytest.mark.default_release_only
def test_per_step_split_is_exact_four_ranks_and_with_context_parallelism() -> None:
    run_ranks(run_mask_split_steps, 4, "Seq1F1B", 1, False)
    run_ranks(run_mask_split_steps, 4, "Seq1F1B", 1, False, 2)  # pp=2 x cp=2


@pytest.mark.default_release_only  # simulation only: the same on every torch
def test_packed_benchmark_per_sample_split_and_cp_layout_win() -> None:
    """benchmarks.documents.packed on the shipped corpus (8B shape, pp=4, M=8, 32k): the per-sample
    mask-aware split is faster than uniform, causal and one cut per step; with CP=2 the
    document layout keeps every unit within 5% of the mean CP work where head-tail does not,
    and is not slower."""
    from benchmarks.documents.packed import (
        SHAPE_8B,
        corpus_document_lengths,
        pack,
        simulate_cp,
        simulate_splits,
    )

    docs = pack(corpus_document_lengths(), 8, 32768, seed=32772)
    r = simulate_splits(docs, SHAPE_8B, 4, 8, 4)
    assert r["mask_aware_vs_uniform"] < min(1.0, r["causal_vs_uniform"], r["mask_step_vs_uniform"])
    cp = simulate_cp(docs, SHAPE_8B, 4, 4)
    for split in ("uniform", "causal", "mask_aware"):
        head_tail, by_docs = cp[f"{split}/head_tail"], cp[f"{split}/documents"]
        assert by_docs["max_over_mean_worst"] <= 1.05 < head_tail["max_over_mean_worst"]
        assert by_docs["step"] <= head_tail["step"]


def test_each_sample_is_cut_for_its_own_documents() -> None:
    """``split="compute"`` with documents: one list of lengths per sample, each the mask-aware
    split of that sample's rows alone (a row of short documents is cut near uniformly, a row
    holding one document like the causal split); without documents every sample is cut alike."""
    seq_len, k = 4096, 4
    short = packed_layout(2, seq_len, seed=5, mean_doc=64.0)
    whole = torch.zeros(2, seq_len, dtype=torch.int64)
    split = SequenceSplit("compute", model_shape=SHAPE_8B)
    got = split.sample_lengths(seq_len, k, 2, documents=torch.cat([short, whole]))
    assert got == [mask_balanced_split(short, k, SHAPE_8B), mask_balanced_split(whole, k, SHAPE_8B)]
    assert got[0] != got[1]
    assert split.sample_lengths(seq_len, k, 2) == [split.lengths(seq_len, k)] * 2
    assert split.sample_lengths(seq_len, k, 2, documents=[short, whole]) == got  # one per sample
