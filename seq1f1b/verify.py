"""``verify_model``: check a model adapted to Seq1F1B before training, on one process.

The model's stage modules run once unpipelined (the reference: the whole sequence, one stage
after the other) and once under ``ScheduleSeq1F1B`` with the sequence cut into segments (all
stages on this one rank, in looped placement), from copies of the same weights. Loss, every
stage's output and every gradient are compared; on a mismatch the report names the first stage
whose output differs, the segment where it starts, and the likely cause:

* no chunk-aware attention call in that stage (attention written by hand or a foreign kernel);
* segment 0 equal, later ones not: positions taken from the segment instead of the sequence
  (RoPE or learned position embeddings from ``arange(segment length)``), or a layer that mixes
  positions besides attention (a convolution, a norm over the sequence).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .attention.kv import packed_documents
from .attention.mixing_probe import PositionMixingError

__all__ = ["VerificationReport", "verify_model"]


@dataclass
class VerificationReport:
    """What :func:`verify_model` found. ``ok`` is True when the loss, every gradient and every
    buffer agree."""

    ok: bool
    loss_error: float
    worst_gradient: tuple[str, float] | None = None  # ("stage.param", relative error)
    stage: int | None = None  # the first stage whose output differs
    segment: int | None = None  # the first segment where it differs
    cause: str | None = None
    lengths: list[int] = field(default_factory=list)
    worst_buffer: tuple[str, float] | None = None  # ("stage.buffer", relative error)

    def __str__(self) -> str:
        if self.ok:
            return f"Seq1F1B verify: OK (segments {self.lengths}, loss error {self.loss_error:.1e})"
        where = "" if self.stage is None else f" at stage {self.stage}"
        seg = "" if self.segment is None else f", from segment {self.segment}"
        grad = (
            ""
            if self.worst_gradient is None
            else (
                f"; worst gradient {self.worst_gradient[0]} (relative error "
                f"{self.worst_gradient[1]:.1e})"
            )
        )
        if self.worst_buffer is not None:
            grad += (f"; worst buffer {self.worst_buffer[0]} (relative error "
                     f"{self.worst_buffer[1]:.1e})")  # fmt: skip
        return (f"Seq1F1B verify: MISMATCH{where}{seg} (segments {self.lengths}, loss error "
                f"{self.loss_error:.1e}{grad}). Likely cause: {self.cause}")  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@contextlib.contextmanager
def _single_process_group() -> Iterator[dist.ProcessGroup | None]:
    """A one-rank gloo group for the pipelined run: a new world when the caller has none; in
    a launched job, one-rank subgroups, which every rank makes together (so every rank of the
    job must be verifying, as torchtitan's start-up check does)."""
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            yield None
            return
        mine, groups = dist.new_subgroups(group_size=1, backend="gloo")
        try:
            yield mine
        finally:
            for group in groups:
                dist.destroy_process_group(group)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def _outputs(mods: Sequence[nn.Module]) -> tuple[list[list[torch.Tensor]], Callable[[], None]]:
    """Every forward output of each module, in call order (and the hooks' remover)."""
    seen: list[list[torch.Tensor]] = [[] for _ in mods]
    handles = []
    for i, m in enumerate(mods):

        def hook(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                seen[i].append(t.detach().clone())

        handles.append(m.register_forward_hook(hook))
    return seen, lambda: [h.remove() for h in handles]


def verify_model(
    stages: Sequence[nn.Module],
    inputs: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    seq_chunks: int = 3,
    document_ids: torch.Tensor | None = None,
    seq_dim: int = 1,
    tol: float = 1e-4,
    tolerances: Mapping[str, float] | None = None,
) -> VerificationReport:
    """Run ``stages`` (the model cut into pipeline stages, in order) unpipelined and under
    Seq1F1B with ``seq_chunks`` uniform segments, on this process, and compare.

    ``inputs``/``target``: one example batch (batch, seq_len); ``loss_fn(output, target)`` a
    mean loss, as for the schedule. The modules are not changed (copies run). Use fp32 and a
    short sequence (a few hundred tokens at most); ``tol`` bounds the relative errors (the
    largest a correct model showed is Gated DeltaNet's decay parameters', ``A_log`` and
    ``dt_bias``, whose small gradients fp32 rounds most: at most 7e-6 between the segmented
    and the whole-sequence run, transformers' Qwen3-Next (dense) and Qwen3.5, 48 to 80 tokens,
    K = 3 to 8, three seeds, so 1e-4 leaves a 14x margin; a delta-rule state not carried
    from segment to segment moves them by 2e-2 to 5e-1, 80 tokens, K = 3), and
    ``tolerances`` maps a parameter-name part to a looser bound for the parameters whose
    gradients the model computes in a lower precision (torchtitan's routed experts run their
    GEMMs in bf16: a sum cut into segments rounds differently, by about 2e-3). In a
    launched job (world size > 1) every rank must call it (it makes one-rank groups). Returns
    a :class:`VerificationReport` (``print`` it; ``report.ok``).
    """
    from .schedules.partition import uniform_split
    from .schedules.schedule import ScheduleSeq1F1B

    seq_len = inputs.shape[seq_dim]
    if seq_len < seq_chunks:
        raise ValueError(f"verify_model: {seq_len} positions cannot be cut into {seq_chunks}")
    lengths = uniform_split(seq_len, seq_chunks)
    ref = [copy.deepcopy(m) for m in stages]
    mine = [copy.deepcopy(m) for m in stages]
    initial = [_buffers(m) for m in stages]
    ref_out, remove = _outputs(ref)
    masked = (
        packed_documents(document_ids) if document_ids is not None else contextlib.nullcontext()
    )
    with masked:
        h: Any = inputs
        for m in ref:
            h = m(h)
        ref_loss = loss_fn(h, target)
        ref_loss.backward()
    remove()
    got_out, remove = _outputs(mine)
    device = inputs.device
    losses: list[torch.Tensor] = []
    probe_error: PositionMixingError | None = None
    with _single_process_group() as group:
        from torch.distributed.pipelining import PipelineStage

        n = len(mine)
        pipe = [PipelineStage(m, i, n, device, group=group) for i, m in enumerate(mine)]
        schedule = ScheduleSeq1F1B(pipe, 1, seq_chunks, loss_fn, seq_split=list(lengths),
                                   seq_dim=seq_dim)  # fmt: skip
        schedule.unit_actions.outputs = None  # this function compares more, and reports it
        try:
            schedule.step(inputs, target=target, losses=losses, document_ids=document_ids)
        except PositionMixingError as exc:
            probe_error = exc
    remove()
    if probe_error is not None:
        return VerificationReport(False, float("inf"), stage=probe_error.stage_index,
                                  segment=probe_error.segment, cause=str(probe_error),
                                  lengths=lengths)  # fmt: skip
    loss = torch.stack(losses).mean() if losses else torch.tensor(float("nan"))
    loss_error = abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30)
    worst: tuple[str, float] | None = None
    ok = loss_error <= tol
    for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            if q.grad is None:
                continue
            err = float("inf") if p.grad is None else _rel(p.grad, q.grad)
            bound = _tolerance(name, tol, tolerances)
            ok = ok and err <= bound
            # the worst relative to its bound is the one to report
            if worst is None or err / bound > worst[1] / _tolerance(worst[0], tol, tolerances):
                worst = (f"{i}.{name}", err)
    worst_buffer = _worst_buffer(mine, ref, initial)
    ok = ok and (worst_buffer is None or worst_buffer[1] <= tol)
    report = VerificationReport(ok, loss_error, worst, lengths=lengths, worst_buffer=worst_buffer)
    if not ok:
        report.stage, report.segment, report.cause = _diagnose(ref_out, got_out, lengths, seq_dim)
        if report.stage is None and worst_buffer is not None and worst_buffer[1] > tol:
            report.cause = (
                "every stage's output matches but a buffer the forward updates does not (a "
                "count or statistic kept across calls: a module that runs again outside the "
                "schedule's forward, such as an extra shape-inference forward, adds to it)"
            )
    return report


def _tolerance(name: str, tol: float, tolerances: Mapping[str, float] | None) -> float:
    """The bound of parameter ``name``: the loosest matching ``tolerances`` entry, or ``tol``."""
    bounds = [t for part, t in (tolerances or {}).items() if part in name]
    return max(bounds, default=tol)


def _buffers(m: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``m``'s numeric buffers (what a forward may update in place)."""
    return {
        n: b.detach().clone()
        for n, b in m.named_buffers()
        if b.dtype != torch.bool and not b.is_complex()
    }


def _worst_buffer(
    mine: Sequence[nn.Module], ref: Sequence[nn.Module], initial: list[dict[str, torch.Tensor]]
) -> tuple[str, float] | None:
    """The buffer that the two runs left most different, among those either run changed (a
    count a segment adds twice, or once too few): ``("stage.name", relative error)``."""
    worst: tuple[str, float] | None = None
    for i, (a, b, before) in enumerate(zip(mine, ref, initial, strict=True)):
        got, want = _buffers(a), _buffers(b)
        for name, start in before.items():
            x, y = got[name].float(), want[name].float()
            if torch.equal(x, start.float()) and torch.equal(y, start.float()):
                continue
            err = float((x - y).norm() / y.norm().clamp_min(1.0))
            if worst is None or err > worst[1]:
                worst = (f"{i}.{name}", err)
    return worst


def _diagnose(
    ref_out: list[list[torch.Tensor]],
    got_out: list[list[torch.Tensor]],
    lengths: list[int],
    seq_dim: int,
) -> tuple[int | None, int | None, str]:
    """The first stage whose output differs, the first segment that differs, and why."""
    for i, (want, got) in enumerate(zip(ref_out, got_out, strict=True)):
        if not want or len(got) < len(lengths):
            continue
        full, got = want[-1], got[-len(lengths) :]  # (torch's shape inference ran first)
        start = 0
        for j, length in enumerate(lengths):
            part = full.narrow(seq_dim, start, length)
            start += length
            if _rel(got[j], part) > 1e-4:
                if j == 0:
                    return (
                        i,
                        j,
                        (
                            "the first segment already differs: the stage's output depends on "
                            "something besides its own inputs and the earlier positions (state "
                            "kept between calls, randomness such as dropout: verify with "
                            "model.eval()'s determinism, or a per-batch statistic)"
                        ),
                    )
                return (
                    i,
                    j,
                    (
                        f"segment 0 matches, segment {j} does not: positions are probably taken "
                        "from the segment, not the sequence (RoPE or learned position embeddings "
                        "from arange(segment length): use seq1f1b.current_segment().positions() "
                        "or seq1f1b.segment_positions(x)), or a layer besides attention mixes "
                        "positions (a convolution, a norm over the sequence)"
                    ),
                )
    return (
        None,
        None,
        (
            "every stage's output matches but the gradients do not: a parameter used outside the "
            "forward, or gradients changed by hooks"
        ),
    )
