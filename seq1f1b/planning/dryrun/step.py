"""One training step of one pipeline rank at its real size, on the CPU, without its memory:
fake tensors, the fake process group, torch's MemTracker for the memory and a roofline per op
(:mod:`.estimate`) for the device time.

The caller's ``build(rank)`` runs inside the fake world and the fake-tensor mode and returns a
:class:`RankStep`: its stages' schedule, modules, optimizer and step inputs, built as in a real
run (torch's schedules or ours). :func:`dry_run_rank` then runs one step and the optimizer,
sampling at every forward and backward action the memory held, the K/V cache, the receive
buffers, the estimated device time and the host time.

What it cannot see, and roughly how large it is: compiled graphs (inductor fuses elementwise
ops, so eager activations and temporaries are an upper bound; often 10-30% lower compiled),
the caching allocator's fragmentation and rounding (torchtitan's runs show reserved 5-15% above
allocated), NCCL's buffers and the CUDA context (about 1-3 GB per GPU; the planner's
``reserve_gb``), and communication time (not priced here; the planner prices it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import _runtime as rt
from .estimate import DeviceTime, GpuSpec, gpu_spec

__all__ = [
    "ActionSample",
    "MemoryBreakdown",
    "RankReport",
    "RankStep",
    "dry_run_rank",
    "static_stage",
    "steady_state",
]


@dataclass
class RankStep:
    """What one rank runs: built by the caller under fake tensors (see the module docstring).

    ``seq_len``: the step's sequence length, which a Seq1F1B schedule's ranks agree on before
    any traffic (the fake process group carries no values, so the dry run tells them)."""

    schedule: Any
    stages: Sequence[Any]  # this rank's PipelineStages, as given to the schedule
    modules: Sequence[nn.Module]
    optimizer: torch.optim.Optimizer | None
    args: tuple = ()
    target: torch.Tensor | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    seq_len: int | None = None


@dataclass(frozen=True)
class MemoryBreakdown:
    """A rank's peak memory (bytes), split by what holds it; the parts add up to ``total``."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward, less the K/V cache and receive buffers below
    kv_cache: int  # cached K/V (and carried state) of earlier segments, at the peak's action
    receives: int  # received activations not yet consumed, at the peak's action
    temporaries: int  # backward temporaries and everything else MemTracker saw

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.kv_cache + self.receives + self.temporaries)  # fmt: skip

    def items(self) -> list[tuple[str, int]]:
        return [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer", self.optimizer), ("activations", self.activations),
                ("K/V cache", self.kv_cache), ("receives", self.receives),
                ("temporaries", self.temporaries)]  # fmt: skip


@dataclass(frozen=True)
class ActionSample:
    """One forward or backward action of the rank's order, as it ran."""

    label: str  # "F3" forward of unit 3 (stage s: "s1 F3" with several stages), "B3", "W3"
    memory: int  # bytes held when it ended
    peak: int  # the rank's peak so far (bytes), the action included
    kv_cache: int  # K/V bytes cached when it ended
    device_s: float  # estimated device time of the action
    host_s: float  # wall time of the action here (Python, fake kernels)


@dataclass
class RankReport:
    """One rank's dry-run step."""

    rank: int
    schedule: str
    gpu: GpuSpec
    peak: MemoryBreakdown
    actions: list[ActionSample]
    device_s: float  # estimated device time of the whole step (actions and optimizer)
    host_s: float  # wall time of the whole step here
    n_units: int  # forward actions this rank ran
    #: with ``dry_run_rank(holders=True)``: what held the memory within 1% of the peak
    #: (bytes then, the storages grouped by kind, maker, shape and dtype, largest first)
    holders: tuple[int, list[rt.Holder]] | None = None

    @property
    def fits(self) -> bool:
        """Whether the peak fits the GPU less the planner's reserve (context, NCCL, slack)."""
        return self.peak.total <= self.gpu.memory_bytes - self.gpu.profile.reserve_gb * 1e9


