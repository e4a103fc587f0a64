"""The cross-rank pre-flight of a step: every pipeline rank agrees on the sequence length and
learns whether any rank rejected its inputs, before any pipeline traffic
(:func:`agree_on_step`, the agreement :func:`seq1f1b.schedules.step_inputs.prepare_step` calls
once it has read this rank's inputs).

Middle stages get no input, so they cannot know the length by themselves; and a rank that
raises on bad input while its peers enter a recv would leave them waiting until the timeout.
One tiny all-reduce of integers solves both, checks that every rank lowered the same order
(whole or split backwards), and that every rank built the same schedule (:func:`fingerprint`:
its class, M, K, the split, stages per rank, whether it has a loss), where a difference would
otherwise surface as a shape error on one rank and a closed connection on the others. It is
skipped when pp == 1.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_on_step", "fingerprint"]

#: one schedule setting as the pre-flight compares it: (integer, how to print it)
Fingerprint = Mapping[str, tuple[int, str]]


def fingerprint(
    schedule: str, n_microbatches: int, seq_chunks: int, split: Any, stages: int, loss: bool
) -> dict[str, tuple[int, str]]:
    """What every pipeline rank must agree on before any traffic, as integers to compare."""

    def named(text: str) -> tuple[int, str]:
        return zlib.crc32(text.encode()), text

    return {
        "schedule": named(schedule),
        "n_microbatches": (n_microbatches, str(n_microbatches)),
        "seq_chunks": (seq_chunks, str(seq_chunks)),
        "seq_split": named(repr(split)),
        "stages per rank": (stages, str(stages)),
        "loss_fn given": (int(loss), str(loss)),
    }


def agree_on_step(
    stage: Any,
    group_size: int,
    local_len: int,
    error: ValueError | None,
    has_documents: bool,
    whole_backward: bool = False,
    settings: Fingerprint | None = None,
) -> int:
    """The step's sequence length as the group agrees on it; raises on every rank if any
    rank's inputs were rejected (its own error here, a pointer to it elsewhere), if the ranks
    built different schedules (``settings``, :func:`fingerprint`: one error naming the
    setting and both values), or if some ranks run whole backwards (compiled blocks under a
    zero-bubble order) and others split them: every rank must lower the same order.
    The all-reduce runs on ``stage``'s group and device (a group of None is the default
    group, as in torch's stages); with one rank there is nothing to agree on."""
    agreed, failed, any_docs, any_missing = local_len, error is not None, False, False
    any_whole, any_split = False, False
    mine = list((settings or {}).items())
    if group_size > 1:
        flags = [local_len, error is not None, has_documents, not has_documents,
                 whole_backward, not whole_backward]  # fmt: skip
        for _, (value, _) in mine:  # the largest and (negated) the smallest across the group
            flags += [value, -value]
        t = torch.tensor(flags, dtype=torch.int64, device=stage.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=stage.group)
        got = [int(x) for x in t.tolist()]
        agreed, failed, any_docs, any_missing, any_whole, any_split = got[:6]
        for i, (name, (value, shown)) in enumerate(mine):
            high, low = got[6 + 2 * i], -got[7 + 2 * i]
            if high != low:
                other = low if value == high else high
                theirs = f" {other}" if shown == str(value) else " another"
                raise ValueError(
                    f"the pipeline ranks built different schedules: {name} is {shown} on this "
                    f"rank and{theirs} on another rank. Every rank must construct the "
                    "schedule with the same class, n_microbatches, seq_chunks, seq_split, "
                    "stages per rank and loss_fn (no pipeline communication was started)"
                )
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            "ScheduleSeq1F1B.step(): another pipeline rank rejected its inputs (see its "
            "error); no pipeline communication was started"
        )
    if any_whole and any_split:
        raise ValueError(
            "some pipeline ranks hold compiled modules and others do not: a zero-bubble "
            "schedule runs compiled stages' backwards whole (a compiled backward cannot be "
            "split), and every rank must run the same order. Compile the blocks of every "
            "stage (as torchtitan does) or of none"
        )
    if any_docs and any_missing:
        raise ValueError(
            "step(document_ids=...) was passed on some pipeline ranks but not on others: "
            "every stage's attention needs the document boundaries, pass them on every rank"
        )
    if agreed < 1:
        raise ValueError(
            "no rank passed a tensor input or target to step(), so the sequence length is "
            "unknown: pass seq_len= to ScheduleSeq1F1B"
        )
    return agreed
