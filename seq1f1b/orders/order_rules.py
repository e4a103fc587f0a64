"""Seq1F1B's order rules, checked on any order (a loaded CSV, a hand-written list): per
sample and stage, forwards run segment 0..K-1 and K/V-carrying backwards K-1..0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .. import _runtime as rt
from .._runtime import Action

__all__ = ["check_order_rules", "runs_kv_backward"]


def runs_kv_backward(a: Action) -> bool:
    """Whether ``a`` runs its unit's backward through the attention (and so its K/V): a full
    backward, or the input half of a split one (on the first stage torch runs the whole
    backward in BACKWARD_WEIGHT, there being no input gradient)."""
    t = a.computation_type
    if t == rt.FULL_BACKWARD:
        return True
    return t == (rt.BACKWARD_WEIGHT if a.stage_index == 0 else rt.BACKWARD_INPUT)


def check_order_rules(order: Mapping[int, Sequence[Action | None]], seq_chunks: int) -> None:
    """Raise ValueError if ``order`` breaks Seq1F1B's rules (see the module docstring)."""
    compute = (rt.FORWARD, rt.FULL_BACKWARD, rt.BACKWARD_INPUT, rt.BACKWARD_WEIGHT)
    k = seq_chunks
    for rank, actions in order.items():
        next_f: dict[tuple[int, int], int] = {}
        next_b: dict[tuple[int, int], int] = {}
        for a in actions:
            if a is None:
                continue
            if a.computation_type not in compute:
                raise ValueError(
                    f"rank {rank}: action {a} is not a FORWARD or a (full or split) BACKWARD; "
                    "give compute-only orders (F, B, I, W)"
                )
            m, seg = divmod(a.microbatch_index, k)
            key = (a.stage_index, m)
            if a.computation_type == rt.FORWARD:
                if seg != next_f.get(key, 0):
                    raise ValueError(
                        f"rank {rank}: {a} runs segment {seg} of sample {m} forward out of "
                        "order; forwards must go 0..K-1"
                    )
                next_f[key] = seg + 1
            elif runs_kv_backward(a):
                if seg != next_b.get(key, k - 1):
                    raise ValueError(
                        f"rank {rank}: {a} runs segment {seg} of sample {m} backward out of "
                        "order; backwards must go K-1..0 (a later segment leaves K/V "
                        "gradients for the earlier ones)"
                    )
                next_b[key] = seg - 1
