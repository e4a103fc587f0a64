"""The cross-rank pre-flight of a step: every pipeline rank agrees on the sequence length and
learns whether any rank rejected its inputs, before any pipeline traffic.

Middle stages get no input, so they cannot know the length by themselves; and a rank that
raises on bad input while its peers enter a recv would leave them waiting until the timeout.
One tiny all-reduce (6 integers) solves both, and checks that every rank lowered the same
order (whole or split backwards). It is skipped when the length is fixed up front
and pp == 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree_on_step"]


def agree_on_step(
    group: dist.ProcessGroup | None,
    group_size: int,
    device: torch.device,
    local_len: int,
    error: ValueError | None,
    has_documents: bool,
    whole_backward: bool = False,
) -> int:
    """The step's sequence length as the group agrees on it; raises on every rank if any
    rank's inputs were rejected (its own error here, a pointer to it elsewhere), or if some
    ranks run whole backwards (compiled blocks under a zero-bubble order) and others split
    them: every rank must lower the same order.
    ``group`` None is the default group, as in torch's stages."""
    agreed, failed, any_docs, any_missing = local_len, error is not None, False, False
    any_whole, any_split = False, False
    if group_size > 1:
        flags = [local_len, error is not None, has_documents, not has_documents,
                 whole_backward, not whole_backward]  # fmt: skip
        t = torch.tensor(flags, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        agreed, failed, any_docs, any_missing, any_whole, any_split = (int(x) for x in t.tolist())
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
