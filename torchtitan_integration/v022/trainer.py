"""torchtitan 0.2.2's Trainer with Seq1F1B's PP step (imports torchtitan: load after the CPU
patches)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torchtitan.train import Trainer

from seq1f1b import packed_documents

from ..common import TrainerCore
from ..patches import applied
from ..pipeline import check_world_size
from . import patches
from .model import block_causal, document_ids_from_eos
from .spec import schedule_shards_cp
from .validate import check_model_name


def warn_if_fp32(job_config: Any, parallel_dims: Any) -> None:
    """torchtitan 0.2.2 casts to bf16 only through FSDP (or autocast with nothing parallel):
    a config asking for bf16 under PP or TP without FSDP silently trains in fp32. Say so."""
    from torchtitan.tools.logging import logger

    from ..planner import TORCHTITAN_022

    asked = job_config.training.mixed_precision_param
    if asked == "float32":
        return
    pd = parallel_dims
    fsdp = pd.dp_shard * pd.cp if (pd.dp_shard_enabled or pd.cp_enabled) else 1
    if not TORCHTITAN_022.runs_in_bf16(pd.pp, pd.tp, fsdp):
        logger.warning(
            "[training] mixed_precision_param = %r is not applied: torchtitan 0.2.2 casts "
            "parameters only through FSDP (data_parallel_shard_degree > 1 or context "
            "parallelism) and autocasts only without PP/TP, so this run (pp=%d, tp=%d, no FSDP) "
            "trains in float32 (more memory, slower matmuls). Shard with FSDP, use torchtitan "
            "0.3 (FSDP at every degree), or set mixed_precision_param = 'float32' to say so",
            asked,
            pd.pp,
            pd.tp,
        )


class Seq1F1BTrainer(TrainerCore, Trainer):
    """torchtitan's Trainer with a PP step that backpropagates the token-mean loss (BitPipe's
    train step and the loss on every PP rank: :class:`..common.TrainerCore`)."""

    patch_list = patches

    def __init__(self, job_config: Any) -> None:
        import os

        check_world_size(job_config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
        check_model_name(job_config.model.name)  # before torchtitan looks the name up
        if job_config.seq1f1b.balanced_packing:
            raise ValueError(
                "[seq1f1b] balanced_packing = true needs torchtitan 0.3's text dataloader (its "
                "rows carry positions); on torchtitan 0.2.2 set it to false"
            )
        with applied(patches.TRAINER_INIT):  # patch 7
            super().__init__(job_config)
        warn_if_fp32(job_config, self.parallel_dims)

    @property
    def _documents(self) -> bool:
        """The flavor masks by packed document (torchtitan's block_causal)."""
        return block_causal(self.model_args)

    @property
    def _schedule_shards_cp(self) -> bool:
        """Context parallelism by the Seq1F1B schedule (it shards each segment itself)."""
        return schedule_shards_cp(self.parallel_dims, self.job_config)

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """With block_causal, no FlexAttention BlockMask (our attention takes the documents
        from ``document_ids`` instead); with the schedule's context parallelism, the whole
        sequence (the schedule keeps each rank's share); otherwise torchtitan's."""
        ours_cp = self._schedule_shards_cp
        if not self._documents and not ours_cp:
            return super().post_dataloading_process(input_dict, labels)
        if self.parallel_dims.cp_enabled and not ours_cp:
            raise ValueError(
                "block_causal flavors with context parallelism need a Seq1F1B pipeline "
                "schedule in this integration (its ring attention masks by document): set "
                "pipeline_parallel_schedule = 'Seq1F1B' with PP, or context_parallel_degree = 1"
            )
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return input_dict["input"], labels, extra_inputs, {}

    def _document_ids(self, input_dict: dict[str, torch.Tensor]) -> torch.Tensor | None:
        if not self._documents:
            return None
        return document_ids_from_eos(input_dict["input"], self.tokenizer.eos_id)

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: Any
    ) -> torch.Tensor:
        docs = self._document_ids(input_dict)
        if not self.parallel_dims.pp_enabled:
            with packed_documents(docs) if docs is not None else contextlib.nullcontext():
                return super().forward_backward_step(
                    input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
                )
        schedule = self.pp_schedule
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels
        )
        last = self.pp_has_last_stage
        targets, losses = (labels, []) if last else (None, None)
        loss_kwargs = {"global_valid_tokens": global_valid_tokens} if last else None
        if docs is not None:
            extra_kwargs = {**extra_kwargs, "document_ids": docs}  # every PP rank
        with self.train_context():
            if self.pp_has_first_stage:
                schedule.step(
                    inputs,
                    **extra_inputs,
                    **extra_kwargs,
                    target=targets,
                    losses=losses,
                    return_outputs=False,
                    loss_kwargs=loss_kwargs,
                )
            else:
                schedule.step(
                    **extra_kwargs,
                    target=targets,
                    losses=losses,
                    return_outputs=False,
                    loss_kwargs=loss_kwargs,
                )
        return self.pp_loss().of_units(losses)
