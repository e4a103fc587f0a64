"""Keeping BitPipe's two replicas one model: pair groups, start-up broadcast, gradient sync.

Ranks ``r`` and ``pp-1-r`` hold the same four layer chunks (one as replica A, one as B). Their
gradients are summed over a 2-rank process group, one flat bucket per chunk, started
asynchronously the moment the chunk's last backward is done and waited at the end of
``step()``. Collectives on a group match in issue order, so both partners must issue the
buckets in the same chunk order with the same sizes: BitPipe's orders are mirror images across
partners (checked when the schedule is built) and :meth:`PairGradSync.check_twins` compares
the bucket sizes once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._runtime import PipelineStageBase, flatten_dense_tensors, unflatten_dense_tensors
from .layout import BitPipeLayout

__all__ = [
    "PairGradSync",
    "broadcast_twins",
    "exchange_losses",
    "new_pair_group",
    "owned_parameters",
    "pair_ranks",
]


def pair_ranks(pp_ranks: Sequence[int]) -> list[list[int]]:
    """Global ranks of each pair ``(r, pp-1-r)`` of one pipeline group."""
    p = len(pp_ranks)
    return [sorted((pp_ranks[r], pp_ranks[p - 1 - r])) for r in range(p // 2)]


def new_pair_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """This rank's 2-rank group with its BitPipe partner in pipeline group ``group``.

    Creating groups is collective over the default group: every rank calls this. When the
    pipeline group is a subgroup (e.g. with data parallel), all pipeline groups are gathered
    so that every rank creates the same pair groups in the same order.
    """
    world = dist.get_world_size()
    pp_ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    BitPipeLayout(len(pp_ranks))  # pp even, >= 2
    if len(pp_ranks) == world:
        groups = [pp_ranks]
    else:
        gathered: list[list[int] | None] = [None] * world
        dist.all_gather_object(gathered, pp_ranks)
        groups = sorted({tuple(g) for g in gathered if g is not None})  # type: ignore[misc]
    pairs = sorted(pair for g in groups for pair in pair_ranks(list(g)))
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    if mine is None:  # pragma: no cover - every pipeline rank is in a pair
        raise RuntimeError("this rank is in no BitPipe pair")
    return mine


# (parameters, their local gradients, the flat all-reduce buffer, its handle)
_Bucket = tuple[list[torch.nn.Parameter], list[torch.Tensor], torch.Tensor, dist.Work]


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


@torch.no_grad()
def broadcast_twins(
    stages: Sequence[PipelineStageBase], layout: BitPipeLayout, pair_group: dist.ProcessGroup
) -> None:
    """Copy every chunk's parameters and buffers from its replica-A copy to its B twin.

    Both partners walk the same four chunks in ascending order, so the broadcasts match.
    """
    me = dist.get_rank(pair_group)
    for stage in sorted(stages, key=lambda s: layout.chunk(s.stage_index)):
        src = me if layout.replica(stage.stage_index) == 0 else 1 - me
        for t in _tensors(stage.submod):  # FSDP/TP: twins hold the same local shards
            dist.broadcast(_local(t.data), group=pair_group, group_src=src)


class PairGradSync:
    """Sums each chunk's gradients with its twin's, one async all-reduce per chunk.

    ``owned`` maps a stage to the parameters it reduces: a parameter shared by two local stages
    (a tied embedding and output head) belongs only to the stage whose gradients are final
    last, so it is scaled and reduced exactly once.
    """

    def __init__(
        self,
        pair_group: dist.ProcessGroup,
        order: Sequence[int],
        owned: dict[int, list[torch.nn.Parameter]],
    ) -> None:
        self.pair_group = pair_group
        self.order = list(order)
        self.owned = owned
        self._pending: list[_Bucket] = []

    def reset(self) -> None:
        self._pending.clear()

    def check_twins(self, device: torch.device) -> None:
        """Fail clearly (not hang) if the partner's buckets differ from ours."""
        sizes = [sum(p.numel() for p in self.owned[g]) for g in self.order]
        mine = torch.tensor(sizes, dtype=torch.int64, device=device)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.pair_group)
        if not torch.equal(both[0], both[1]):
            raise RuntimeError(
                "BitPipe: the partner rank's chunks have different parameters "
                f"(gradient bucket sizes {both[0].tolist()} vs {both[1].tolist()}); both "
                "replicas must be built from the same layer chunks (see build_bitpipe_stages)"
            )

    def start(self, stage_index: int, scale: float) -> None:
        """Scale this stage's final local gradients and start summing them with the twin."""
        params = self.owned[stage_index]
        if not params:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = flatten_dense_tensors([_local(g) for g in grads])
            if scale != 1:
                flat.div_(scale)
            work = dist.all_reduce(flat, group=self.pair_group, async_op=True)
            assert work is not None
            self._pending.append((group, grads, flat, work))

    def finish(self) -> None:
        """Wait for every started all-reduce and write the sums back as the gradients."""
        for params, grads, flat, work in self._pending:
            work.wait()
            local = [_local(g) for g in grads]
            for p, g, dst, synced in zip(
                params, grads, local, unflatten_dense_tensors(flat, local), strict=True
            ):
                dst.copy_(synced)
                if p.grad is None:  # unused here: the sum of zeros and the twin's gradient
                    p.grad = g
        self._pending.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor gradient (FSDP/TP), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def owned_parameters(
    stages: Sequence[PipelineStageBase], order: list[int]
) -> dict[int, list[torch.nn.Parameter]]:
    """Each stage's parameters as registered now (in reduce ``order``); a shared one belongs
    to the stage reduced last."""
    by_index = {s.stage_index: s for s in stages}
    owned: dict[int, list[torch.nn.Parameter]] = {}
    taken: set[int] = set()
    for g in reversed(order):
        params = [p for p in dict.fromkeys(by_index[g].submod.parameters()) if p.requires_grad]
        owned[g] = [p for p in params if id(p) not in taken]
        taken.update(id(p) for p in params)
    return owned


def exchange_losses(
    layout: BitPipeLayout,
    pair_group: dist.ProcessGroup,
    replica: int,
    unit_losses: dict[int, torch.Tensor],
    n_microbatches: int,
) -> list[torch.Tensor]:
    """All M losses on a rank holding a last stage: its replica's (kept as computed) and the
    partner's (received, detached), in microbatch order."""
    m = n_microbatches
    mine = layout.microbatches(replica, m)
    theirs = layout.microbatches(1 - replica, m)
    missing = [mb for mb in mine if mb not in unit_losses]
    if missing:
        raise RuntimeError(f"BitPipe: no losses for microbatches {missing}")
    kept = {mb: _plain(unit_losses[mb]) for mb in mine}
    local = torch.stack([kept[mb].detach() for mb in mine])
    both = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(both, local, group=pair_group)
    other = both[1 - dist.get_rank(pair_group)]
    out: dict[int, torch.Tensor] = dict(kept)
    out.update({mb: other[i] for i, mb in enumerate(theirs)})
    return [out[mb] for mb in range(m)]


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A DTensor loss (TP's loss parallel) as a plain tensor: c10d collectives and the
    partner's received losses are plain, and one list must not mix the two."""
    full = getattr(loss, "full_tensor", None)
    return full() if callable(full) else loss
