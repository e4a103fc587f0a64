"""torchtitan 0.3's Validator for chunk-aware models: documents from ``positions``.

0.3's validator builds a FlexAttention/varlen mask for the whole sequence and calls
``pp_schedule.eval(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``. With chunk-aware attention
the documents travel as ``document_ids`` instead: this subclass drops the mask, keeps (or
makes) ``positions``, and hands the schedule's ``eval()`` the documents of the microbatches it
prepared; unpipelined, the model's forward runs inside :func:`seq1f1b.packed_documents`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.components.validate import Validator

from seq1f1b import packed_documents

from ..common import LossBroadcast
from .model import default_positions, document_ids_from_positions


class _EvalWithDocuments:
    """The schedule, with ``eval()`` given the documents the validator prepared, and the
    last stage's losses on every PP rank (the validator is told every rank has the last
    stage, so rank 0 logs the real validation loss, as the trainer does for training)."""

    def __init__(
        self, schedule: Any, documents: list[torch.Tensor], has_last: bool, group: Any
    ) -> None:
        self._schedule, self._documents = schedule, documents
        self._has_last, self._group = has_last, group
        self._broadcast: LossBroadcast | None = None

    def eval(self, *, target_mbs: Any = None, losses: list | None = None, **kwargs: Any) -> Any:
        docs, self._documents[:] = list(self._documents), []
        own: list | None = [] if self._has_last else None
        out = self._schedule.eval(
            **kwargs,
            target_mbs=target_mbs if self._has_last else None,
            losses=own,
            document_ids=docs,
        )
        if losses is not None:
            if self._broadcast is None:
                self._broadcast = LossBroadcast(self._group, self._has_last, _device(kwargs))
            losses.append(self._broadcast.of_units(own))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)


def _device(kwargs: dict[str, Any]) -> torch.device:
    for kw in kwargs.get("kwarg_mbs") or ():
        for v in kw.values():
            if isinstance(v, torch.Tensor):
                return v.device
    return torch.device("cpu")


class Seq1F1BValidator(Validator):
    """Validation through chunk-aware attention (Seq1F1B's ``eval()`` or unpipelined)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._documents: list[torch.Tensor] = []

    def post_dataloading_process(
        self,
        input_dict: dict[str, torch.Tensor],
        labels: torch.Tensor,
        model_parts: list[nn.Module],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        del model_parts  # no mask to build from the model
        inputs = input_dict["input"]
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        if extra.get("positions") is None:
            extra["positions"] = default_positions(inputs)
        self._documents.append(document_ids_from_positions(extra["positions"]))
        return inputs, labels, extra

    @contextlib.contextmanager
    def _unpipelined_documents(self, model: nn.Module) -> Iterator[None]:
        """Each forward of ``model`` inside the documents of the batch prepared for it."""
        stack = contextlib.ExitStack()

        def enter(_m: nn.Module, _args: Any) -> None:
            stack.enter_context(packed_documents(self._documents.pop(0)))

        def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
            stack.close()

        handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            stack.close()

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        self._documents.clear()
        if self.pp_schedule is not None:
            schedule, has_last = self.pp_schedule, self.pp_has_last_stage
            group = self.parallel_dims.get_mesh("pp").get_group()
            self.pp_schedule = _EvalWithDocuments(schedule, self._documents, has_last, group)
            self.pp_has_last_stage = True
            try:
                return super().validate(model_parts, step)
            finally:
                self.pp_schedule, self.pp_has_last_stage = schedule, has_last
        with self._unpipelined_documents(model_parts[0]):
            return super().validate(model_parts, step)
