"""GPU profiles: what the planner's time and memory models assume about one kind of GPU.

Why: a ranking of schedules is only as good as the time constants behind it. A profile keeps
the figures that come from a public specification (peak dense bf16 FLOP/s, memory, NVLink and
inter-node bandwidth) apart from the few that no specification gives (what fraction of the
peak the matmuls and the attention kernel reach, a fixed cost per pipeline action, what
fraction of a link's peak the collectives reach), which are fitted to published measurements
(:mod:`benchmarks.planner_models.published`). Each constant carries its source.

The A100 profile is checked against the Seq1F1B paper's 7B table (all on A100s), the H100
profile against torchtitan's published H100 runs (:mod:`benchmarks.planner_models.published_titan`:
fitted on two, predicting two it never saw). H200 reuses the H100's fractions on its own
specifications, an assumption stated in :attr:`GpuProfile.checked`. A machine
measured here becomes a profile too (:func:`machine_spec`): its efficiencies fitted by the same
fit to its measured actions (:func:`seq1f1b.planning.fitting.cpu_profile`), or its per-kind
measured constants standing in for them (:func:`calibrated_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .costmodel import ActionCosts, Coefficients, Hardware

__all__ = [
    "CPU_NOMINAL_TFLOPS",
    "FLASH_BACKWARD_FLOPS",
    "PROFILES",
    "Efficiency",
    "GpuProfile",
    "calibrated_profile",
    "machine_spec",
    "profile",
]

#: FlashAttention's backward runs 2.5 times its forward FLOPs (5 matmuls to the forward's 2;
#: Dao, "FlashAttention-2", 2023, section 4.1); the projections' backward runs 2 times.
FLASH_BACKWARD_FLOPS = 2.5


@dataclass(frozen=True)
class Efficiency:
    """What a GPU achieves of its specification, fitted to measurements
    (:func:`seq1f1b.planning.fitting.fit_efficiency`).

    ``linear`` / ``attention``: fraction of the peak bf16 FLOP/s reached by the projections and
    FFN, and by causal flash attention; ``overhead_s``: fixed seconds per pipeline action
    (kernel launches, the pipeline's synchronisation, per-unit bookkeeping; what makes many
    short segments slower than their FLOPs); ``collectives``: fraction of a link's peak
    bandwidth the collectives reach (TP, FSDP, the CP ring); ``p2p``: fraction of the
    inter-node link the pipeline's sends reach."""

    linear: float
    attention: float
    overhead_s: float
    collectives: float
    p2p: float
    source: str
    #: the relative error of a throughput prediction this profile has shown on cells it was
    #: not fitted on; the planner reports predictions closer than this as ties
    error: float = 0.07
    error_source: str = "not demonstrated"


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: public specifications (with sources) and fitted efficiencies."""

    name: str
    memory_gb: float
    peak_tflops: float  # dense bf16 (no sparsity)
    nvlink_gbps: float  # per GPU, one direction
    #: per GPU, one direction (the node's compute NICs / GPUs); None: links not priced
    inter_node_gbps: float | None
    efficiency: Efficiency
    source: str  # where the specifications come from
    checked: str  # which measurements the profile's predictions were compared with
    gpus_per_node: int = 8
    #: memory no formula counts (CUDA context and kernel libraries' workspaces, NCCL buffers,
    #: allocator slack); the planner's default ``--reserve-gb``
    reserve_gb: float = 4.0
    #: per-action constants fitted to this machine's measured actions, standing in for the
    #: efficiencies (:func:`calibrated_profile`); None: from the efficiencies
    measured: ActionCosts | None = None
    #: the dtype the kernels its efficiencies describe ran in: a GPU's bf16 (the planner slows
    #: them for fp32 settings), a measured CPU's fp32 (priced as measured in every precision)
    precision: str = "bf16"

    def action_costs(self) -> ActionCosts:
        """Per-GPU seconds of each action: the measured constants, or FLOPs at the fitted
        fractions of the peak (backward: 2 times the projections', :data:`FLASH_BACKWARD_FLOPS`
        times the attention's), plus the fixed overhead per action. A split backward divides
        those FLOPs as they fall: the input gradient (I) the projections' once and all of the
        attention's, the weight gradient (W) the projections' once (attention has no
        weights); each is an action of its own, with its own overhead."""
        if self.measured is not None:
            return self.measured
        peak = self.peak_tflops * 1e12
        lin = 1 / (peak * self.efficiency.linear)
        att = 1 / (peak * self.efficiency.attention)
        o = self.efficiency.overhead_s
        forward = Coefficients(lin, att, overhead=o)
        backward = Coefficients(2 * lin, FLASH_BACKWARD_FLOPS * att, overhead=o)
        backward_input = Coefficients(lin, FLASH_BACKWARD_FLOPS * att, overhead=o)
        backward_weight = Coefficients(lin, 0.0, overhead=o)
        return ActionCosts(
            forward,
            backward,
            backward_input,
            backward_weight,
            source=f"profile {self.name}",
            precision=self.precision,
        )

    def hardware(self, gpus: int, reserve_gb: float | None = None) -> Hardware:
        """The planner's :class:`~seq1f1b.planning.costmodel.Hardware` for ``gpus`` of these,
        links at the fitted fraction of their peak."""
        eff = self.efficiency
        return Hardware(
            gpus,
            self.memory_gb,
            self.reserve_gb if reserve_gb is None else reserve_gb,
            tflops=self.peak_tflops * eff.linear,
            tp_gbps=self.nvlink_gbps * eff.collectives,
            inter_node_gbps=(
                None if self.inter_node_gbps is None else self.inter_node_gbps * eff.collectives
            ),
            p2p_efficiency=eff.p2p / eff.collectives,
            gpus_per_node=self.gpus_per_node,
        )

    def with_efficiency(self, efficiency: Efficiency) -> GpuProfile:
        return replace(self, efficiency=efficiency)


#: Fitted by ``python -m benchmarks.planner_models.vs_published --refit``
#: (benchmarks.planner_models.published.fit) on the cells named in
#: benchmarks.planner_models.published.FIT_CELLS; the other cells are predicted.
A100_FIT = Efficiency(
    linear=0.902,
    attention=0.637,
    overhead_s=0.0104,
    collectives=0.313,
    p2p=0.164,
    source="fitted on 5 cells of the Seq1F1B paper's 7B table on A100s "
    "(benchmarks.planner_models.published.FIT_CELLS)",
    error=0.03,
    error_source="the largest error of a held-out schedule-to-1F1B TFLOPS ratio of the "
    "Seq1F1B paper's 7B table, 2.7% (Seq1F1B-I at 64k; "
    "python -m benchmarks.planner_models.vs_published)",
)

#: Fitted by ``python -m benchmarks.planner_models.vs_published --titan --refit``
#: (benchmarks.planner_models.published_titan.fit_h100) on torchtitan's two compiled FSDP
#: cells (8B on 8 and on 128 H100s): the A100's kernel fractions times one scale (0.459), and the
#: collectives' fraction of the links; the per-action overhead and the pipeline sends' fraction
#: stay the A100's (no published H100 run has a pipeline). Grand Teton's H100s ran at 500 W:
#: a 700 W H100 SXM reaches more of its peak than these fractions say.
H100_FIT = Efficiency(
    linear=0.414,
    attention=0.293,
    overhead_s=A100_FIT.overhead_s,
    collectives=0.553,
    p2p=A100_FIT.p2p,
    source="fitted on torchtitan's published H100 runs: 8B FSDP 8 and FSDP 128, compiled "
    "(benchmarks.planner_models.published_titan.FIT)",
    error=0.03,
    error_source="held out: torchtitan's 8B FSDP 8 x TP 8 run within 1.8% (its ratio to FSDP 8 "
    "within 1.9%), its 70B FSDP 32 x TP 8 run 15% under (python -m "
    "benchmarks.planner_models.vs_published --titan); 3%, as the A100's ratios",
)

_H200_UNCHECKED = (
    "not checked against any measurement: the H100's fitted efficiencies on this GPU's "
    "specifications"
)

PROFILES: dict[str, GpuProfile] = {
    "a100-80gb": GpuProfile(
        "a100-80gb",
        memory_gb=80.0,
        peak_tflops=312.0,
        nvlink_gbps=300.0,
        inter_node_gbps=25.0,
        efficiency=A100_FIT,
        source="NVIDIA A100 datasheet (SXM4 80GB: 312 TFLOPS dense BF16, 80 GB HBM2e, NVLink "
        "600 GB/s both directions); DGX A100 datasheet (8 ConnectX-6 HDR 200 Gb/s for 8 GPUs)",
        checked="the Seq1F1B paper's 7B table on 32 A100s (benchmarks.planner_models.published)",
    ),
    "h100-80gb": GpuProfile(
        "h100-80gb",
        memory_gb=80.0,
        peak_tflops=989.0,
        nvlink_gbps=450.0,
        inter_node_gbps=50.0,
        efficiency=H100_FIT,
        source="NVIDIA H100 datasheet (SXM5: 989 TFLOPS dense BF16, 80 GB HBM3, NVLink 900 GB/s "
        "both directions); DGX H100 datasheet (8 ConnectX-7 400 Gb/s for 8 GPUs)",
        checked="torchtitan's published Llama 3 runs on 500 W, 96 GB H100s "
        "(benchmarks.planner_models.published_titan)",
    ),
    "h200": GpuProfile(
        "h200",
        memory_gb=141.0,
        peak_tflops=989.0,
        nvlink_gbps=450.0,
        inter_node_gbps=50.0,
        efficiency=H100_FIT,
        source="NVIDIA H200 datasheet (SXM: 989 TFLOPS dense BF16, 141 GB HBM3e, NVLink 900 "
        "GB/s both directions); DGX H200 datasheet (8 ConnectX-7 400 Gb/s for 8 GPUs)",
        checked=_H200_UNCHECKED,
    ),
}


#: a measured machine's nominal peak: 2 cores x 3 GHz x 32 fp32 FLOPs per cycle (two 8-wide
#: FMA units, AVX2) of this machine's AMD EPYC, about 0.19 TFLOP/s; a stated constant, not a
#: measurement: its fitted fractions are relative to it, its predictions do not depend on it
CPU_NOMINAL_TFLOPS = 0.192


def machine_spec(
    memory_gb: float,
    *,
    name: str = "cpu",
    tflops: float = CPU_NOMINAL_TFLOPS,
    tp_gbps: float = 300.0,
    reserve_gb: float = 4.0,
    source: str = "measured actions",
) -> GpuProfile:
    """A machine measured here (``source``): ``tflops`` a nominal peak, TP collectives at
    ``tp_gbps``, no inter-node link (pipeline sends across nodes not priced); its
    efficiencies not yet fitted (:func:`seq1f1b.planning.fitting.cpu_profile` fits them)."""
    return GpuProfile(
        name,
        memory_gb=memory_gb,
        peak_tflops=tflops,
        nvlink_gbps=tp_gbps,
        inter_node_gbps=None,
        efficiency=Efficiency(0.5, 0.5, 0.01, 1.0, 1.0, "not fitted"),
        source=f"measured on this machine ({source}); peak {tflops:g} TFLOP/s nominal",
        checked="the measured actions of python -m benchmarks.planner_models.time_costs",
        reserve_gb=reserve_gb,
        precision="fp32",  # the CPU ranks of benchmarks/harness run fp32
    )


def calibrated_profile(costs: ActionCosts, spec: GpuProfile) -> GpuProfile:
    """A measured machine (``spec``, :func:`machine_spec`) whose actions are priced by
    per-kind constants fitted to its measured actions
    (:func:`seq1f1b.planning.calibration.fit_action_costs`) instead of its efficiencies."""
    eff = Efficiency(1.0, 1.0, 0.0, 1.0, 1.0, costs.source, error_source=costs.source)
    return replace(spec, efficiency=eff, measured=costs)


def profile(name: str) -> GpuProfile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown GPU profile {name!r}: use one of {', '.join(sorted(PROFILES))}"
        ) from None
