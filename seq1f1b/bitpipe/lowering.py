"""Lowering BitPipe compute orders to torch's runtime IR, and replaying the result.

torch's ``_add_send_recv`` and ``_simulate_comms_compute`` assume stage ``s`` always feeds
``s+1`` unless ``s`` is the global last stage, and that only stage 0 takes root inputs. With two
replicas in one id space that would send replica A's output into replica B's first stage. The
passes here are torch's algorithms with the pipeline ends taken per replica
(:class:`~seq1f1b.bitpipe.layout.BitPipeLayout`): the same lock-step placement of each RECV at
the moment its SEND is scheduled (so every pair of ranks posts receives in send order, which is
how gloo/NCCL match point-to-point messages), and the same dependency replay. FSDP
UNSHARD/RESHARD and REDUCE_GRAD insertion are torch's own passes, per rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _add_unshard_reshard,
    _ComputationType,
)

from .layout import BitPipeLayout

__all__ = ["add_send_recv", "check_p2p_matching", "lower_bitpipe", "simulate_comms"]

_F = _ComputationType.FORWARD
_B = _ComputationType.FULL_BACKWARD
_I = _ComputationType.BACKWARD_INPUT
_SEND_F = _ComputationType.SEND_F
_RECV_F = _ComputationType.RECV_F
_SEND_B = _ComputationType.SEND_B
_RECV_B = _ComputationType.RECV_B
_COMMS = (_SEND_F, _RECV_F, _SEND_B, _RECV_B)


def _peer_stage(a: _Action, layout: BitPipeLayout) -> int | None:
    """Stage that a compute action sends to (F: next, B/I: previous), within its replica."""
    if a.computation_type == _F:
        return layout.next_stage(a.stage_index)
    if a.computation_type in (_B, _I):
        return layout.prev_stage(a.stage_index)
    return None


def _sends(a: _Action, layout: BitPipeLayout) -> bool:
    peer = _peer_stage(a, layout)
    return peer is not None and layout.rank_of(peer) != layout.rank_of(a.stage_index)


def _inputs_ready(a: _Action, seen: set[_Action], layout: BitPipeLayout) -> bool:
    """A compute action's input is on the rank: received, or made by a same-rank stage."""
    g, mb = a.stage_index, a.microbatch_index
    if a.computation_type == _F:
        prev = layout.prev_stage(g)
        return prev is None or _Action(g, _RECV_F, mb) in seen or _Action(prev, _F, mb) in seen
    if a.computation_type in (_B, _I):
        nxt = layout.next_stage(g)
        return (
            nxt is None
            or _Action(g, _RECV_B, mb) in seen
            or _Action(nxt, _B, mb) in seen
            or _Action(nxt, _I, mb) in seen
        )
    return True


def add_send_recv(
    actions: Mapping[int, Sequence[_Action | None]], layout: BitPipeLayout
) -> dict[int, list[_Action]]:
    """torch's ``_add_send_recv`` with per-replica pipeline ends (same lock-step algorithm)."""
    queues = {r: deque(a for a in actions[r] if a is not None) for r in sorted(actions)}
    out: dict[int, list[_Action]] = {r: [] for r in queues}
    seen: dict[int, set[_Action]] = {r: set() for r in queues}
    while any(queues.values()):
        progress = False
        for r, queue in queues.items():
            if not queue or not _inputs_ready(queue[0], seen[r], layout):
                continue
            a = queue.popleft()
            out[r].append(a)
            seen[r].add(a)
            if _sends(a, layout):
                fwd = a.computation_type == _F
                send = _Action(a.stage_index, _SEND_F if fwd else _SEND_B, a.microbatch_index)
                peer = _peer_stage(a, layout)
                assert peer is not None
                recv = _Action(peer, _RECV_F if fwd else _RECV_B, a.microbatch_index)
                dst = layout.rank_of(peer)
                out[r].append(send)
                seen[r].add(send)
                out[dst].append(recv)
                seen[dst].add(recv)
            progress = True
        if not progress:
            heads = {r: q[0] for r, q in queues.items() if q}
            raise ValueError(f"BitPipe order cannot be lowered: every rank waits ({heads})")
    return out


def lower_bitpipe(
    actions: Mapping[int, Sequence[_Action | None]],
    layout: BitPipeLayout,
    microbatches_per_stage: int,
) -> dict[int, list[_Action]]:
    """Compute-only orders -> the runtime's IR: UNSHARD/RESHARD, REDUCE_GRAD, SEND/RECV."""
    staged = {
        r: _add_reduce_grad(_add_unshard_reshard(list(acts)), microbatches_per_stage)
        for r, acts in actions.items()
    }
    return add_send_recv(staged, layout)


def simulate_comms(lowered: Mapping[int, Sequence[_Action]], layout: BitPipeLayout) -> int:
    """torch's ``_simulate_comms_compute`` replay with per-replica ends; returns its steps.

    Each step every rank runs its next action if it is ready (a RECV once the peer posted the
    SEND, a compute once its input was received or made locally, a SEND after its compute);
    other actions (REDUCE_GRAD, UNSHARD, RESHARD) are always ready. Raises if no rank moves.
    """
    pending = {r: deque(a for a in acts if a is not None) for r, acts in lowered.items()}
    done: dict[int, set[_Action]] = {r: set() for r in pending}

    def ready(a: _Action) -> bool:
        g, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
        own = done[layout.rank_of(g)]
        if kind in (_F, _B, _I):
            return (kind == _F or _Action(g, _F, mb) in own) and _inputs_ready(a, own, layout)
        if kind == _SEND_F:
            return _Action(g, _F, mb) in own
        if kind == _SEND_B:
            return _Action(g, _B, mb) in own or _Action(g, _I, mb) in own
        if kind in (_RECV_F, _RECV_B):
            peer = g - 1 if kind == _RECV_F else g + 1
            send = _SEND_F if kind == _RECV_F else _SEND_B
            return _Action(peer, send, mb) in done[layout.rank_of(peer)]
        return True

    steps = 0
    while any(pending.values()):
        ran = [(r, q[0]) for r, q in pending.items() if q and ready(q[0])]
        if not ran:
            heads = {r: q[0] for r, q in pending.items() if q}
            raise ValueError(f"BitPipe schedule is not progressing: next actions {heads}")
        for r, a in ran:
            pending[r].popleft()
            done[r].add(a)
        steps += 1
    return steps


def check_p2p_matching(lowered: Mapping[int, Sequence[_Action]], layout: BitPipeLayout) -> None:
    """Raise unless, for every pair of ranks, receives are posted in the order of the sends.

    Point-to-point messages between two ranks match in posting order (same tag), so a RECV
    out of order would silently receive another microbatch's tensor.
    """
    sent: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    received: dict[tuple[int, int], list[tuple[int, int, bool]]] = {}
    for r, acts in lowered.items():
        for a in acts:
            if a is None or a.computation_type not in _COMMS:
                continue
            g, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
            if kind in (_SEND_F, _SEND_B):
                dst_stage = g + 1 if kind == _SEND_F else g - 1
                key = (g, mb, kind == _SEND_F)
                sent.setdefault((r, layout.rank_of(dst_stage)), []).append(key)
            else:
                src_stage = g - 1 if kind == _RECV_F else g + 1
                key = (src_stage, mb, kind == _RECV_F)
                received.setdefault((layout.rank_of(src_stage), r), []).append(key)
    if sent != received:
        bad = sorted(k for k in sent.keys() | received.keys() if sent.get(k) != received.get(k))
        raise ValueError(f"BitPipe SEND/RECV order differs between rank pairs {bad}")
