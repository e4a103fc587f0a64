"""The schedule's grouped arguments: how a sequence is cut (:class:`SequenceSplit`) and how it is
sharded over context-parallel ranks (:class:`ContextParallelConfig`).

One object per concern keeps the schedule's signature close to torch's (whose schedules take
the stages, the microbatch count, the loss and chunk specs) and puts each concern's validation
next to its data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _runtime as rt
from ..attention.context_parallel import CP_PREFIX_MODES
from ..attention.kv import ContextParallel
from ..orders.order import OrderSpec
from .mask_split import MaskSplitCache
from .partition import SPLIT_MODES, ModelShape, resolve_split, segment_multiple

__all__ = ["ContextParallelConfig", "SequenceSplit"]


def positive_int(name: str, value: Any, fix: str) -> int:
    """``value`` if it is an int >= 1, else a ValueError naming ``name`` and the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}): {fix}")
    return value


def check_counts(n_microbatches: Any, seq_chunks: Any, seq_dim: Any) -> tuple[int, int]:
    """M and K, checked with the schedule's other integer arguments (errors name the fix)."""
    m = positive_int("n_microbatches", n_microbatches, "pass the number of samples per step")
    k = positive_int("seq_chunks", seq_chunks, "pass 1 for plain 1F1B, or 2, 4, 8 ...")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 1:
        raise ValueError(
            f"seq_dim must be an integer >= 1 (got {seq_dim!r}): dim 0 is the batch dim "
            "that n_microbatches splits; pass the sequence dimension, usually 1"
        )
    return m, k


@dataclass(frozen=True)
class SequenceSplit:
    """How each sample's sequence is cut into ``seq_chunks`` segments.

    Args:
        mode: "uniform", "compute" (equal FLOPs; needs ``model_shape``) or explicit lengths.
            "memory_capped" (the fastest lengths in the simulator under an activation cap) is
            resolved by the planning layer: pass
            :class:`~seq1f1b.planning.split_search.MemoryCappedSplit`, which is a SequenceSplit.
        model_shape: transformer shape for ``mode="compute"`` (and ``"memory_capped"``).
        multiple_of: every segment length (with context parallelism: each rank's share of it)
            is a multiple of this (e.g. the TP degree).
        seq_len: sequence length, if fixed up front (the split is checked at construction and
            a step of another length is an error). Without it every step may have its own.
    """

    mode: str | tuple[int, ...] = "uniform"
    model_shape: ModelShape | None = None
    multiple_of: int = 1
    seq_len: int | None = None
    _cache: dict[tuple[int, int, OrderSpec | None], list[int]] = field(
        default_factory=dict, compare=False, repr=False
    )
    _mask_cache: MaskSplitCache = field(default_factory=MaskSplitCache, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str):
            object.__setattr__(self, "mode", tuple(self.mode))

    @classmethod
    def of(cls, split: SequenceSplit | str | Sequence[int]) -> SequenceSplit:
        """``split`` itself, or a SequenceSplit of that mode alone (a name or lengths)."""
        return split if isinstance(split, SequenceSplit) else cls(split)  # type: ignore[arg-type]

    def check(self, seq_chunks: int) -> None:
        """Raise ValueError (naming the fix) if this split cannot serve ``seq_chunks``."""
        positive_int("SequenceSplit.multiple_of", self.multiple_of, "pass 1, or the TP degree")
        if isinstance(self.mode, str):
            if self.mode not in SPLIT_MODES:
                raise ValueError(
                    f"seq_split={self.mode!r} is unknown: use one of {list(SPLIT_MODES)} or a list "
                    "of segment lengths"
                )
            if self.mode in ("compute", "memory_capped") and self.model_shape is None:
                raise ValueError(
                    f"seq_split={self.mode!r} needs the model shape: pass "
                    f"seq_split={type(self).__name__}({self.mode!r}, model_shape=ModelShape(...))"
                )
            if self.mode == "memory_capped" and not self.simulates_order:
                raise ValueError(
                    "seq_split='memory_capped' simulates the schedule's order, which the planning "
                    "layer does: pass seq_split=seq1f1b.MemoryCappedSplit(model_shape=..., "
                    "memory_cap=...) (a SequenceSplit)"
                )
        elif len(self.mode) != seq_chunks:
            raise ValueError(
                f"split has {len(self.mode)} lengths but seq_chunks={seq_chunks}: give exactly "
                "seq_chunks lengths, or change seq_chunks"
            )

    def lengths(
        self,
        seq_len: int,
        seq_chunks: int,
        cp_size: int = 1,
        order: OrderSpec | None = None,
        documents: Any = None,
    ) -> list[int]:
        """Segment lengths for a sequence of ``seq_len`` tokens (cached per length).

        ``order``: the schedule's shape, which ``"memory_capped"`` simulates. ``documents``:
        the step's ``document_ids`` (a tensor, or one per sample); ``"compute"`` then balances
        the FLOPs of that document mask (:mod:`seq1f1b.schedules.mask_split`, cached per layout).
        """
        plain = self._plain_lengths(seq_len, seq_chunks, cp_size, order)
        shape = self.model_shape
        masked = documents is not None or (shape is not None and shape.window is not None)
        if not (masked and self.mode == "compute" and seq_chunks > 1):
            return plain
        assert shape is not None  # check() ran at construction
        multiple = segment_multiple(self.multiple_of, cp_size)
        with rt.outside_fake_mode():  # host data, read as such (real ids in a dry run too)
            if documents is None:  # windows alone: one document per sample
                documents = torch.zeros(1, seq_len, dtype=torch.int64)
            balanced = self._mask_cache.lengths(documents, seq_chunks, shape, multiple_of=multiple)
        return balanced if sum(balanced) == seq_len else plain

    def sample_lengths(
        self,
        seq_len: int,
        seq_chunks: int,
        n_samples: int,
        cp_size: int = 1,
        order: OrderSpec | None = None,
        documents: Any = None,
    ) -> list[list[int]]:
        """Each sample's segment lengths. Without ``documents`` every sample is cut alike;
        with a step's ``document_ids`` (a (batch, seq_len) tensor, or one per sample) and
        ``"compute"``, each sample is balanced for its own documents: the pipeline runs at the
        pace of its costliest unit, and one cut for all samples would balance only their
        average."""
        if documents is None:
            return [self.lengths(seq_len, seq_chunks, cp_size, order)] * n_samples
        if isinstance(documents, torch.Tensor):
            documents = torch.tensor_split(documents, n_samples, dim=0)
        return [self.lengths(seq_len, seq_chunks, cp_size, order, d) for d in documents]

    def _plain_lengths(
        self, seq_len: int, seq_chunks: int, cp_size: int, order: OrderSpec | None
    ) -> list[int]:
        """The split of the mode without a mask (cached per length)."""
        key = (seq_len, cp_size, order if self.mode == "memory_capped" else None)
        if key not in self._cache:
            multiple = segment_multiple(self.multiple_of, cp_size)
            if cp_size > 1 and (seq_len % multiple or seq_len < multiple * seq_chunks):
                raise ValueError(
                    f"seq_len={seq_len} cannot be cut into {seq_chunks} segments that are "
                    f"each a multiple of {multiple} tokens (context parallelism over {cp_size} "
                    f"ranks cuts each segment into 2 * cp = {2 * cp_size} chunks, and each "
                    f"rank's share must be a multiple of multiple_of={self.multiple_of}): "
                    f"use a sequence length that is a multiple of {multiple} and at least "
                    f"{multiple * seq_chunks}, or fewer seq_chunks"
                )
            if self.mode == "memory_capped":
                self._cache[key] = self._capped(seq_len, seq_chunks, multiple, order)
                return self._cache[key]
            mode = self.mode if isinstance(self.mode, str) else list(self.mode)
            self._cache[key] = resolve_split(
                mode, seq_len, seq_chunks, shape=self.model_shape, multiple_of=multiple
            )
        return self._cache[key]

    #: whether :meth:`_capped` is implemented (by the planning layer's MemoryCappedSplit)
    simulates_order = False

    def _capped(
        self, seq_len: int, seq_chunks: int, multiple: int, order: OrderSpec | None
    ) -> list[int]:
        """The memory-capped lengths for the schedule's ``order``: the planning layer's."""
        raise NotImplementedError("MemoryCappedSplit (seq1f1b.planning.split_search)")


