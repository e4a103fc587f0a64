"""The tile merge (seq1f1b.attention.tiles): its log-sum-exp weight and in-place merge equal
the plain formula, ``where(isfinite(new), exp(lse - new), 0)`` with the LSE copied back, bit
for bit, on finite, -inf, +inf and NaN log-sum-exps and on strided accumulators, in fewer ops
(the merge runs once per tile after a segment's first)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from seq1f1b import _runtime as rt
from seq1f1b.attention import tiles

pytestmark = pytest.mark.fast

INF, NAN = float("inf"), float("nan")


def _reference_weight(lse_acc: torch.Tensor, lse: torch.Tensor):
    new = torch.logaddexp(lse_acc, lse)
    return new, torch.where(torch.isfinite(new), torch.exp(lse - new), 0.0).unsqueeze(-1)


def _reference_merge_into(out_acc, lse_acc, o, lse) -> None:
    new, weight = _reference_weight(lse_acc, lse)
    out_acc.lerp_(o.to(out_acc.dtype), weight)
    lse_acc.copy_(new)


def _lse_pairs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pairing of special values, then random ones (large gaps included)."""
    special = torch.tensor([-INF, INF, NAN, 0.0, -3.5, 80.0, -80.0, 1e30, -1e30], dtype=dtype)
    a, b = torch.meshgrid(special, special, indexing="ij")
    g = torch.Generator().manual_seed(0)
    ra = torch.randn(4096, generator=g, dtype=dtype) * 30
    rb = torch.randn(4096, generator=g, dtype=dtype) * 30
    return torch.cat([a.flatten(), ra]), torch.cat([b.flatten(), rb])


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal bit for bit, any NaN matching any NaN (NaN payloads are not compared)."""
    nan = torch.isnan(x)
    return torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_weight_equals_the_plain_formula_bitwise(dtype: torch.dtype) -> None:
    lse_acc, lse = _lse_pairs(dtype)
    new, weight = tiles._merge_weight(lse_acc, lse)
    ref_new, ref_weight = _reference_weight(lse_acc, lse)
    assert _same_bits(new, ref_new)
    assert torch.equal(weight, ref_weight)  # never NaN: 0 wherever the merged LSE is not finite
    assert not torch.isnan(weight).any() and ((weight >= 0) & (weight <= 1)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_into_strided_accumulators_equals_the_plain_merge_bitwise(dtype) -> None:
    """As the tile loop calls it: views of the accumulators (rows and query positions), a
    tile's output in the kernel's dtype, its LSE in the accumulator's."""
    g = torch.Generator().manual_seed(1)
    lse_acc_flat, lse_flat = _lse_pairs(torch.float32)
    n = lse_flat.numel() // 4 * 4
    shape = (2, 2, n // 4)  # (batch, heads, queries)
    out = torch.randn(3, 2, n // 4 + 5, 16, generator=g)
    lse_acc = torch.randn(3, 2, n // 4 + 5, generator=g)
    lse_acc[1:3, :, 5:] = lse_acc_flat[:n].view(shape)
    o = torch.randn(*shape, 16, generator=g).to(dtype)
    lse = lse_flat[:n].view(shape)
    got_out, got_lse = out.clone(), lse_acc.clone()
    ref_out, ref_lse = out.clone(), lse_acc.clone()
    tiles.merge_into(got_out[1:3, :, 5:], got_lse[1:3, :, 5:], o, lse)
    _reference_merge_into(ref_out[1:3, :, 5:], ref_lse[1:3, :, 5:], o, lse)
    assert _same_bits(got_out, ref_out) and _same_bits(got_lse, ref_lse)
    merged, merged_lse = tiles.merge(out[1:3, :, 5:], lse_acc[1:3, :, 5:], o, lse)
    assert _same_bits(merged, ref_out[1:3, :, 5:]) and _same_bits(merged_lse, ref_lse[1:3, :, 5:])


class _Ops(rt.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_merge_into_runs_six_ops() -> None:
    """logaddexp (into the accumulator), sub, exp, nan_to_num_, the tile output's cast and
    the lerp: no isfinite (four ops), where, scalar wrap or copy back (twelve before)."""
    out, lse_acc = torch.zeros(1, 2, 8, 4), torch.full((1, 2, 8), -INF)
    o, lse = torch.randn(1, 2, 8, 4).to(torch.bfloat16), torch.randn(1, 2, 8)
    with _Ops() as counted:
        tiles.merge_into(out, lse_acc, o, lse)
    assert sum(counted.ops.values()) == 6, counted.ops
    with _Ops() as before:
        _reference_merge_into(out.clone(), lse_acc.clone(), o, lse)
    assert sum(before.ops.values()) == 12 + 2, before.ops  # the two clones here
