"""torchtitan 0.3's text dataloader with each step's rows balanced by attention cost.

``[seq1f1b] balanced_packing = true`` swaps the trainer's ``HuggingFaceTextDataLoader.Config``
for :class:`BalancedTextDataLoader.Config` (same fields, plus the rows per step): the same
``HuggingFaceTextDataset``, wrapped in
:class:`~torchtitan_integration.balanced_packing.BalancedPackingDataset` so the rows one
data-parallel rank feeds per step are rebalanced among themselves before they are batched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader, HuggingFaceTextDataset

from ..balanced_packing import BalancedPackingDataset

__all__ = ["BalancedTextDataLoader", "balanced_dataloader"]


class BalancedTextDataLoader(ParallelAwareDataloader):
    """``HuggingFaceTextDataLoader`` over balanced groups of ``rows_per_step`` rows."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        rows_per_step: int = 1
        """Rows balanced together: the rows one data-parallel rank feeds per step
        (``training.local_batch_size``; the trainer sets it)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        if config.num_workers > 1:
            # each worker would balance its own share: groups would no longer be steps
            raise ValueError(
                f"[seq1f1b] balanced_packing needs one data-loading process per rank, not "
                f"dataloader num_workers = {config.num_workers}: set it to 0 or 1"
            )
        if config.rows_per_step % local_batch_size:
            raise ValueError(
                f"[seq1f1b] balanced_packing: rows per step ({config.rows_per_step}) must be "
                f"a multiple of the dataloader's batch ({local_batch_size}) so groups are steps"
            )
        text = HuggingFaceTextDataset(
            dataset_name=config.dataset,
            dataset_path=config.dataset_path,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            infinite=config.infinite,
        )
        super().__init__(
            BalancedPackingDataset(text, config.rows_per_step),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )


def balanced_dataloader(dataloader: Any, rows_per_step: int) -> BalancedTextDataLoader.Config:
    """``dataloader`` (torchtitan's ``HuggingFaceTextDataLoader.Config``, or ours) as
    :class:`BalancedTextDataLoader.Config` balancing ``rows_per_step`` rows at a time; any
    other dataloader is refused, naming it (its rows may not be packed text)."""
    if isinstance(dataloader, BalancedTextDataLoader.Config):
        return dataclasses.replace(dataloader, rows_per_step=rows_per_step)
    if type(dataloader) is not HuggingFaceTextDataLoader.Config:
        raise ValueError(
            f"[seq1f1b] balanced_packing works on torchtitan's HuggingFaceTextDataLoader, not "
            f"{type(dataloader).__qualname__}: set balanced_packing = false or use it"
        )
    fields = {f.name: getattr(dataloader, f.name) for f in dataclasses.fields(dataloader)}
    return BalancedTextDataLoader.Config(**fields, rows_per_step=rows_per_step)
