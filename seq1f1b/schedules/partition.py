"""Segment lengths for splitting one sequence into ``k`` seq chunks.

Under causal attention a token attends to every earlier token, so equal-length
segments do not cost the same: later segments are more expensive. This module
provides a uniform split, a FLOPs-balanced ("compute") split and validation of
user-given lengths. Pure Python on purpose, so it can run before torch is set up.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from .upstream import _get_even_segment_lengths

SPLIT_MODES: tuple[str, ...] = ("uniform", "compute", "memory_capped")

# A root within this distance below an integer is treated as that integer, so
# floating-point noise (e.g. 6238.9999999 for an exact 6239) cannot flip the floor.
_ROOT_EPS = 1e-6


def _as_int(name: str, value: object) -> int:
    """Coerce an integer-like value (rejecting bool/float) so errors name the argument."""
    if isinstance(value, bool):
        # ValueError, not TypeError: callers catch one exception type for any bad config value.
        raise ValueError(f"{name} must be an integer (got {value!r}): pass an int, not a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{name} must be an integer (got {value!r} of type {type(value).__name__}): pass an int"
        ) from None


@dataclass(frozen=True)
class LatentKV:
    """Multi-head latent attention's K/V as the latent cache keeps it (DeepSeek-V3): ``rank``
    latent values (``kv_lora_rank``) and ``rope`` shared RoPE-key values a token a layer,
    expanded by one ``rank x expanded`` matmul (``wkv_b``: every head's K part and V,
    ``n_heads * (qk_nope_head_dim + v_head_dim)``) whenever a later segment reads them."""

    rank: int
    rope: int
    expanded: int

    @property
    def cached(self) -> int:
        """Values the latent cache keeps a token a layer."""
        return self.rank + self.rope

    def expand_flops(self, tokens: float) -> float:
        """FLOPs of re-expanding ``tokens`` positions of one layer's latent."""
        return 2.0 * tokens * self.rank * self.expanded


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid stack (Qwen3.5, Qwen3-Next): ``layers`` of the
    model's layers mix positions through a recurrent state instead of softmax attention:
    ``key_heads`` query/key heads of ``key_dim``, ``value_heads`` value heads of
    ``value_dim``, a causal convolution of ``conv_width`` taps over the q/k/v channels, the
    delta rule in chunks of ``chunk`` positions. Their work is linear in the sequence; what
    a later segment needs of an earlier one is the state, whatever its length."""

    layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int = 4
    chunk: int = 64

    @property
    def channels(self) -> int:
        """The convolved q/k/v channels."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def flops_per_token(self, hidden: int) -> float:
        """Forward FLOPs a token costs in one such layer: the projections (q, k, v, the output
        gate, the two gating signals, the output), the convolution, and the chunked delta
        rule (within a chunk, attention-like products over ``chunk`` positions; across
        chunks, the state read and update, ``dk x dv`` a value head each)."""
        v = self.value_heads * self.value_dim
        proj = 2 * hidden * (self.channels + v + 2 * self.value_heads) + 2 * v * hidden
        conv = 2 * self.conv_width * self.channels
        dk, dv = self.key_dim, self.value_dim
        per_head = 2 * self.chunk * (2 * dk + dv) + 6 * dk * dv
        return float(proj + conv + self.value_heads * per_head)

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes one layer carries from a segment to the next, a sample: the delta-rule state
        (fp32) and the convolution's last ``conv_width - 1`` inputs."""
        state = 4 * self.value_heads * self.key_dim * self.value_dim
        return state + dtype_bytes * (self.conv_width - 1) * self.channels


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape for the FLOPs model.

    ``ffn_hidden`` defaults to ``4 * hidden``, ``head_dim`` to ``hidden // n_heads`` and
    ``n_kv_heads`` to ``n_heads`` (grouped-query attention when fewer); all are resolved to ints
    at construction so readers never see ``None``. ``gated_ffn`` is a SwiGLU FFN (Llama: three
    ``H x F`` matrices instead of two).

    ``window`` / ``sinks``: a sliding window of that many keys (plus the first ``sinks``
    positions) on ``window_layers`` of the layers (None: all), as the model's
    ``ChunkAwareAttention`` modules have them; the mask-aware compute split prices them.

    ``ffn_total``: the FFN width whose weights a layer holds, where it differs from the width a
    token computes (``ffn_hidden``): a mixture of experts holds every routed expert (plus the
    shared ones) and runs ``top_k`` of them. FLOPs follow ``ffn_hidden``, weights (memory,
    FSDP traffic) ``ffn_total``; None: ``ffn_hidden``.

    ``latent_kv``: multi-head latent attention's compressed K/V (:class:`LatentKV`), which the
    latent K/V cache keeps instead of the expanded K and V (the planner prices both).

    ``linear_attention``: a hybrid stack's Gated DeltaNet layers (:class:`LinearAttention`);
    the heads above are the softmax-attention layers', which are the other layers.
    """

    hidden: int
    n_heads: int
    n_layers: int
    vocab: int
    ffn_hidden: int | None = None
    head_dim: int | None = None
    n_kv_heads: int | None = None
    gated_ffn: bool = False
    window: int | None = None
    sinks: int = 0
    window_layers: int | None = None
    ffn_total: int | None = None
    latent_kv: LatentKV | None = None
    linear_attention: LinearAttention | None = None

    @property
    def softmax_layers(self) -> int:
        """The layers with softmax attention (all but a hybrid's linear-attention ones)."""
        la = self.linear_attention
        return self.n_layers - (la.layers if la is not None else 0)

    def __post_init__(self) -> None:
        """Validate eagerly so a bad shape fails at config time, not mid-solve."""
        for name in ("hidden", "n_heads", "n_layers", "vocab"):
            value = _as_int(f"ModelShape.{name}", getattr(self, name))
            if value < 1:
                raise ValueError(
                    f"ModelShape.{name} must be >= 1 (got {name}={value}): pass a positive int"
                )
            object.__setattr__(self, name, value)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.head_dim is None:
            if self.hidden % self.n_heads != 0:
                raise ValueError(
                    f"ModelShape.head_dim defaults to hidden // n_heads, which needs "
                    f"hidden % n_heads == 0 (got hidden={self.hidden}, n_heads={self.n_heads}): "
                    f"pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_total is None:
            object.__setattr__(self, "ffn_total", self.ffn_hidden)
        for name in ("ffn_hidden", "head_dim", "n_kv_heads", "ffn_total"):
            value = _as_int(f"ModelShape.{name}", getattr(self, name))
            if value < 1:
                raise ValueError(
                    f"ModelShape.{name} must be >= 1 (got {name}={value}): "
                    f"pass a positive int or leave it as None for the default"
                )
            object.__setattr__(self, name, value)
        if self.window is not None:
            w = _as_int("ModelShape.window", self.window)
            if w < 1:
                raise ValueError(f"ModelShape.window must be >= 1 or None (got {w})")
            layers = self.n_layers if self.window_layers is None else self.window_layers
            layers = _as_int("ModelShape.window_layers", layers)
            if not 1 <= layers <= self.n_layers:
                raise ValueError(
                    f"ModelShape.window_layers = {layers} must be in 1..n_layers = "
                    f"{self.n_layers} (how many layers use the window)"
                )
            object.__setattr__(self, "window_layers", layers)
        if _as_int("ModelShape.sinks", self.sinks) < 0:
            raise ValueError(f"ModelShape.sinks must be >= 0 (got {self.sinks})")
        la = self.linear_attention
        if la is not None and not 1 <= la.layers < self.n_layers:
            raise ValueError(
                f"ModelShape.linear_attention.layers = {la.layers} must be in 1..n_layers-1 = "
                f"{self.n_layers - 1} (a hybrid keeps some softmax-attention layers)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelShape.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(grouped-query attention shares each K/V head among n_heads // n_kv_heads "
                "query heads)"
            )

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer block (norms excluded): Q, K, V, O and the FFN (all of
        its experts)."""
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attn + (3 if self.gated_ffn else 2) * self.hidden * self.ffn_total


def _coefficients(end: float, shape: ModelShape) -> tuple[float, float]:
    """Return (a, b) with FLOPs(s, end) = b*s - a*s**2, the form the solver needs."""
    hidden, heads, layers = shape.hidden, shape.n_heads, shape.n_layers
    ffn, d = shape.ffn_hidden, shape.head_dim
    assert ffn is not None and d is not None  # resolved in __post_init__
    attn = (4 * d + 3) * heads
    soft = shape.softmax_layers  # a hybrid's linear-attention layers: linear in the tokens
    a = soft * attn / 2
    proj = 4 * hidden * d * (heads + shape.n_kv_heads)  # Q, O: h heads; K, V: kv heads
    mlp = (6 if shape.gated_ffn else 4) * hidden * ffn
    b = 4 * hidden * shape.vocab + soft * (end * attn + proj) + layers * mlp
    if shape.linear_attention is not None:
        la = shape.linear_attention
        b += la.layers * la.flops_per_token(hidden)
    return a, b


def segment_flops(s: int, end: int, shape: ModelShape) -> float:
    """FLOPs of a segment of ``s`` tokens ending at absolute position ``end``.

    The tokens are ``end-s .. end-1``; each attends causally to all earlier tokens::

        FLOPs(s, P) = 4*s*H*V + L*[(s*P - s*s/2)*(4*d+3)*h + 8*s*H*h*d + 4*s*H*F]

    (REFERENCE's formula; with grouped-query attention the projections cost
    ``4*s*H*d*(h + h_kv)`` and a gated FFN ``6*s*H*F``.)

    The cost is exactly additive over any split of a prefix: with P_i the end of
    segment i, sum(s_i*P_i - s_i**2/2) = sum(s_i*P_{i-1} + s_i**2/2) = P**2/2.
    """
    s = _as_int("s", s)
    end = _as_int("end", end)
    if s < 1 or end < s:
        raise ValueError(
            f"segment_flops needs 1 <= s <= end (got s={s}, end={end}): "
            f"a segment cannot extend before position 0"
        )
    a, b = _coefficients(end, shape)
    return b * s - a * s * s


def _check_split_args(seq_len: object, k: object, multiple_of: object) -> tuple[int, int, int]:
    """Validate the shared (seq_len, k, multiple_of) triple with actionable messages."""
    seq_len = _as_int("seq_len", seq_len)
    k = _as_int("seq_chunks", k)
    multiple_of = _as_int("multiple_of", multiple_of)
    if k < 1:
        raise ValueError(
            f"seq_chunks must be >= 1 (got seq_chunks={k}): use seq_chunks=1 to disable splitting"
        )
    if multiple_of < 1:
        raise ValueError(
            f"multiple_of must be >= 1 (got multiple_of={multiple_of}): "
            f"pass the tensor-parallel size, or 1 for no constraint"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 (got seq_len={seq_len}): pass a non-empty sequence")
    if multiple_of == 1:
        if seq_len < k:
            raise ValueError(
                f"seq_chunks={k} needs seq_len >= {k} (got seq_len={seq_len}): "
                f"use a longer sequence, or at most {seq_len} seq_chunks"
            )
    elif seq_len < k * multiple_of or seq_len % multiple_of != 0:
        raise ValueError(
            f"seq_chunks={k} with multiple_of={multiple_of} needs seq_len >= {k * multiple_of} "
            f"and seq_len % {multiple_of} == 0 (got seq_len={seq_len}): use a sequence length "
            f"that is a multiple of {multiple_of}, or fewer seq_chunks"
        )
    return seq_len, k, multiple_of


def uniform_split(seq_len: int, k: int, multiple_of: int = 1) -> list[int]:
    """Near-equal lengths (multiples of ``multiple_of``), extra units to the earliest segments.

    Earlier segments are cheaper under causal attention, so they absorb the remainder.
    """
    seq_len, k, multiple_of = _check_split_args(seq_len, k, multiple_of)
    return [n * multiple_of for n in _get_even_segment_lengths(seq_len // multiple_of, k)]


def compute_balanced_split(
    seq_len: int, k: int, shape: ModelShape, multiple_of: int = 1
) -> list[int]:
    """Lengths whose segments have (nearly) equal FLOPs, so pipeline stages stay balanced.

    Solved from the end: with P the current end, the last unsolved segment gets the
    smaller positive root s of FLOPs(s, P) = total/k, then P -= s; the first segment
    takes the remainder. Later segments come out shorter.

    Rounding rule: each root is floored to an integer token count (this reproduces the
    published 7B example, seq_len=32768, k=4 -> [11021, 8421, 7087, 6239]; rounding to
    nearest gives [11020, 8421, 7088, 6239]). With multiple_of > 1 the floored length is
    then rounded to the nearest multiple (ties up), at least multiple_of. Every length is
    clamped so the earlier segments still get >= multiple_of each, and the result is
    returned longest-first (only reorders when coarse rounding made the remainder short).
    If rounding left the costliest segment costlier than under ``uniform_split`` (short
    sequences only), the uniform split is returned instead.
    """
    if not isinstance(shape, ModelShape):
        raise ValueError(
            f"compute_balanced_split needs a ModelShape (got {type(shape).__name__}): "
            f"pass shape=ModelShape(hidden=..., n_heads=..., n_layers=..., vocab=...)"
        )
    seq_len, k, multiple_of = _check_split_args(seq_len, k, multiple_of)
    target = segment_flops(seq_len, seq_len, shape) / k
    lengths: list[int] = []
    end = seq_len
    for earlier in range(k - 1, 0, -1):  # `earlier` segments remain before this one
        a, b = _coefficients(end, shape)
        disc = b * b - 4 * a * target
        if disc >= 0:
            # Smaller root of a*s^2 - b*s + target = 0, in the cancellation-free form.
            root = 2 * target / (b + math.sqrt(disc))
        else:
            # Target unreachable (cannot happen in exact arithmetic); take the costliest length.
            root = b / (2 * a)
        s = math.floor(root + _ROOT_EPS) if math.isfinite(root) else end
        s = (s + multiple_of // 2) // multiple_of * multiple_of
        s = max(multiple_of, min(s, end - earlier * multiple_of))
        lengths.append(s)
        end -= s
    lengths.append(end)
    # Rounding to coarse multiples can leave the remainder (first segment) shorter than a
    # later one, e.g. [8, 12, 12]. Sorting longest-first never raises the costliest segment:
    # swapping an adjacent short-then-long pair moves the long one to an earlier end and the
    # short one to the same end, and FLOPs grow with both length and end.
    lengths.sort(reverse=True)
    # Floor/multiple rounding dumps up to ~(k-1)*multiple_of tokens on the first segment;
    # for short sequences (few tokens per segment) that can make the bottleneck segment
    # costlier than with the uniform split, e.g. seq_len=30, k=16 -> [15, 1, ..., 1].
    # The pipeline runs at the pace of its costliest segment, so never return worse.
    uniform = uniform_split(seq_len, k, multiple_of)
    if _max_segment_flops(lengths, shape) > _max_segment_flops(uniform, shape):
        return uniform
    return lengths


def _max_segment_flops(lengths: Sequence[int], shape: ModelShape) -> float:
    """Cost of the costliest segment, which bounds the pipeline's step time."""
    end = 0
    worst = 0.0
    for s in lengths:
        end += s
        worst = max(worst, segment_flops(s, end, shape))
    return worst


def explicit_split(lengths: Sequence[int], seq_len: int, k: int, multiple_of: int = 1) -> list[int]:
    """Validate user-given lengths so a bad split fails before any pipeline runs."""
    seq_len, k, multiple_of = _check_split_args(seq_len, k, multiple_of)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ValueError(
            f"split lengths must be a list or tuple of ints (got {lengths!r}): "
            f"pass e.g. {uniform_split(seq_len, k, multiple_of)}"
        )
    if len(lengths) != k:
        raise ValueError(
            f"split has {len(lengths)} lengths but seq_chunks={k}: give exactly {k} lengths, "
            f"or set seq_chunks={len(lengths)}"
        )
    out = [_as_int(f"split[{i}]", x) for i, x in enumerate(lengths)]
    for i, x in enumerate(out):
        if x < 1:
            raise ValueError(
                f"split lengths must be positive (got split[{i}]={x}): make every length >= 1"
            )
        if x % multiple_of != 0:
            raise ValueError(
                f"split lengths must be a multiple of multiple_of={multiple_of} "
                f"(got split[{i}]={x}): round every length to a multiple of {multiple_of}"
            )
    if sum(out) != seq_len:
        raise ValueError(
            f"split lengths must sum to seq_len={seq_len} (got sum {sum(out)} for {out}): "
            f"adjust the lengths so they add up to {seq_len}"
        )
    return out


def segment_multiple(multiple_of: int, cp: int = 1) -> int:
    """What every segment length must be a multiple of: ``multiple_of`` positions per rank
    (e.g. the TP degree for sequence-parallel activations) on each of ``cp`` context-parallel
    ranks, whose load-balanced layout also cuts each segment into ``2 * cp`` equal chunks."""
    if cp == 1:
        return multiple_of
    return math.lcm(multiple_of * cp, 2 * cp)


def resolve_split(
    split: str | Sequence[int],
    seq_len: int,
    k: int,
    *,
    shape: ModelShape | None = None,
    multiple_of: int = 1,
) -> list[int]:
    """Turn a user-facing ``split`` option into concrete segment lengths."""
    if isinstance(split, str):
        if split == "uniform":
            return uniform_split(seq_len, k, multiple_of)
        if split == "compute":
            if shape is None:
                raise ValueError(
                    "seq_split='compute' needs the model shape: pass model_shape=ModelShape(...)"
                )
            return compute_balanced_split(seq_len, k, shape, multiple_of)
        if split == "memory_capped":
            raise ValueError(
                "seq_split='memory_capped' simulates the schedule's order, which resolve_split "
                "does not know: pass it to ScheduleSeq1F1B(seq_split=MemoryCappedSplit("
                "model_shape=...)), or call seq1f1b.planning.split_search.memory_capped_split"
            )
        allowed = ", ".join(repr(m) for m in SPLIT_MODES)
        raise ValueError(
            f"unknown seq_split={split!r}: use one of {allowed}, or a list of {k} segment lengths"
        )
    return explicit_split(split, seq_len, k, multiple_of)


def segment_offsets(lengths: Sequence[int]) -> list[int]:
    """Start offset of each segment, ``[0, l0, l0+l1, ...]``, for slicing the sequence."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or len(lengths) == 0:
        raise ValueError(
            f"lengths must be a non-empty list of ints (got {lengths!r}): pass segment lengths"
        )
    offsets: list[int] = []
    start = 0
    for i, x in enumerate(lengths):
        x = _as_int(f"lengths[{i}]", x)
        if x < 1:
            raise ValueError(
                f"lengths must be positive (got lengths[{i}]={x}): make every length >= 1"
            )
        offsets.append(start)
        start += x
    return offsets


def attended_keys(
    seq_len: int,
    document_ids: Sequence[Sequence[int]] | None = None,
    window: int | None = None,
    sinks: int = 0,
) -> list[float]:
    """Keys each position attends to under the mask, averaged over the batch rows.

    Causal alone gives ``p + 1`` at position ``p``; packed documents count only the keys of
    ``p``'s own document, a sliding window at most ``window`` (plus the ``sinks`` of the
    document). ``document_ids``: one list of ids per row (e.g. ``ids.tolist()``).
    """
    rows = document_ids if document_ids is not None else [[0] * seq_len]
    total = [0.0] * seq_len
    for row in rows:
        if len(row) != seq_len:
            raise ValueError(f"document_ids rows must have seq_len={seq_len} ids, got {len(row)}")
        start = 0
        for p in range(seq_len):
            if p and row[p] != row[p - 1]:
                start = p
            lo = start if window is None else max(start, p - window + 1)
            keys = p - lo + 1
            if window is not None:
                keys += max(0, min(sinks, lo) - start)
            total[p] += keys
    return [t / len(rows) for t in total]


def token_cost(shape: ModelShape) -> tuple[float, float]:
    """``(base, per_key)``: the forward FLOPs of a position that attends to ``n`` keys are
    ``base + per_key * n`` (its share of every matmul, plus attention per key; with ``p + 1``
    keys at position ``p`` they sum to :func:`segment_flops`)."""
    a, b0 = _coefficients(0, shape)  # b at end 0: the per-token cost without attention
    attn = 2 * a  # = L * (4d + 3) * h
    return b0 - 0.5 * attn, attn


def profile_flops(keys: Sequence[float], shape: ModelShape) -> list[float]:
    """Forward FLOPs of each position: its share of every matmul plus attention over ``keys``
    (the per-token form of :func:`segment_flops`: with ``p + 1`` keys they sum to it)."""
    base, per_key = token_cost(shape)
    return [base + per_key * x for x in keys]


def profile_balanced_split(flops: Sequence[float], k: int, multiple_of: int = 1) -> list[int]:
    """``k`` segment lengths with equal summed ``flops`` (one value per position), each a
    multiple of ``multiple_of``: the compute-balanced split for a masked sequence."""
    seq_len, k, multiple_of = _check_split_args(len(flops), k, multiple_of)
    total = math.fsum(flops)
    cuts, acc, target = [], 0.0, 1
    for p, f in enumerate(flops):
        acc += f
        if target < k and acc >= total * target / k:
            cuts.append(p + 1)
            target += 1
    return cuts_to_lengths(cuts, seq_len, k, multiple_of)


def cuts_to_lengths(cuts: Sequence[int], seq_len: int, k: int, multiple_of: int) -> list[int]:
    """``k`` segment lengths from ``k - 1`` cut positions, each rounded to ``multiple_of``,
    kept increasing and leaving every later segment at least ``multiple_of``."""
    bounds, last = [], 0
    for i, c in enumerate(cuts):
        c = max(last + multiple_of, round(c / multiple_of) * multiple_of)
        c = min(c, seq_len - (k - 1 - i) * multiple_of)
        bounds.append(c)
        last = c
    edges = [0, *bounds, seq_len]
    return [e - s for s, e in itertools.pairwise(edges)]
