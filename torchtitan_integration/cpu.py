"""CPU/gloo support for torchtitan 0.2.2, and the list of every patch this integration makes
to it (0.3.0's list, which shares patches 1-4, is in :mod:`.v03.cpu`).

torchtitan picks its device once, at import (``tools.utils.device_type`` falls back to "cuda"
when no accelerator is found) and then assumes the CUDA allocator and NCCL. The patches, all
made by :func:`install` (called only by the train entry, ``train.run``) and undone by the
handle it returns:

1. torchtitan is imported while torch reports "cpu" as the available device type (the
   attribute named by ``seq1f1b._runtime.device_type_probe``, reassigned for the length of the
   import only and restored), so its own code selects the CPU device and the gloo backend;
   modules that copied the device choice before are rebound to "cpu" (and back on undo);
2. its device memory monitor reads the process's real resident memory (``/proc/self/status``:
   VmRSS now, VmHWM peak, reset through ``/proc/self/clear_refs``), so the memory metrics are
   measurements, not zeros;
3. ``set_pg_timeouts``, whose barrier passes CUDA ``device_ids`` that gloo rejects, is replaced;
4. ``get_peak_flops`` (which knows GPUs only and falls back to an A100's 312 TFLOP/s, so the
   logged MFU read 0.00%) returns this process's measured fp32 GEMM throughput, so MFU is
   relative to what one rank's cores can actually do;
5. (any device, BitPipe only) for the length of one ``train_step``, torchtitan's
   ``clip_grad_norm_`` takes the norm over each layer chunk once (``trainer.py``), since BitPipe
   holds every chunk twice; torchtitan offers no hook for the norm;
6. (any device, context parallelism with a Seq1F1B schedule only) for the length of the
   ``parallelize_fn`` call, torchtitan's ``apply_cp_to_attention_module`` only checks that the
   attention is chunk-aware (``spec.py``): the schedule shards the sequence and runs its own
   ring attention, and the trainer skips torchtitan's CP input sharding (``trainer.py``).

Nothing is changed when CUDA is available (patches 5 and 6 apart). Checked against torchtitan 0.2.2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from seq1f1b._runtime import device_type_probe, set_pg_timeout

logger = logging.getLogger(__name__)

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


def measured_peak_flops(device_name: str = "cpu", size: int = 512, seconds: float = 0.2) -> float:
    """fp32 GEMM FLOP/s of this process on the CPU (its threads), timed for ~``seconds``.

    In a distributed run every rank calls this at the same point (torchtitan's metrics set-up),
    so the ranks average their measurements: the MFU each rank logs (console on rank 0,
    TensorBoard on the last stage's rank) is relative to one peak. Measured once per process.
    """
    del device_name
    key = (size, seconds)
    if key not in _PEAK:
        _PEAK[key] = _measure_gemm(size, seconds)
    flops = _PEAK[key]
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


_PEAK: dict[tuple[int, float], float] = {}


def _measure_gemm(size: int, seconds: float) -> float:
    g = torch.Generator().manual_seed(0)  # leaves the global RNG (model init) untouched
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    torch.mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        n += 1
    return 2 * size**3 * n / elapsed


def _set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
    torch.distributed.barrier()
    groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        set_pg_timeout(timeout, group)


@dataclass
class CPUSupport:
    """What :func:`install` changed, so that :meth:`uninstall` can put it back."""

    saved: list[tuple[Any, str, Any]] = field(default_factory=list)

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.saved.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def uninstall(self) -> None:
        for obj, name, value in reversed(self.saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
        self.saved.clear()


_MISSING = object()


def rebind_device(patches: CPUSupport, module_names: tuple[str, ...]) -> None:
    """Modules that copied torchtitan's device choice at import see "cpu" (shared by both
    torchtitan versions' patch lists: patch 1)."""
    for name in module_names:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "device_type"):
            patches.set(module, "device_type", "cpu")
            if hasattr(module, "device_module"):
                patches.set(module, "device_module", torch.cpu)


def patch_metrics_and_comms(patches: CPUSupport, metrics: Any, dist_utils: Any, tools: Any) -> None:
    """Patches 2-4, the same names in torchtitan 0.2.2 and 0.3.0: resident-memory monitor,
    gloo-safe ``set_pg_timeouts``, measured CPU peak FLOP/s."""
    if hasattr(metrics, "DeviceMemoryMonitor"):
        patches.set(metrics, "DeviceMemoryMonitor", CPUMemoryMonitor)
    patches.set(metrics, "build_device_memory_monitor", CPUMemoryMonitor)
    patches.set(dist_utils, "set_pg_timeouts", _set_pg_timeouts)
    patches.set(tools, "get_peak_flops", measured_peak_flops)


def install() -> CPUSupport | None:
    """Make torchtitan 0.2.2 run on CPU with gloo when there is no GPU; None if nothing was
    needed.

    Best called before anything imports torchtitan; if it was imported earlier, the modules
    that copied its device choice are rebound.
    """
    if torch.cuda.is_available():
        return None
    importing = CPUSupport()  # patch 1, for the length of torchtitan's import only
    importing.set(*device_type_probe(), lambda: "cpu")
    try:
        import torchtitan.distributed.dual_pipe_v  # reads the device at import, like tools.utils
        import torchtitan.tools.utils
        import torchtitan.train
    finally:
        importing.uninstall()
    patches = CPUSupport()
    # if torchtitan was imported before us, its modules hold "cuda": rebind them
    rebind_device(patches, _DEVICE_MODULES)

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    patch_metrics_and_comms(patches, metrics, dist_utils, torchtitan.tools.utils)
    assert torchtitan.tools.utils.device_type == "cpu"
    logger.info("torchtitan runs on CPU with gloo (no CUDA device found)")
    return patches


@contextlib.contextmanager
def cpu_support() -> Iterator[CPUSupport | None]:
    """The patches for the duration of a ``with`` block (the train entry's whole run)."""
    patches = install()
    try:
        yield patches
    finally:
        if patches is not None:
            patches.uninstall()
