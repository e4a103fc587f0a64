"""Checks of lowered action lists that only tests need: every rank's lowered list at once, and
that each pair of ranks posts its receives in the order of the other's sends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from seq1f1b._runtime import WAIT_SEND_B, Action, ComputationType
from seq1f1b._runtime.lowering import LoweredOrders, SendRecvLowering
from seq1f1b._runtime.topology import StageTopology

__all__ = ["check_p2p_matching", "lower_all", "unproven_send_waits"]

_SEND_F, _SEND_B = ComputationType.SEND_F, ComputationType.SEND_B
_RECV_F, _RECV_B = ComputationType.RECV_F, ComputationType.RECV_B
_F, _B, _I = ComputationType.FORWARD, ComputationType.FULL_BACKWARD, ComputationType.BACKWARD_INPUT


def lower_all(
    actions: Mapping[int, Sequence[Action | None]],
    topology: StageTopology,
    n_microbatches: int,
    options: Mapping[str, Any] | None = None,
) -> dict[int, list[Action]]:
    """Every rank's lowered list: what the runtime runs on each rank."""
    return dict(LoweredOrders(SendRecvLowering(actions, topology, n_microbatches, options)))


def check_p2p_matching(lowered: Mapping[int, Sequence[Action]], topology: StageTopology) -> None:
    """Raise unless, for every pair of ranks, receives are posted in the order of the sends.

    Point-to-point messages between two ranks match in posting order (same tag), so a RECV
    out of order would silently receive another microbatch's tensor.
    """
    sent: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    received: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for r, acts in lowered.items():
        for a in acts:
            if a is None:
                continue
            g, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
            if kind in (_SEND_F, _SEND_B):
                dst = topology.next_of[g] if kind == _SEND_F else topology.prev_of[g]
                sent.setdefault((r, topology.rank_of[dst]), []).append((g, mb, kind == _SEND_F))
            elif kind in (_RECV_F, _RECV_B):
                src = topology.prev_of[g] if kind == _RECV_F else topology.next_of[g]
                key = (src, mb, kind == _RECV_F)
                received.setdefault((topology.rank_of[src], r), []).append(key)
    if sent != received:
        bad = sorted(k for k in sent.keys() | received.keys() if sent.get(k) != received.get(k))
        raise ValueError(f"SEND/RECV order differs between rank pairs {bad}")


def unproven_send_waits(
    lowered: Mapping[int, Sequence[Action]], topology: StageTopology
) -> dict[int, list[Action]]:
    """Per rank, the backward sends' waits not known to be free: those the peer's receiving
    backward has not happened before (by vector clocks over every rank's run: a rank's clock
    takes the sender's at each compute action that consumes a message). Also raises if the
    lists deadlock. A wait that is proven cannot stall: the gradient was received already."""
    clocks = {r: dict.fromkeys(lowered, 0) for r in lowered}
    sent: dict[tuple[bool, int, int], dict[int, int]] = {}  # (forward, stage, unit) -> clock
    consumer: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, unit) -> (rank, index)
    for r, acts in lowered.items():
        for i, a in enumerate(acts):
            if a.computation_type in (_B, _I):
                consumer.setdefault((a.stage_index, a.microbatch_index), (r, i))
    pos = dict.fromkeys(lowered, 0)
    unproven: dict[int, list[Action]] = {r: [] for r in lowered}
    rank_of, prev_of, next_of = topology.rank_of, topology.prev_of, topology.next_of
    progressed = True
    while progressed:
        progressed = False
        for r, acts in lowered.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                g, u, kind = a.stage_index, a.microbatch_index, a.computation_type
                src = prev_of[g] if kind == _F else next_of[g] if kind in (_B, _I) else -1
                if src >= 0 and rank_of[src] != r:  # consumes a message from another rank
                    msg = sent.get((kind == _F, src, u))
                    if msg is None:
                        break  # not sent yet
                    for q, t in msg.items():
                        clocks[r][q] = max(clocks[r][q], t)
                elif kind == WAIT_SEND_B:
                    peer = topology.sends_backward(g)
                    q, j = consumer[(peer, u)]
                    if clocks[r][q] <= j:
                        unproven[r].append(a)
                clocks[r][r] = pos[r] + 1
                if kind in (_SEND_F, _SEND_B):
                    sent[(kind == _SEND_F, g, u)] = dict(clocks[r])
                pos[r] += 1
                progressed = True
    stuck = {r: lowered[r][pos[r]] for r in lowered if pos[r] < len(lowered[r])}
    if stuck:
        raise AssertionError(f"the lowered lists deadlock at {stuck}")
    return unproven
