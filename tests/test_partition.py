"""Tests for seq1f1b.schedules.partition: exact published split, invariants, balance and errors."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace
from fractions import Fraction

import pytest

from seq1f1b.schedules.partition import (
    LinearAttention,
    ModelShape,
    compute_balanced_split,
    explicit_split,
    resolve_split,
    segment_flops,
    segment_offsets,
    uniform_split,
)

pytestmark = pytest.mark.fast  # the fast tier: the whole file runs in seconds

SHAPE_7B = ModelShape(
    hidden=4096, n_heads=32, n_layers=32, vocab=50304, ffn_hidden=4 * 4096, head_dim=128
)
SHAPE_TINY = ModelShape(hidden=64, n_heads=4, n_layers=2, vocab=1000)

GRID = [
    (seq_len, k, m)
    for seq_len, k, m in itertools.product(
        [1, 7, 8, 30, 32, 100, 1024, 4096, 32768],
        [1, 2, 3, 4, 8],
        [1, 2, 4, 8],
    )
    if seq_len >= k * m and seq_len % m == 0
]


def _flops_per_segment(lengths: list[int], shape: ModelShape) -> list[float]:
    ends = [off + s for off, s in zip(segment_offsets(lengths), lengths, strict=True)]
    return [segment_flops(s, end, shape) for s, end in zip(lengths, ends, strict=True)]


def _assert_valid(lengths: list[int], seq_len: int, k: int, m: int) -> None:
    assert len(lengths) == k
    assert sum(lengths) == seq_len
    assert all(isinstance(x, int) and x >= m and x % m == 0 for x in lengths), lengths


#: the 7B example (H 4096, 32 heads, 32 layers, vocab 50304, FFN 4H) of the Seq1F1B paper's
#: computation-wise split, 32k tokens in 4 segments: arXiv 2406.03488 and its public code
#: (MayDomine/Seq1F1B), as the project's reference notes give it with the FLOPs formula
#: (REFERENCE.md section 1, "Computation-wise split"); recomputed below from that formula
#: alone, in exact arithmetic, so the number does not rest on the notes
PAPER_7B_32K_K4 = [11021, 8421, 7087, 6239]


def _formula_split(seq_len: int, k: int, shape: ModelShape) -> list[int]:
    """The split from the reference's formula, independently of the implementation: FLOPs(s, P)
    = 4sHV + L[(sP - s^2/2)(4d+3)h + 8sHhd + 4sHF] in exact rationals; from the end, each
    segment is the longest integer s with FLOPs(s, P) <= total/k (the smaller root, floored,
    found by bisection: FLOPs grows with s up to P), the first takes the rest."""
    h_, heads, d, ffn = shape.hidden, shape.n_heads, shape.head_dim, shape.ffn_hidden

    def flops(s: int, end: int) -> Fraction:
        attention = (s * end - Fraction(s * s, 2)) * (4 * d + 3) * heads
        return 4 * s * h_ * shape.vocab + shape.n_layers * (
            attention + 8 * s * h_ * heads * d + 4 * s * h_ * ffn
        )

    target = flops(seq_len, seq_len) / k
    lengths, end = [], seq_len
    for _ in range(k - 1):
        lo, hi = 0, end  # flops(0, end) = 0 <= target < flops(end, end), the whole rest
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if flops(mid, end) <= target else (lo, mid)
        lengths.append(lo)
        end -= lo
    return [end, *lengths[::-1]]  # first segment first


def test_published_7b_example_exact() -> None:
    assert compute_balanced_split(32768, 4, SHAPE_7B) == PAPER_7B_32K_K4
    assert _formula_split(32768, 4, SHAPE_7B) == PAPER_7B_32K_K4


def test_model_shape_defaults_resolved() -> None:
    shape = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=50304)
    assert shape.ffn_hidden == 4 * 4096
    assert shape.head_dim == 128
    assert shape == SHAPE_7B


@pytest.mark.parametrize(("seq_len", "k", "m"), GRID)
def test_uniform_split_invariants(seq_len: int, k: int, m: int) -> None:
    lengths = uniform_split(seq_len, k, m)
    _assert_valid(lengths, seq_len, k, m)
    assert max(lengths) - min(lengths) <= m
    assert lengths == sorted(lengths, reverse=True)  # extra goes to the earlier segments


@pytest.mark.parametrize(("seq_len", "k", "m"), GRID)
@pytest.mark.parametrize("shape", [SHAPE_7B, SHAPE_TINY], ids=["7b", "tiny"])
def test_compute_split_invariants(seq_len: int, k: int, m: int, shape: ModelShape) -> None:
    lengths = compute_balanced_split(seq_len, k, shape, m)
    _assert_valid(lengths, seq_len, k, m)
    assert lengths == sorted(lengths, reverse=True)
    # The bottleneck segment is never costlier than with the uniform split.
    uniform = uniform_split(seq_len, k, m)
    assert max(_flops_per_segment(lengths, shape)) <= max(_flops_per_segment(uniform, shape))


def test_uniform_split_examples() -> None:
    assert uniform_split(10, 4) == [3, 3, 2, 2]
    assert uniform_split(40, 3, 4) == [16, 12, 12]
    assert uniform_split(8, 8) == [1] * 8


@pytest.mark.parametrize(
    ("seq_len", "k", "shape"),
    [(32768, 4, SHAPE_7B), (65536, 8, SHAPE_7B), (16384, 4, SHAPE_TINY)],
)
def test_compute_split_balances_flops_uniform_does_not(
    seq_len: int, k: int, shape: ModelShape
) -> None:
    balanced = compute_balanced_split(seq_len, k, shape)
    assert all(a > b for a, b in itertools.pairwise(balanced))  # strictly decreasing
    flops = _flops_per_segment(balanced, shape)
    assert max(flops) / min(flops) < 1.02

    uniform = _flops_per_segment(uniform_split(seq_len, k), shape)
    assert uniform[-1] > uniform[0]
    assert max(uniform) / min(uniform) > max(flops) / min(flops)


def test_compute_split_with_multiple_of_stays_near_unconstrained() -> None:
    base = compute_balanced_split(32768, 4, SHAPE_7B)
    tp = compute_balanced_split(32768, 4, SHAPE_7B, multiple_of=8)
    _assert_valid(tp, 32768, 4, 8)
    assert all(abs(a - b) <= 8 * 4 for a, b in zip(base, tp, strict=True))
    flops = _flops_per_segment(tp, SHAPE_7B)
    assert max(flops) / min(flops) < 1.02


def test_compute_split_short_sequences_fall_back_to_uniform() -> None:
    # Floor rounding would give [15, 1, ..., 1]; uniform has the cheaper bottleneck.
    assert compute_balanced_split(30, 16, SHAPE_7B) == uniform_split(30, 16)
    # Coarse multiples reorder longest-first rather than leave the remainder short.
    assert compute_balanced_split(32, 3, SHAPE_7B, multiple_of=4) == [12, 12, 8]


def test_compute_split_tight_cases_clamp() -> None:
    # Exactly k*multiple_of tokens: only one valid answer.
    assert compute_balanced_split(32, 8, SHAPE_7B, multiple_of=4) == [4] * 8
    assert compute_balanced_split(4, 4, SHAPE_7B) == [1, 1, 1, 1]
    assert compute_balanced_split(100, 1, SHAPE_7B) == [100]


def test_flops_additive_over_splits() -> None:
    # sum_i (s_i*P_i - s_i^2/2) = P^2/2 for any split of [0, P), and the other terms are
    # linear in s, so segment FLOPs are exactly additive (up to float rounding).
    rng = random.Random(0)
    seq_len = 32768
    splits = [
        uniform_split(seq_len, 4),
        compute_balanced_split(seq_len, 4, SHAPE_7B),
        [1, seq_len - 1],
        [seq_len - 1, 1],
    ]
    cuts = sorted(rng.sample(range(1, seq_len), 6))
    splits.append([b - a for a, b in itertools.pairwise([0, *cuts, seq_len])])
    for shape in (SHAPE_7B, SHAPE_TINY):
        whole = segment_flops(seq_len, seq_len, shape)
        for lengths in splits:
            assert math.isclose(sum(_flops_per_segment(lengths, shape)), whole, rel_tol=1e-9)


def test_segment_flops_formula_and_causality() -> None:
    h, d, n_layers, hidden, vocab, ffn = 32, 128, 32, 4096, 50304, 4 * 4096
    s, end = 100, 300
    expected = 4 * s * hidden * vocab + n_layers * (
        (s * end - s * s / 2) * (4 * d + 3) * h + 8 * s * hidden * h * d + 4 * s * hidden * ffn
    )
    assert math.isclose(segment_flops(s, end, SHAPE_7B), expected, rel_tol=1e-12)
    assert segment_flops(100, 1000, SHAPE_7B) > segment_flops(100, 100, SHAPE_7B)


def test_segment_offsets() -> None:
    assert segment_offsets([11021, 8421, 7087, 6239]) == [0, 11021, 19442, 26529]
    assert segment_offsets([5]) == [0]


def test_explicit_and_resolve_split() -> None:
    assert explicit_split([4, 8, 4], 16, 3, multiple_of=4) == [4, 8, 4]
    assert explicit_split((3, 1), 4, 2) == [3, 1]
    assert resolve_split("uniform", 10, 4) == [3, 3, 2, 2]
    assert resolve_split("compute", 32768, 4, shape=SHAPE_7B) == [
        11021,
        8421,
        7087,
        6239,
    ]
    assert resolve_split([6, 4], 10, 2) == [6, 4]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: uniform_split(10, 0), r"seq_chunks must be >= 1"),
        (lambda: uniform_split(0, 1), r"seq_len must be >= 1"),
        (
            lambda: uniform_split(5, 8),
            r"seq_chunks=8 needs seq_len >= 8 \(got seq_len=5\)",
        ),
        (
            lambda: uniform_split(30, 8, 4),
            (
                r"seq_chunks=8 with multiple_of=4 needs seq_len >= 32 and seq_len % 4 == 0 "
                r"\(got seq_len=30\): use a sequence length that is a multiple of 4, "
                r"or fewer seq_chunks"
            ),
        ),
        (
            lambda: compute_balanced_split(34, 2, SHAPE_7B, 4),
            r"seq_len % 4 == 0 \(got seq_len=34\)",
        ),
        (lambda: uniform_split(10, 2, 0), r"multiple_of must be >= 1"),
        (lambda: uniform_split(10.0, 2), r"seq_len must be an integer"),  # type: ignore[arg-type]
        (lambda: uniform_split(10, True), r"seq_chunks must be an integer"),
        (
            lambda: resolve_split("balanced", 10, 2),
            r"unknown seq_split='balanced'.*'uniform', 'compute'",
        ),
        (
            lambda: resolve_split("compute", 10, 2),
            r"split='compute' needs the model shape: pass model_shape=ModelShape\(\.\.\.\)",
        ),
        (lambda: resolve_split(None, 10, 2), r"split lengths must be a list"),  # type: ignore[arg-type]
        (
            lambda: explicit_split([5, 5], 10, 3),
            r"split has 2 lengths but seq_chunks=3",
        ),
        (lambda: explicit_split([5, 4], 10, 2), r"must sum to seq_len=10"),
        (
            lambda: explicit_split([11, -1], 10, 2),
            r"must be positive \(got split\[1\]=-1\)",
        ),
        (lambda: explicit_split([0, 10], 10, 2), r"must be positive"),
        (
            lambda: explicit_split([6, 10], 16, 2, 4),
            r"multiple of multiple_of=4 \(got split\[0\]=6\)",
        ),
        (lambda: explicit_split([5.0, 5], 10, 2), r"split\[0\] must be an integer"),
        (lambda: compute_balanced_split(10, 2, None), r"needs a ModelShape"),  # type: ignore[arg-type]
        (lambda: segment_flops(0, 10, SHAPE_7B), r"1 <= s <= end"),
        (lambda: segment_flops(11, 10, SHAPE_7B), r"1 <= s <= end"),
        (lambda: segment_offsets([]), r"non-empty"),
        (lambda: segment_offsets([3, 0]), r"lengths must be positive"),
        (
            lambda: ModelShape(hidden=0, n_heads=1, n_layers=1, vocab=1),
            r"hidden must be >= 1",
        ),
        (
            lambda: ModelShape(hidden=64, n_heads=-2, n_layers=1, vocab=1),
            r"n_heads must be >= 1",
        ),
        (
            lambda: ModelShape(hidden=64, n_heads=3, n_layers=1, vocab=1),
            r"pass head_dim explicitly",
        ),
        (
            lambda: ModelShape(hidden=64, n_heads=4, n_layers=1, vocab=1, ffn_hidden=0),
            r"ffn_hidden must be >= 1",
        ),
        (
            lambda: ModelShape(hidden=64, n_heads=4, n_layers=1, vocab=1.5),
            r"vocab must be an integer",
        ),  # type: ignore[arg-type]
    ],
)
def test_invalid_arguments_raise_value_error(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_error_messages_name_a_fix() -> None:
    with pytest.raises(ValueError, match=r": .*(use|pass|give|make|round|adjust|set)"):
        explicit_split([5, 4], 10, 2)
    with pytest.raises(ValueError, match=r"or set seq_chunks=2"):
        explicit_split([5, 5], 10, 3)


def test_masked_cost_profile_and_its_split() -> None:
    from seq1f1b.schedules.partition import attended_keys, profile_balanced_split, profile_flops

    # causal: p + 1 keys; documents [0,0,0,1,1]: restart at 3; window 2 with 1 sink
    assert attended_keys(5) == [1, 2, 3, 4, 5]
    assert attended_keys(5, [[0, 0, 0, 1, 1]]) == [1, 2, 3, 1, 2]
    assert attended_keys(5, window=2, sinks=1) == [1, 2, 3, 3, 3]
    assert attended_keys(4, [[0, 0, 1, 1], [0, 0, 0, 0]]) == [1, 2, 2, 3]  # mean of the rows
    shape = ModelShape(hidden=4096, n_heads=32, n_layers=32, vocab=50304)
    flops = profile_flops(attended_keys(32768), shape)
    assert sum(flops) == pytest.approx(segment_flops(32768, 32768, shape), rel=1e-12)
    lengths = profile_balanced_split(flops, 4)
    assert all(abs(a - b) <= 1 for a, b in zip(lengths, [11021, 8421, 7087, 6239], strict=True))
    # packed documents of 512 tokens: the balanced split is (close to) uniform, in multiples
    docs = [[p // 512 for p in range(8192)]]
    masked = profile_balanced_split(profile_flops(attended_keys(8192, docs), shape), 4, 8)
    assert sum(masked) == 8192 and all(n % 8 == 0 and abs(n - 2048) <= 16 for n in masked)


HYBRID = ModelShape(
    hidden=4096, n_heads=32, n_layers=32, vocab=50304, ffn_hidden=4 * 4096, head_dim=128,
    n_kv_heads=8, linear_attention=LinearAttention(24, 16, 32, 128, 128),
)  # fmt: skip


def test_linear_attention_layers_cost_the_same_at_every_position() -> None:
    """A hybrid stack's Gated DeltaNet layers cost a segment the same wherever it sits: only
    its softmax layers (a quarter here) grow with the position, so the compute split of a
    hybrid cuts nearly equal segments where a dense model's first is far longer."""
    dense = replace(HYBRID, linear_attention=None)
    for shape in (HYBRID, dense):
        grow = segment_flops(1024, 8192, shape) - segment_flops(1024, 4096, shape)
        attn = (4 * shape.head_dim + 3) * shape.n_heads * 1024 * 4096
        assert grow == pytest.approx(shape.softmax_layers * attn, rel=1e-12)
    assert HYBRID.softmax_layers == 8 and dense.softmax_layers == 32
    # the additivity the solver relies on holds for the hybrid too
    split = compute_balanced_split(32768, 4, HYBRID)
    ends = list(itertools.accumulate(split))
    total = sum(segment_flops(s, e, HYBRID) for s, e in zip(split, ends, strict=True))
    assert total == pytest.approx(segment_flops(32768, 32768, HYBRID), rel=1e-12)
    skew = split[0] / split[-1]
    dense_split = compute_balanced_split(32768, 4, dense)
    assert 1.0 < skew < dense_split[0] / dense_split[-1]


