"""Every reassignment this integration makes to torchtitan 0.3.0, by scope.

Each scope is a tuple of :class:`~torchtitan_integration.patches.Patch` entries, installed by
:func:`~torchtitan_integration.patches.applied` (or :func:`install_cpu`) and undone when the
scope ends; the names are in :mod:`._titan`, the replacements in the core
(:mod:`..cpu`, :mod:`..common`, :mod:`..bitpipe`). Importing a module of this integration
patches nothing.

0.3 chooses its device at import like 0.2.2 (``tools.utils.device_type = ... or "cuda"``),
then ``Trainer.__init__`` calls ``device_module.set_device(get_local_device())``, which fails
without CUDA. Without a GPU (:func:`install_cpu`, called by the trainer when it is built and
undone when it closes; nothing when CUDA is there):

1. the modules that copied the device choice at import see "cpu" and ``torch.cpu``, so
   torchtitan initialises gloo (its backend map gives gloo for "cpu");
2. the device memory monitor reads the process's resident memory (VmRSS/VmHWM);
3. ``set_pg_timeouts`` uses a barrier without CUDA ``device_ids``;
4. ``get_peak_flops`` returns this process's measured fp32 GEMM throughput, so MFU is relative
   to what one rank's cores can do;
5. ``tools.utils.get_local_device`` returns the CPU device.

On any device:

6. :data:`BITPIPE_STEP`, for one BitPipe train step: ``clip_grad_norm_`` takes the norm over
   each layer chunk once, since BitPipe holds every chunk twice;
7. :data:`TRAINER_INIT`, for the trainer's ``__init__``: one TensorBoard folder per run, and
   no "PP loss not visible" warning (the trainer gives rank 0 the loss);
8. :data:`DRY_RUN`, for a dry run's trainer ``__init__`` (:mod:`.dry_run`): parameters are
   not initialised (fake tensors hold no values, and the truncated normal reads them).

Checked against torchtitan 0.3.0.
"""

from __future__ import annotations

import torch

from ..bitpipe import clip_counting_each_chunk_once
from ..common import RunStamp, no_pp_loss_warning
from ..cpu import cpu_device, measured_peak_flops, memory_monitor, set_pg_timeouts
from ..patches import Installed, Patch, Target, install_cpu_support
from . import _titan

_MEMORY_MONITOR = memory_monitor(_titan.MEMORY_STATS)  # patch 2

#: patches 1-5, while the trainer lives (no GPU)
CPU = (
    Patch.to(_titan.BUILD_MEMORY_MONITOR, _MEMORY_MONITOR),
    Patch.to(_titan.MEMORY_MONITOR, _MEMORY_MONITOR, optional=True),
    Patch.to(_titan.SET_PG_TIMEOUTS, set_pg_timeouts),
    Patch.to(_titan.PEAK_FLOPS, measured_peak_flops),
    Patch.to(_titan.LOCAL_DEVICE, cpu_device),
    # patch 1, last: the modules imported by the patches above are rebound too
    *(
        Patch.to(Target(module, attr), value, optional=True)
        for module in _titan.DEVICE_MODULES
        for attr, value in (("device_type", "cpu"), ("device_module", torch.cpu))
    ),
)

#: patch 6, for one BitPipe train step (the scope's argument: the schedule)
BITPIPE_STEP = (Patch(_titan.CLIP_GRAD_NORM, clip_counting_each_chunk_once),)

#: patch 7, for the trainer's __init__
TRAINER_INIT = (
    Patch.to(_titan.METRICS_DATETIME, RunStamp),
    Patch.to(_titan.PP_LOSS_WARNING, no_pp_loss_warning),
)




def _no_init(_original: object) -> object:
    def skip(self: object, name: str, param: object) -> None:
        """A dry run's fake weights hold no values: nothing to initialise."""

    return skip


#: patch 8, for a dry run's trainer __init__
DRY_RUN = (Patch(_titan.INIT_PARAM, _no_init),)


def install_cpu() -> Installed | None:
    """Patches 1-5 when there is no GPU (None otherwise); the caller uninstalls them."""
    return install_cpu_support(CPU)
