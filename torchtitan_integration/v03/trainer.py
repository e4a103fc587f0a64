"""torchtitan 0.3's Trainer with a ``seq1f1b`` config section and Seq1F1B's PP step.

``Seq1F1BTrainer.Config`` is ``Trainer.Config`` plus ``seq1f1b`` (tyro parses
``--seq1f1b.seq_chunks 4``), and ``config.build()`` builds this trainer, so torchtitan's own
``python -m torchtitan.train --module torchtitan_integration --config ...`` runs it. The
trainer binds the model spec's ``pipelining_fn`` to the section (0.3 passes it none), makes
the attention chunk-aware, cuts nothing itself (the schedule cuts each pre-split microbatch's
tokens, labels and ``positions`` per segment) and gives every rank the documents as
``document_ids`` derived from ``positions`` instead of a full-sequence BlockMask.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.trainer import Trainer

from seq1f1b import packed_documents
from seq1f1b.registry import lookup

from .. import assets
from ..common import TrainerCore, fsdp_reductions_for_gloo
from ..config import Seq1F1B
from ..patches import applied
from ..pipeline import check_schedule_name, check_world_size
from . import _titan, patches
from .checkpointing import saving_chunk_aware_attention
from .dataloader import balanced_dataloader
from .model import default_positions, document_ids_from_positions
from .models import ModelFamily, family_of
from .pipeline import pipeline_seq1f1b
from .validate import check_torch_for_parallelism, loss_with_chunks, validate_before_start


def _parallelize_chunk_aware(parallelize_fn: Any, family: ModelFamily | None) -> Any:
    """torchtitan's parallelize_fn, after making the attention chunk-aware the ``family``'s
    way (PP = 1 and Seq1F1B stages; None: torch's schedules, unchanged; selective AC then
    saves it too), with gloo-compatible FSDP reductions; under the schedule's context
    parallelism through the family's ``parallelize_under_cp`` where it has one."""

    @functools.wraps(parallelize_fn)
    def wrapped(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        fn = parallelize_fn
        if family is not None:
            family.make_chunk_aware(model)
            if "ac_config" in kwargs:
                kwargs["ac_config"] = saving_chunk_aware_attention(kwargs["ac_config"])
            dims = kwargs.get("parallel_dims")
            if family.parallelize_under_cp is not None and dims is not None and dims.cp_enabled:
                fn = family.parallelize_under_cp(parallelize_fn)
        model = fn(model, **kwargs)
        fsdp_reductions_for_gloo(model)
        return model

    return wrapped


def _chunk_aware_validator(validator: Any) -> Any:
    """torchtitan's Validator config as :class:`.validator.Seq1F1BValidator`'s (same fields)."""
    from torchtitan.components.validate import Validator

    from .validator import Seq1F1BValidator

    if type(validator) is not Validator.Config:
        return validator  # already ours, or a custom validator: left as the user set it
    fields = {f.name: getattr(validator, f.name) for f in dataclasses.fields(validator)}
    return Seq1F1BValidator.Config(**fields)


def log_precision(config: Any) -> None:
    """Say which precision trains (torchtitan 0.3 wraps the model in FSDP at every degree, 1
    included, so ``mixed_precision_param`` always applies), once, at start-up."""
    from torchtitan.tools.logging import logger

    training = config.training
    logger.info(
        "Seq1F1B: precision: parameters and compute in %s (FSDP mixed precision at every "
        "data_parallel_shard_degree, 1 included), gradients reduced in %s, optimizer state in "
        "float32",
        training.mixed_precision_param,
        training.mixed_precision_reduce,
    )


class Seq1F1BTrainer(TrainerCore, Trainer):
    """0.3's Trainer running the Seq1F1B schedules (and everything else unchanged; BitPipe's
    train step and the loss on every PP rank: :class:`..common.TrainerCore`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        seq1f1b: Seq1F1B = field(default_factory=Seq1F1B)
        """Seq1F1B: segments per sample, how to split, stages per rank (interleaved)."""

    patch_list = patches

    def __init__(self, config: Config) -> None:
        if config.model_spec is None:
            raise ValueError("Seq1F1BTrainer.Config.model_spec must be set (a config function)")
        check_schedule_name(config.parallelism.pipeline_parallel_schedule)
        check_world_size(config.parallelism, int(os.environ.get("WORLD_SIZE", "1")))
        validate_before_start(config)
        config.loss = loss_with_chunks(config.loss, config.seq1f1b.loss_chunks)
        check_torch_for_parallelism(config.parallelism)  # this torch can run these degrees
        spec = config.model_spec
        ours = self._chunk_aware(config)
        pp = config.parallelism.pipeline_parallel_degree > 1
        # the attention becomes chunk-aware unless torch's own schedules run: the model's
        # family must be known then (refused at start-up, on every rank, naming those known)
        family = family_of(spec, config.seq1f1b.kv_cache) if ours or not pp else None
        if family is not None:
            config.validator = _chunk_aware_validator(config.validator)
        if config.seq1f1b.balanced_packing:  # each step's rows balanced among themselves
            from torchtitan.tools.logging import logger

            rows = config.training.local_batch_size
            config.dataloader = balanced_dataloader(config.dataloader, rows)
            logger.info("Seq1F1B: balanced packing: each step's %d rows regrouped by their "
                        "documents' attention cost", rows)  # fmt: skip
        base_pipelining = spec.pipelining_fn
        if getattr(base_pipelining, "func", None) is pipeline_seq1f1b:
            base_pipelining = base_pipelining.keywords["base_pipelining_fn"]
        config.model_spec = dataclasses.replace(
            spec,
            pipelining_fn=functools.partial(
                pipeline_seq1f1b, trainer_config=config, base_pipelining_fn=base_pipelining
            ),
            parallelize_fn=_parallelize_chunk_aware(
                getattr(spec.parallelize_fn, "__wrapped__", spec.parallelize_fn), family
            ),
        )
        assets.ensure_assets()  # the offline tokenizer and corpus, once, in ./assets
        # dataset "pycode" (and "pycode_blocks") for the dataloader
        assets.register_dataset(_titan.DATASET_CONFIG.get(), _titan.DATASETS.get())
        self._patches = patches.install_cpu()  # patches 1-5 until close()
        try:
            with applied(patches.TRAINER_INIT):  # patch 7
                super().__init__(config)
        except BaseException:
            self._undo_patches()
            raise
        log_precision(config)

    @staticmethod
    def _chunk_aware(config: Any) -> bool:
        """Our schedule runs this PP: a Seq1F1B one, or BitPipe (whole samples)."""
        entry = lookup(config.parallelism.pipeline_parallel_schedule)
        return entry.seq_chunked or entry.replicas == 2

    @property
    def _ours(self) -> bool:
        """The attention is chunk-aware: PP = 1, or PP with one of our schedules."""
        return not self.parallel_dims.pp_enabled or self._chunk_aware(self.config)

    def _undo_patches(self) -> None:
        patches, self._patches = getattr(self, "_patches", None), None
        if patches is not None:
            patches.uninstall()

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """torchtitan's, minus the attention masks (our attention takes the documents from
        ``document_ids``) and, with the schedule's context parallelism, minus the CP input
        sharding (the schedule keeps each rank's share of every segment)."""
        if not self._ours:
            return super().post_dataloading_process(input_dict, labels)
        inputs = input_dict["input"]
        extra_kwargs: dict[str, Any] = {k: v for k, v in input_dict.items() if k != "input"}
        if extra_kwargs.get("positions") is None:
            extra_kwargs["positions"] = default_positions(inputs)
        self.ntokens_seen += labels.numel()
        if self.config.parallelism.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, extra_kwargs = annotate_input_spmd_types(
                self.parallel_dims, inputs, labels, extra_kwargs
            )
        return inputs, labels, extra_kwargs

    def _forward_backward_body(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
        extra_kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Unpipelined: the same chunk-aware attention, masked by the packed documents."""
        docs = document_ids_from_positions(extra_kwargs["positions"])
        with packed_documents(docs):
            return super()._forward_backward_body(inputs, labels, global_valid_tokens, extra_kwargs)

    def pp_forward_backward_step(
        self,
        *,
        input_dict_mbs: list[dict[str, torch.Tensor]],
        label_mbs: list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """0.3's step contract (pre-split microbatches, ``loss_kwargs``) plus the documents;
        the loss is returned on every PP rank."""
        if not self._ours:  # torch's schedules: torchtitan's step, the loss on every PP rank
            loss = super().pp_forward_backward_step(
                input_dict_mbs=input_dict_mbs,
                label_mbs=label_mbs,
                global_valid_tokens=global_valid_tokens,
            )
            return self.pp_loss()(loss.reshape(()) if self.pp_has_last_stage else None)
        arg_mbs, kwarg_mbs, target_mbs, docs = [], [], [], []
        for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True):
            inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels)
            arg_mbs.append((inputs,))
            kwarg_mbs.append(extra_kwargs)
            target_mbs.append(labels)
            docs.append(document_ids_from_positions(extra_kwargs["positions"]))
        last = self.pp_has_last_stage
        losses: list[torch.Tensor] | None = [] if last else None
        with self.train_context():
            self.pp_schedule.step(
                arg_mbs=arg_mbs if self.pp_has_first_stage else None,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs if last else None,
                losses=losses,
                loss_kwargs={"global_valid_tokens": global_valid_tokens},
                return_outputs=False,
                document_ids=docs,
            )
        return self.pp_loss().of_units(losses)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._undo_patches()