def static_stage(
    module: nn.Module,
    stage_index: int,
    num_stages: int,
    example: torch.Tensor,
    device: torch.device | str = "cpu",
    group: Any = None,
) -> Any:
    """A ``PipelineStage`` with static metadata (the fake process group cannot carry torch's
    shape inference): ``example`` is the input of the first unit the stage runs, as torch's
    inference would have seen it: one microbatch for torch's schedules, one sample's first
    segment for the Seq1F1B family (``schedule.split_lengths(seq_len)[0]`` positions, and a
    root input as the view of its sample the schedule cuts: torch 2.13/2.14 compare strides;
    later units are sized from it). The output's shape comes from a forward of ``module`` on
    it (fake tensors: no compute). Returns (stage, output), the output the next stage's
    example."""
    from torch.distributed.pipelining import PipelineStage

    if stage_index > 0 and example.is_floating_point():  # an activation: its gradient goes back
        example = example.detach().requires_grad_()
    out = module(example)  # with autograd: the metadata says the output takes a gradient
    out = out.detach().requires_grad_(out.requires_grad)
    stage = PipelineStage(module, stage_index, num_stages, torch.device(device),
                          input_args=example, output_args=out, group=group)  # fmt: skip
    return stage, out


def _kv_bytes(schedule: Any) -> int:
    actions = getattr(schedule, "unit_actions", None)
    return int(actions.kv_state_bytes()) if actions is not None else 0


def _recv_bytes(stages: Sequence[Any]) -> int:
    total = 0
    for stage in stages:
        for unit in list(getattr(stage, "args_recv_info", {})):
            received = rt.received_tensors(stage, unit)
            total += sum(b.numel() * b.element_size() for _, _, b in received)
    return total


def _held(snapshot: dict) -> int:
    return sum(v.get("Total", 0) for v in snapshot.values())


#: an action's kind as the samples print it (a split backward's input half prints as B)
_KIND = {rt.FORWARD: "F", rt.FULL_BACKWARD: "B", rt.BACKWARD_INPUT: "B", rt.BACKWARD_WEIGHT: "W"}


class _Sampler:
    """An action context (the seam's ``action_contexts_installed`` runs every F / B / W in
    it) that samples each action: memory held, peak, K/V, device and host time."""

    def __init__(
        self, schedule: Any, stages: Sequence[Any], mt: rt.PipelineMemTracker, clock: DeviceTime
    ) -> None:
        self.schedule, self.stages, self.mt, self.clock = schedule, stages, mt, clock
        self.samples: list[ActionSample] = []
        self.kv_at_peak, self.recv_at_peak, self._peak = 0, 0, 0
        self.several = len(stages) > 1

    @contextlib.contextmanager
    def __call__(self, stage: Any, action: Any) -> Iterator[None]:
        kv0, recv0, dev0, t0 = _kv_bytes(self.schedule), _recv_bytes(self.stages), \
            self.clock.seconds, time.perf_counter()  # fmt: skip
        yield
        host = time.perf_counter() - t0
        now, peak = _held(self.mt.get_tracker_snapshot()), _held(
            self.mt.get_tracker_snapshot("peak"))  # fmt: skip
        kv = _kv_bytes(self.schedule)
        if peak > self._peak:  # the peak fell in this action: its K/V and receives
            self._peak = peak
            self.kv_at_peak, self.recv_at_peak = max(kv0, kv), recv0
        kind, chunk = _KIND[action.computation_type], action.microbatch_index
        label = f"s{stage.stage_index} {kind}{chunk}" if self.several else f"{kind}{chunk}"
        self.samples.append(ActionSample(label, now, peak, kv, self.clock.seconds - dev0, host))


def _known_length(seq_len: int | None) -> Callable[..., int]:
    """The pre-flight agreement of a dry run: the length the caller gave (the fake process
    group returns no values), this rank's own input error raised as in a real step."""

    def agree(local_len: int, error: Exception | None, *_: Any, **__: Any) -> int:
        if error is not None:
            raise error
        if seq_len is None and not local_len:
            raise ValueError("a dry run of a middle stage needs RankStep(seq_len=...)")
        return int(seq_len or local_len)

    return agree


