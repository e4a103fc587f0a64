"""``[seq1f1b] verify = true``: the start-up self-check of torchtitan's model under Seq1F1B.

Before training, every rank runs :func:`seq1f1b.verify_model` on the installed torchtitan's
model code (the run's family) as this integration adapts it (chunk-aware attention, RoPE at
the segment's positions, packed documents), at the debug size: the family's debug flavor
(with the run's document masking), cut into the run's number of stages as torchtitan cuts
(by module names), over a short sequence with the run's ``seq_chunks``. It compares the loss,
every gradient and every buffer the forward updates (MoE token counts) with the unpipelined
model and fails start-up, naming the stage, the segment and the likely cause, if they
differ: what a torchtitan release that changed its model code would break. The run's own
sizes do not matter to that check, and would make it slow. This module is version-free: each
version's ``validate.py`` builds its debug model and stage names and calls
:func:`run_start_check`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from seq1f1b import verify_model
from seq1f1b.attention.attention_op import segment_positions

logger = logging.getLogger(__name__)

#: tokens per segment of the check (short: it runs on every rank at start-up, on CPU)
TOKENS_PER_SEGMENT = 16


def cut_by_names(model: nn.Module, names_per_stage: list[list[str]]) -> list[nn.Module]:
    """Copies of ``model``, each keeping the modules torchtitan's split gives that stage
    (``tok_embeddings``, ``layers.i``, ``norm``, ``output`` / ``lm_head``), the rest None."""
    stages = []
    for names in names_per_stage:
        part = copy.deepcopy(model)
        keep = set(names)
        for key in list(part.layers.keys()):
            if f"layers.{key}" not in keep:
                del part.layers[key]
        for attr in ("tok_embeddings", "norm", "output", "lm_head"):
            if getattr(part, attr, None) is not None and attr not in keep:
                setattr(part, attr, None)
        stages.append(part)
    return stages


class _WithPositions(nn.Module):
    """A 0.3 stage fed ``positions`` from the running segment, as the trainer's dataloader
    positions are cut per segment by the schedule."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = segment_positions(h, dim=1).unsqueeze(0).expand(h.shape[0], -1)
        return self.stage(h, positions=positions)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def run_start_check(
    build: Callable[[], nn.Module],
    names_per_stage: list[list[str]],
    seq_chunks: int,
    documents: bool,
    positions_kwarg: bool,
    model_name: str = "llama3",
) -> None:
    """Build the debug model, cut it, run the self-check; raise on a mismatch (every rank)."""
    torch.manual_seed(0)
    model = build()
    stages = cut_by_names(model, names_per_stage)
    if positions_kwarg:
        stages = [_WithPositions(s) for s in stages]
    k = max(1, min(seq_chunks, 8))
    seq_len = TOKENS_PER_SEGMENT * k
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(0, vocab, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
    docs: Any = None
    if documents:  # row 0: two documents, the second starting inside the first segment
        docs = torch.zeros(2, seq_len, dtype=torch.int64)
        docs[0, TOKENS_PER_SEGMENT // 2 :] = 1
    report = verify_model(
        stages, tokens[:, :-1], tokens[:, 1:], _loss, seq_chunks=k, document_ids=docs
    )
    if not report.ok:
        raise ValueError(
            f"[seq1f1b] verify = true: torchtitan's {model_name}, as this integration adapts "
            f"it, does not train exactly under Seq1F1B with this torchtitan: {report}. Use a "
            "supported torchtitan (0.2.2 or 0.3.0) or report it"
        )
    logger.info("[seq1f1b] verify: %s (%s debug model, %d stages)", report, model_name, len(stages))
