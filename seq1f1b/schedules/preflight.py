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
skipped when pp == 1. When a rank rejects its inputs, a second collective (on that path only)
gathers every rank's error, so that each rank's error names the rank at fault and its message.

Also here, the checks of the loss that need no traffic: :func:`check_loss_fn` (it takes
``(output, target)``, at construction), :func:`check_loss_call` (with this step's
``loss_kwargs``) and :func:`check_targets` (a target on every rank that holds a last stage);
and :func:`sum_reduced`, the first step's test that a loss meant as a mean is not a sum.
"""

from __future__ import annotations

import inspect
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import _runtime as rt

__all__ = [
    "agree_on_step",
    "check_loss_call",
    "check_loss_fn",
    "check_targets",
    "declared_sum",
    "fingerprint",
    "sum_loss_error",
    "sum_reduced",
]

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
    error: Exception | None,
    has_documents: bool,
    whole_backward: bool = False,
    settings: Fingerprint | None = None,
    note: str | None = None,
    failures: rt.StepFailures | None = None,
) -> int:
    """The step's sequence length as the group agrees on it; raises on every rank if any
    rank's inputs were rejected (its own error here, that rank and its message elsewhere;
    ``note``: what this rank adds to that error, e.g. that it got a target it does not use),
    if the ranks' inputs have different lengths, if the ranks built different schedules
    (``settings``, :func:`fingerprint`: one error naming the setting and both values), or if
    some ranks run whole backwards (compiled blocks under a zero-bubble order) and others
    split them: every rank must lower the same order.
    The all-reduce runs on ``stage``'s group and device (a group of None is the default
    group, as in torch's stages); with one rank there is nothing to agree on. If it fails (a
    peer died in the previous step), ``failures`` names the peer's reported error."""
    agreed, failed, any_docs, any_missing = local_len, error is not None, False, False
    any_whole, any_split, shortest = False, False, local_len
    mine = list((settings or {}).items())
    if group_size > 1:
        flags = [local_len, error is not None, has_documents, not has_documents,
                 whole_backward, not whole_backward, -(local_len or _NO_LENGTH)]  # fmt: skip
        for _, (value, _) in mine:  # the largest and (negated) the smallest across the group
            flags += [value, -value]
        t = torch.tensor(flags, dtype=torch.int64, device=stage.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=stage.group)
        except Exception as exc:
            if failures is None:
                raise
            failures.fail(exc)
        got = [int(x) for x in t.tolist()]
        agreed, failed, any_docs, any_missing, any_whole, any_split = got[:6]
        shortest = -got[6]
        for i, (name, (value, shown)) in enumerate(mine):
            high, low = got[7 + 2 * i], -got[8 + 2 * i]
            if high != low:
                other = low if value == high else high
                theirs = f" {other}" if shown == str(value) else " another"
                raise ValueError(
                    f"the pipeline ranks built different schedules: {name} is {shown} on this "
                    f"rank and{theirs} on another rank. Every rank must construct the "
                    "schedule with the same class, n_microbatches, seq_chunks, seq_split, "
                    "stages per rank and loss_fn (no pipeline communication was started)"
                )
    if failed and group_size > 1:
        _raise_rejected(stage, group_size, error, note)
    if error is not None:
        raise error
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
    if shortest != _NO_LENGTH and shortest != agreed:
        raise ValueError(
            f"the pipeline ranks' inputs have different sequence lengths ({shortest} on one "
            f"rank, {agreed} on another): pass the same sequence length on every rank (no "
            "pipeline communication was started)"
        )
    return agreed


#: what a rank without inputs contributes to the smallest length (it has none)
_NO_LENGTH = 1 << 62


def _raise_rejected(stage: Any, group_size: int, error: Exception | None, note: str | None) -> None:
    """Some rank rejected its inputs: gather every rank's error (this collective runs only
    on this path) and raise on every rank, naming each rank at fault and its message."""
    entry = None if error is None else f"{type(error).__name__}: {error}"
    gathered: list[Any] = [None] * group_size
    dist.all_gather_object(gathered, (dist.get_rank(), entry, note), group=stage.group)
    me = dist.get_rank(stage.group)
    at_fault = {
        r: f"pipeline rank {r}" + (f" (global rank {g})" if g != r else "") + f": {e}"
        for r, (g, e, _) in enumerate(gathered)
        if e is not None
    }
    notes = [n for _, _, n in gathered if n]
    tail = " ".join([*notes, "No pipeline communication was started."])
    if error is not None:
        others = [text for r, text in at_fault.items() if r != me]
        also = ("; also " + "; ".join(others)) if others else ""
        rt.StepFailures.note(error, f"(pipeline rank {me} rejected its inputs; every pipeline "
                                    f"rank raises naming it{also}) {tail}")  # fmt: skip
        raise error
    raise RuntimeError(
        "ScheduleSeq1F1B.step(): another pipeline rank rejected its inputs: "
        + "; ".join(at_fault.values())
        + f". {tail}"
    )


