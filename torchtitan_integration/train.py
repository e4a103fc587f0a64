"""Train entry (torchtitan's TRAIN_FILE): ``python -m torchtitan_integration.train``.

Same flags as ``python -m torchtitan.train``. Adds the ``[seq1f1b]`` config section, the
Seq1F1B schedules, CPU/gloo support when there is no GPU, the offline ``pycode`` dataset, and a
trainer whose pipeline loss is divided by the global token count *before* backward.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from . import cpu

cpu.install()  # before anything else imports torchtitan

import torchtitan.distributed.utils as dist_utils  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402

from . import assets, spec  # noqa: E402
from .bitpipe import clip_counting_each_chunk_once, sync_twins_once  # noqa: E402

CONFIG_MODULE = "torchtitan_integration.config"


class Seq1F1BTrainer(Trainer):
    """torchtitan's Trainer with a PP step that backpropagates the token-mean loss."""

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: Any
    ) -> torch.Tensor:
        if not self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        sync_twins_once(self.pp_schedule)  # BitPipe: replicas identical after init/load
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels
        )
        last = self.pp_has_last_stage
        targets, losses = (labels, []) if last else (None, None)
        loss_kwargs = {"global_valid_tokens": global_valid_tokens} if last else None
        with self.train_context():
            if self.pp_has_first_stage:
                self.pp_schedule.step(
                    inputs,
                    **extra_inputs,
                    **extra_kwargs,
                    target=targets,
                    losses=losses,
                    return_outputs=False,
                    loss_kwargs=loss_kwargs,
                )
            else:
                self.pp_schedule.step(
                    **extra_kwargs,
                    target=targets,
                    losses=losses,
                    return_outputs=False,
                    loss_kwargs=loss_kwargs,
                )
        if not last:
            return torch.tensor([-1.0], device=self.device)
        # each unit's loss is already (token-sum / global tokens): the sum is the mean loss
        return torch.sum(torch.stack(losses)).to(self.device)

    def train_step(self, data_iterator: Any) -> None:
        schedule = getattr(self, "pp_schedule", None)
        if getattr(schedule, "titan_twins", None) is None:
            return super().train_step(data_iterator)
        # BitPipe: clip by the norm of the model (each chunk once), scoped to this step
        original = dist_utils.clip_grad_norm_
        dist_utils.clip_grad_norm_ = clip_counting_each_chunk_once(original, schedule)
        try:
            return super().train_step(data_iterator)
        finally:
            dist_utils.clip_grad_norm_ = original


def _toml_names_config_module(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        path = a.split("=", 1)[1] if a.startswith("--job.config_file=") else None
        if a in ("--job.config_file", "--job.config-file") and i + 1 < len(argv):
            path = argv[i + 1]
        if path and os.path.exists(path):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib

            with open(path, "rb") as f:
                return "custom_config_module" in tomllib.load(f).get("job", {})
    return False


def _with_config_module(argv: list[str]) -> list[str]:
    """Add our config module unless the command line or the TOML already names one."""
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if any(a.startswith(flags) for a in argv) or _toml_names_config_module(argv):
        return argv
    return [*argv, "--job.custom_config_module", CONFIG_MODULE]


def run() -> None:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assets.ensure_assets()
    assets.register_dataset()
    spec.register()
    sys.argv = [sys.argv[0], *_with_config_module(sys.argv[1:])]
    main(Seq1F1BTrainer)


if __name__ == "__main__":
    run()
