"""CPU/gloo support for torchtitan 0.2.2 — the one place where torchtitan is patched.

torchtitan picks its device once, at import (``tools.utils.device_type`` falls back to "cuda"
when no accelerator is found) and then assumes the CUDA allocator and NCCL. Without a GPU we:

1. import torchtitan while torch reports "cpu" as the available device type, so torchtitan's
   own code selects the CPU device and the gloo backend (``default_device_backend_map``);
2. replace its device memory monitor with one that reads the process's real resident memory
   (``/proc/self/status``: VmRSS now, VmHWM peak; the peak is reset through
   ``/proc/self/clear_refs``), so the memory metrics are measurements, not zeros;
3. replace ``set_pg_timeouts``, whose barrier passes CUDA ``device_ids`` that gloo rejects.

Nothing is changed when CUDA is available. Checked against torchtitan 0.2.2.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import Any

import torch

from seq1f1b._runtime import device_type_reported_as, set_pg_timeout

logger = logging.getLogger(__name__)

_INSTALLED = False
# modules that bind torchtitan.tools.utils.device_type / device_module at import
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
    "torchtitan.train",
)


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


class CPUMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor interface over the process's resident memory."""

    def __init__(self, device: str = "cpu") -> None:
        del device
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 1024**3
        self.reset_peak_stats()

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats

        now, peak = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmHWM")
        gib = 1024**3
        return DeviceMemStats(
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


def _set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        set_pg_timeout(timeout, group)


def install() -> bool:
    """Make torchtitan run on CPU with gloo when there is no GPU; True if it did anything.

    Best called before anything imports torchtitan; if it was imported earlier, the modules
    that copied its device choice are rebound.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    with device_type_reported_as("cpu"):
        import torchtitan.distributed.dual_pipe_v  # reads the device at import, like tools.utils
        import torchtitan.tools.utils
        import torchtitan.train
    # if torchtitan was imported before us, its modules hold "cuda": rebind them
    for name in _DEVICE_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "device_type"):
            module.device_type, module.device_module = "cpu", torch.cpu

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    metrics.DeviceMemoryMonitor = CPUMemoryMonitor
    metrics.build_device_memory_monitor = CPUMemoryMonitor
    dist_utils.set_pg_timeouts = _set_pg_timeouts
    assert torchtitan.tools.utils.device_type == "cpu"
    _INSTALLED = True
    logger.info("torchtitan runs on CPU with gloo (no CUDA device found)")
    return True
