"""What CPU/gloo runs put in place of torchtitan's GPU-only pieces (both versions).

torchtitan picks its device once, at import, and then assumes the CUDA allocator and NCCL.
The replacements here are plain functions and classes; each version's patch list
(``v022/patches.py``, ``v03/patches.py``) says which torchtitan names they replace and for how
long. Nothing here imports torchtitan or patches anything.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch

from seq1f1b._runtime import set_pg_timeout

logger = logging.getLogger(__name__)


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


class CPUMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor interface over the process's resident memory
    (VmRSS now, VmHWM peak), so the memory metrics are measurements, not zeros.

    ``stats`` names torchtitan's ``DeviceMemStats`` (set by :func:`memory_monitor`).
    """

    stats: Any = None  # a patches.Target

    def __init__(self, device: str = "cpu") -> None:
        del device
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 1024**3
        self.reset_peak_stats()

    def get_peak_stats(self) -> Any:
        now, peak = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmHWM")
        gib = 1024**3
        return self.stats.get()(
            now / gib,
            100 * now / self.device_capacity,
            peak / gib,
            100 * peak / self.device_capacity,
            0,
            0,
        )

    def reset_peak_stats(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:  # pragma: no cover - not Linux, or not permitted
            pass


def memory_monitor(stats: Any) -> type[CPUMemoryMonitor]:
    """:class:`CPUMemoryMonitor` reporting in the type ``stats`` names (a seam's ``Target`` of
    torchtitan's ``DeviceMemStats``)."""
    return type("CPUMemoryMonitor", (CPUMemoryMonitor,), {"stats": stats})


def measured_peak_flops(device_name: str = "cpu", size: int = 512, seconds: float = 0.2) -> float:
    """fp32 GEMM FLOP/s of this process on the CPU (its threads), timed for ~``seconds``:
    what MFU is relative to on CPU (torchtitan's ``get_peak_flops`` knows GPUs only and falls
    back to an A100's 312 TFLOP/s, so the logged MFU read 0.00%).

    In a distributed run every rank calls this at the same point (torchtitan's metrics set-up),
    so the ranks average their measurements: the MFU each rank logs is relative to one peak.
    """
    del device_name
    flops = _measure_gemm(size, seconds)
    if torch.distributed.is_initialized():
        t = torch.tensor([flops], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        flops = float(t.item()) / torch.distributed.get_world_size()
    logger.info(
        "CPU peak for MFU: %.1f GFLOP/s (measured fp32 %d^3 GEMM, %d threads, mean over ranks)",
        flops / 1e9,
        size,
        torch.get_num_threads(),
    )
    return flops


def _measure_gemm(size: int, seconds: float) -> float:
    g = torch.Generator().manual_seed(0)  # leaves the global RNG (model init) untouched
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    torch.mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        n += 1
    return 2 * size**3 * n / elapsed


def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
    """torchtitan's ``set_pg_timeouts`` without CUDA ``device_ids`` in its barrier (which
    gloo rejects)."""
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        set_pg_timeout(timeout, group)


def cpu_device() -> torch.device:
    """The CPU device, for 0.3's ``get_local_device`` (which indexes the visible
    accelerators by LOCAL_RANK and raises for rank >= 1 on CPU)."""
    return torch.device("cpu")
