"""CPU/gloo support for torchtitan 0.3.0: the list of every patch made to it.

0.3 chooses its device at import like 0.2.2 (``tools.utils.device_type = ... or "cuda"``), then
``Trainer.__init__`` calls ``device_module.set_device(get_local_device())``, which fails on a
machine without CUDA. :func:`install` is called by :class:`..trainer.Seq1F1BTrainer` when it
is built (and only when CUDA is absent); the handle it returns undoes everything when the
trainer closes. Patches 1-4 are shared with 0.2.2 (:mod:`torchtitan_integration.cpu`):

1. the modules that copied the device choice at import see "cpu" and ``torch.cpu``, so
   torchtitan initialises gloo (its backend map gives gloo for "cpu");
2. the device memory monitor reads the process's resident memory (VmRSS/VmHWM);
3. ``set_pg_timeouts`` uses a barrier without CUDA ``device_ids``;
4. ``get_peak_flops`` returns this process's measured fp32 GEMM throughput, so MFU is relative
   to what one rank's cores can do;
5. ``tools.utils.get_local_device`` returns the CPU device (0.3's version indexes the visible
   accelerators by LOCAL_RANK and raises for rank >= 1 on CPU).

Checked against torchtitan 0.3.0. Upstream hook that would remove patches 1 and 5: a device
type taken from the config (or ``TORCHTITAN_DEVICE``) instead of fixed at import.
"""

from __future__ import annotations

import logging
import sys

import torch

from ..cpu import CPUSupport, patch_metrics_and_comms, rebind_device

logger = logging.getLogger(__name__)

# modules of 0.3.0 that bind tools.utils.device_type / device_module at import
DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def install() -> CPUSupport | None:
    """The patches above, or None when CUDA is available (nothing to do)."""
    if torch.cuda.is_available():
        return None
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools

    patches = CPUSupport()
    rebind_device(patches, tuple(m for m in DEVICE_MODULES if m in sys.modules))
    patch_metrics_and_comms(patches, metrics, dist_utils, tools)
    patches.set(tools, "get_local_device", _cpu_device)
    logger.info("torchtitan runs on CPU with gloo (no CUDA device found)")
    return patches