def _loss_signature(loss_fn: Callable[..., Any]) -> inspect.Signature | None:
    """The signature the schedule calls (a module's ``forward``), or None where Python has
    none to show (a builtin): then nothing is checked."""
    target = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _loss_name(loss_fn: Callable[..., Any]) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def check_loss_fn(loss_fn: Callable[..., Any] | None) -> inspect.Signature | None:
    """At construction, on every rank: the schedules call ``loss_fn(output, target,
    **loss_kwargs)``, so it must take two positional arguments. Returns its signature (for
    :func:`check_loss_call`), or None."""
    if loss_fn is None:
        return None
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    sig = _loss_signature(loss_fn)
    if sig is None:
        return None
    try:
        sig.bind_partial(None, None)
    except TypeError as exc:
        raise TypeError(
            f"loss_fn {_loss_name(loss_fn)}{sig} cannot be called as loss_fn(output, target) "
            f"({exc}): the pipeline schedules call it with the last stage's output and the "
            "target of each microbatch (as torch's do). Give it two positional parameters, "
            "e.g. loss_fn=lambda output, target: ... (extra ones as keywords, through "
            "step(loss_kwargs=...))"
        ) from None
    return sig


def check_loss_call(
    loss_fn: Callable[..., Any],
    sig: inspect.Signature | None,
    loss_kwargs: Mapping[str, Any] | None,
    takes_weight: bool,
) -> TypeError | None:
    """Before any traffic, on a rank with a last stage: whether ``loss_fn(output, target,
    **loss_kwargs)`` (plus ``weight=`` for a loss that takes it) binds; the error, or None."""
    if sig is None:
        return None
    extra = dict(loss_kwargs or {})
    if takes_weight:
        extra.setdefault("weight", 1.0)
    try:
        sig.bind(None, None, **extra)
    except TypeError as exc:
        given = ", ".join(extra) or "none"
        return TypeError(
            f"loss_fn {_loss_name(loss_fn)}{sig} cannot be called as loss_fn(output, target"
            f"{''.join(f', {k}=...' for k in extra)}) ({exc}; step(loss_kwargs=...) gave: "
            f"{given}): pass every parameter it needs without a default in loss_kwargs, or "
            "give it a default"
        )
    return None


def check_targets(
    has_last: bool, has_loss: bool, has_target: bool, rank: int, stages: list[int]
) -> tuple[ValueError | None, str | None]:
    """Before any traffic: a rank that holds a last stage needs a target when there is a
    loss (torch's "loss_fn and target required for last stage", raised there mid-step).
    Returns (this rank's error, a note for the others' errors): a rank that got a target it
    does not use says so, since that is the usual cause (the target passed on rank 0)."""
    if has_loss and has_last and not has_target:
        return (
            ValueError(
                f"pipeline rank {rank} holds the last stage (stages {stages}) and the schedule "
                "has a loss_fn, but its step() got no target= (or target_mbs=): loss_fn and "
                "target required for last stage. Pass the target on the rank that holds the "
                f"last stage (rank {rank}) in step(target=...)"
            ),
            None,
        )
    if has_target and not has_last:
        return None, (
            f"Pipeline rank {rank} got a target= but holds no last stage (stages {stages}): "
            "the target goes to the rank that holds the last stage."
        )
    return None, None


def declared_sum(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` says it sums: a loss module (``nn.CrossEntropyLoss(reduction=
    "sum")``) or a ``functools.partial`` with ``reduction="sum"``."""
    if getattr(loss_fn, "reduction", None) == "sum":
        return True
    return getattr(loss_fn, "keywords", {}).get("reduction") == "sum"


def sum_reduced(
    loss_fn: Callable[..., Any], output: Any, target: Any, loss: torch.Tensor, dim: int
) -> bool | None:
    """Whether ``loss_fn`` behaves as a sum over tokens rather than a mean: its value on
    ``output``/``target`` equals the sum of its values on the two halves along ``dim``
    (a mean lies between them). Run at the first step, under ``no_grad``; None whenever the
    test does not apply (not tensors, fewer than two positions, non-finite or near-zero
    halves, or a loss the halves make fail)."""
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    if output.dim() <= dim or target.dim() <= dim or target.shape[dim] != output.shape[dim]:
        return None
    n = output.shape[dim]
    if n < 2 or loss.numel() != 1:
        return None
    try:
        with torch.no_grad():
            halves = [
                float(loss_fn(output.narrow(dim, start, length), target.narrow(dim, start, length)))
                for start, length in ((0, n // 2), (n // 2, n - n // 2))
            ]
            full = float(loss.detach())
    except Exception:  # a loss that cannot take half a unit (or fake tensors): no verdict
        return None
    total = halves[0] + halves[1]
    finite = all(math.isfinite(x) for x in (full, *halves))
    if not finite or total == 0.0 or min(abs(h) for h in halves) < 0.05 * abs(total):
        return None
    return abs(full / total - 1.0) < 1e-2


def sum_loss_error(n_units: int, fix: str) -> ValueError:
    """The refusal of a sum-reduced loss under mean scaling (``fix``: the option to pass)."""
    return ValueError(
        "loss_fn sums over tokens (its value on a unit equals the sum of its values on the "
        "unit's two halves, or it says reduction='sum'), but the schedule averages: it takes "
        "each unit's loss as a mean over its tokens and divides the gradients by the "
        f"{n_units} microbatches it runs, so this loss would train with gradients {n_units} "
        f"times too small (torch's own schedules do the same with scale_grads=True). Pass "
        f"{fix}, or make loss_fn a mean over tokens (reduction='mean')"
    )
