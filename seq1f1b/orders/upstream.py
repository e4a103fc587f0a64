"""The closed-form Seq1F1B order as proposed to torch: one implementation for both.

The code between the markers below is, character for character, what
``upstream/series/0006-*.patch`` adds to ``torch/distributed/pipelining/schedules.py`` for the
order (torch's style: 88 columns, its private names); ``tests/test_upstream_verbatim.py`` fails
if the two differ, so a fix is made once. This header binds the names that code reads in
torch's module to the seam's (:mod:`seq1f1b._runtime`), the only place private torch names
are used. :mod:`.order` builds the package's orders on it (zero-bubble halves, peaks, specs).
Not formatted by ruff (``pyproject.toml``): its layout is torch's.
"""

from __future__ import annotations

from .._runtime.ir import FORWARD as F
from .._runtime.ir import FULL_BACKWARD as B
from .._runtime.ir import Action as _Action
from .._runtime.ir import get_warmup_ops as _get_warmup_ops

__all__ = ["_get_seq1f1b_rank_ops", "_get_seq1f1b_rounds", "_get_seq1f1b_warmup_ops"]

# upstream: begin (torch/distributed/pipelining/schedules.py, patch 6)
def _get_seq1f1b_rounds(
    n_microbatches: int, seq_chunks: int, pp_group_size: int
) -> list[range]:
    """
    Split the samples of a Seq1F1B step into the rounds of the interleaved
    order.

    A round holds whole samples, so that the backwards of a sample, which run
    its segments in reverse, stay within one round, and at least
    ``pp_group_size`` units when there are enough samples, so that the ring of
    ranks stays busy. Rounds differ by at most one sample, the larger ones
    first.
    """
    samples_per_round = max(1, -(-pp_group_size // seq_chunks))
    number_of_rounds = max(1, n_microbatches // samples_per_round)
    base, extra = divmod(n_microbatches, number_of_rounds)
    rounds: list[range] = []
    start = 0
    for i in range(number_of_rounds):
        stop = start + base + (1 if i < extra else 0)
        rounds.append(range(start, stop))
        start = stop
    return rounds


def _get_seq1f1b_warmup_ops(
    rank: int,
    n_local_stages: int,
    units_per_round: int,
    pp_group_size: int,
    n_units: int,
    seq_chunks: int,
) -> int:
    """
    Calculate the number of warmup forwards of a Seq1F1B rank.

    With one stage per rank, 1F1B's ``pp_group_size - rank - 1`` plus
    ``seq_chunks - 1``, which lets the last stage forward every segment of a
    sample before it runs that sample's first (last-segment) backward. With
    several stages per rank, the interleaved warmup (see ``_get_warmup_ops``)
    over rounds of ``units_per_round`` units plus the same ``seq_chunks - 1``.
    """
    if n_local_stages == 1:
        warmup_ops = pp_group_size - rank - 1 + seq_chunks - 1
    else:
        warmup_ops = _get_warmup_ops(
            rank,
            n_local_stages,
            units_per_round,
            pp_group_size,
            n_units,
            multiply_factor=2,
        ) + (seq_chunks - 1)
    return min(warmup_ops, n_units * n_local_stages)


def _get_seq1f1b_rank_ops(
    rank: int,
    pp_group_size: int,
    n_local_stages: int,
    n_microbatches: int,
    seq_chunks: int,
) -> list[_Action | None]:
    """
    Build the compute-only Seq1F1B order of one rank in closed form.

    Unit ``u = m * seq_chunks + k`` is segment ``k`` of sample ``m``. The
    rank's forwards run, round by round (see ``_get_seq1f1b_rounds``), each
    local stage over the round's units in order; its backwards run, round by
    round, the local stages in reverse over the round's samples, each
    sample's segments last first. The order is ``warmup_ops`` forwards, then
    forward/backward pairs, then the remaining backwards.

    Entry ``i`` of every rank's forward (backward) list is the same (local
    stage, unit), and the warmup does not grow downstream, so a forward only
    waits for the same entry upstream (or, for a later local stage, for an
    entry of the previous round on the last rank) and a backward for the
    same entry downstream and for its own forward, which the warmup covers:
    the order cannot deadlock.
    """
    if n_local_stages == 1:
        rounds = [range(n_microbatches)]
    else:
        rounds = _get_seq1f1b_rounds(n_microbatches, seq_chunks, pp_group_size)
    n_units = n_microbatches * seq_chunks
    warmup_ops = _get_seq1f1b_warmup_ops(
        rank,
        n_local_stages,
        len(rounds[0]) * seq_chunks,
        pp_group_size,
        n_units,
        seq_chunks,
    )

    fwd_actions: list[_Action] = []
    bwd_actions: list[_Action] = []
    for samples in rounds:
        fwd_units = [m * seq_chunks + k for m in samples for k in range(seq_chunks)]
        bwd_units = [
            m * seq_chunks + k for m in samples for k in reversed(range(seq_chunks))
        ]
        for local_index in range(n_local_stages):
            stage_index = local_index * pp_group_size + rank
            fwd_actions.extend(_Action(stage_index, F, u) for u in fwd_units)
        for local_index in reversed(range(n_local_stages)):
            stage_index = local_index * pp_group_size + rank
            bwd_actions.extend(_Action(stage_index, B, u) for u in bwd_units)

    rank_ops: list[_Action | None] = list(fwd_actions[:warmup_ops])
    # zip stops at the last forward: the remaining backwards are the cooldown
    for fwd_action, bwd_action in zip(
        fwd_actions[warmup_ops:], bwd_actions, strict=False
    ):
        rank_ops.extend((fwd_action, bwd_action))
    rank_ops.extend(bwd_actions[len(fwd_actions) - warmup_ops :])
    return rank_ops
# upstream: end