def _initial_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Create the optimizer's state as a step does (a steady-state step holds it throughout)."""
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def steady_state(step: RankStep, checked: bool = True) -> None:
    """Make ``step`` (built inside the fake world) a steady-state step, as the dry run runs
    it: a Seq1F1B-family schedule's pre-flight agreement learns the length from
    ``step.seq_len`` (the fake process group returns no values) and, with ``checked``, its
    first-step checks are marked done; the optimizer's state is made (as from the second step
    on). ``checked=False`` leaves the checks to run: a first step (on real tensors only: they
    compare values)."""
    schedule = step.schedule
    if hasattr(schedule, "_agree"):  # a Seq1F1B-family schedule
        schedule._agree = _known_length(step.seq_len)
        if checked and step.seq_len is not None:  # the first-step checks ran
            schedule.unit_actions.as_checked(step.seq_len)
    _initial_optimizer_state(step.optimizer)


def dry_run_rank(
    build: Callable[[int], RankStep],
    rank: int,
    world_size: int,
    gpu: str | GpuSpec = "h100-80gb",
    holders: bool = False,
) -> RankReport:
    """Build rank ``rank`` of ``world_size`` with ``build`` under fake tensors and the fake
    process group, and run one steady-state step (optimizer state already held, as from the
    second step on): forward, backward and the optimizer's step. ``holders``: also record
    what holds the memory at the peak, each storage named by the op and module that made it
    (``RankReport.holders``; costs a walk over the live storages each time the total grows
    1%)."""
    if rt.HAS_WARMUP_P2P:
        raise RuntimeError(
            f"the dry run needs torch 2.15 or newer (this is {torch.__version__}): torch "
            "2.13/2.14's pipeline stages vote on a P2P warm-up at the first step and read the "
            "vote's value, which fake tensors do not hold. Run it in a torch 2.15 venv "
            "(scripts/setup_env.sh .venv 2.15.0)"
        )
    spec = gpu_spec(gpu) if isinstance(gpu, str) else gpu
    with (
        rt.fake_world(rank, world_size),
        rt.FakeTensorMode(allow_non_fake_inputs=True),
        rt.swapped_out_kept(),  # torch 2.15's use after free in to_empty (see the seam)
        rt.real_mesh_tables(),  # meshes FSDP makes in the fake build (dp shard x cp)
    ):
        step = build(rank)
        schedule = step.schedule
        steady_state(step)
        stages = list(step.stages)
        mt = rt.PipelineMemTracker(holders=holders)
        # torchtitan's OptimizersContainer holds one optimizer per model part: track those
        inner = getattr(step.optimizer, "optimizers", None) or [step.optimizer]
        mt.track_external(*step.modules, *(o for o in inner if o is not None),
                          *rt.gathered_parameters(step.modules))  # fmt: skip
        clock = DeviceTime(spec)
        sampler = _Sampler(schedule, stages, mt, clock)
        t0 = time.perf_counter()
        with mt, clock, rt.action_contexts_installed(stages, [sampler]):
            schedule.step(*step.args, target=step.target, **step.kwargs)
            if step.optimizer is not None:
                step.optimizer.step()
                step.optimizer.zero_grad(set_to_none=True)
        host = time.perf_counter() - t0
        peak = mt.get_tracker_snapshot("peak")
    units = sum(s.label.split()[-1][0] == "F" for s in sampler.samples)
    return RankReport(rank, type(schedule).__name__, spec, _breakdown(peak, sampler),
                      sampler.samples, clock.seconds, host, units,
                      mt.holders_at_peak() if holders else None)  # fmt: skip


def _breakdown(peak: dict, sampler: _Sampler) -> MemoryBreakdown:
    def kind(name: str) -> int:
        return sum(v.get(name, 0) for v in peak.values())

    act = kind("Activation")
    kv = min(sampler.kv_at_peak, act)
    recv = min(sampler.recv_at_peak, act - kv)
    return MemoryBreakdown(
        parameters=kind("Parameter") + kind("Buffer"),
        gradients=kind("Gradient"),
        optimizer=kind("Optstate"),
        activations=act - kv - recv,
        kv_cache=kv,
        receives=recv,
        temporaries=kind("Temp") + kind("Other"),
    )