def test_linear_attention_state_is_priced_per_unit_not_per_token() -> None:
    """The state a Gated DeltaNet layer carries (fp32 delta-rule state and bf16 convolution
    tail) is the same for any segment length; the K/V a later segment needs is only the
    softmax layers'."""
    from seq1f1b.planning.costmodel import MemoryModel

    la = HYBRID.linear_attention
    assert la.state_bytes(2) == 4 * 32 * 128 * 128 + 2 * 3 * (2 * 16 * 128 + 32 * 128)
    memory = MemoryModel(HYBRID, recompute=True)
    per_token = memory.layer_bytes_per_token(segmented=True)
    dense = MemoryModel(replace(HYBRID, linear_attention=None), recompute=True)
    kv = 2 * 2 * 8 * 128
    assert dense.layer_bytes_per_token(True) - per_token == pytest.approx(kv * 24 / 32)
    for tokens in (1024, 8192):
        state = memory.unit_bytes(tokens, 8, False, True) - tokens * 8 * per_token
        assert state == pytest.approx(8 * 24 / 32 * la.state_bytes(2))
    with pytest.raises(ValueError, match=r"linear_attention\.layers = 32 must be in 1\.\.n_layers"):
        replace(HYBRID, linear_attention=LinearAttention(32, 16, 32, 128, 128))
