"""Checks of lowered action lists that only tests need: every rank's lowered list at once, and
that each pair of ranks posts its receives in the order of the other's sends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from seq1f1b._runtime import Action, ComputationType
from seq1f1b._runtime.lowering import LoweredOrders, SendRecvLowering
from seq1f1b._runtime.topology import StageTopology

__all__ = ["check_p2p_matching", "lower_all"]

_SEND_F, _SEND_B = ComputationType.SEND_F, ComputationType.SEND_B
_RECV_F, _RECV_B = ComputationType.RECV_F, ComputationType.RECV_B


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