@dataclass(frozen=True)
class ContextParallelConfig:
    """Context parallelism: the group a stage's sequence is sharded over (ring attention).

    Args:
        group: the process group (e.g. ``device_mesh["cp"].get_group()``). Every CP rank
            passes the same whole batch; the schedule keeps its load-balanced share of each
            segment (every segment a multiple of ``2 * cp`` tokens).
        prefix: how a segment reaches the cached K/V of earlier segments on the other CP
            ranks: "pass_q" (its queries travel), "pass_kv" (the cache travels) or "auto"
            (whichever moves fewer bytes, per segment).
        reduce_grads: average parameter gradients over ``group`` at the end of ``step()``;
            False when FSDP/DDP over a mesh that includes CP averages them.
    """

    group: dist.ProcessGroup | None = None
    prefix: str = "auto"
    reduce_grads: bool = True

    def resolve(self) -> ContextParallel | None:
        """This rank's view of the group (None without context parallelism)."""
        if self.prefix not in CP_PREFIX_MODES:
            raise ValueError(
                f"cp_prefix={self.prefix!r} is unknown: use one of {list(CP_PREFIX_MODES)}"
            )
        if self.group is None:
            return None
        size = dist.get_world_size(self.group)
        if size < 1 or dist.get_rank(self.group) < 0:
            raise ValueError(
                "cp_group does not contain this rank: pass the context-parallel group this "
                "rank belongs to (e.g. device_mesh['cp'].get_group())"
            )
        if size == 1:
            return None
        return ContextParallel(self.group, dist.get_rank(self.group), size, self.prefix)
