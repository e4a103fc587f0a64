"""The dry run: one training step of each pipeline rank at its real size, on one CPU, under
fake tensors and the fake process group, with torch's MemTracker for the memory and a roofline
per op for the device time (docs/dry_run.md)."""

from .estimate import DeviceTime, GpuSpec, gpu_spec
from .step import ActionSample, MemoryBreakdown, RankReport, RankStep, dry_run_rank, static_stage

__all__ = [
    "ActionSample",
    "DeviceTime",
    "GpuSpec",
    "MemoryBreakdown",
    "RankReport",
    "RankStep",
    "dry_run_rank",
    "gpu_spec",
    "static_stage",
]
