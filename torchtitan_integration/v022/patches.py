"""Every reassignment this integration makes to torchtitan 0.2.2 (and torch), by scope.

Each scope is a tuple of :class:`~torchtitan_integration.patches.Patch` entries, installed by
:func:`~torchtitan_integration.patches.applied` (or :func:`install_cpu`) and undone when the
scope ends; the names are in :mod:`._titan`, the replacements in the core
(:mod:`..cpu`, :mod:`..common`, :mod:`..bitpipe`). Importing a module of this integration
patches nothing.

Without a GPU (``install_cpu``, for the train entry's whole run; nothing when CUDA is there):

1. torchtitan is imported while torch reports "cpu" as the available device type
   (:data:`WHILE_IMPORTING`, for the import only), so its own code selects the CPU device and
   the gloo backend; modules that copied the device choice before are rebound to "cpu";
2. its device memory monitor reads the process's resident memory (VmRSS now, VmHWM peak);
3. ``set_pg_timeouts``, whose barrier passes CUDA ``device_ids`` that gloo rejects, is replaced;
4. ``get_peak_flops`` returns this process's measured fp32 GEMM throughput, so MFU is relative
   to what one rank's cores can do.

On any device:

5. :data:`BITPIPE_STEP`, for one BitPipe train step: ``clip_grad_norm_`` takes the norm over
   each layer chunk once, since BitPipe holds every chunk twice;
6. :data:`PARALLELIZE_WITHOUT_CP`, for the ``parallelize_fn`` call under context parallelism
   with a Seq1F1B schedule: ``apply_cp_to_attention_module`` only checks that the attention
   is chunk-aware (the schedule shards the sequence and runs its own ring attention);
7. :data:`TRAINER_INIT`, for the trainer's ``__init__``: one TensorBoard folder per run, and
   no "PP loss not visible" warning (the trainer gives rank 0 the loss).
8. :data:`SAC_SAVES_ATTENTION`, for every ``parallelize_fn`` call: torchtitan's op-level
   selective AC saves the chunk-aware attention's ops too (:func:`seq1f1b.checkpoint_save_ops`;
   its list holds torch's attention kernels only, so it would recompute the compiled
   chunk-aware attention, a whole attention forward, in every backward).

Checked against torchtitan 0.2.2.
"""

from __future__ import annotations

from typing import Any

import torch

from seq1f1b import checkpoint_save_ops
from seq1f1b._runtime import device_type_probe

from ..bitpipe import clip_counting_each_chunk_once
from ..common import RunStamp, no_pp_loss_warning
from ..cpu import measured_peak_flops, memory_monitor, set_pg_timeouts
from ..patches import Installed, Patch, Target, install_cpu_support
from . import _titan
from .model import ChunkAwareSDPA


def _torch_device_probe() -> Target:
    owner, attr = device_type_probe()
    return Target(owner.__name__, attr)


#: patch 1, for the length of torchtitan's import
WHILE_IMPORTING = (Patch.to(_torch_device_probe(), lambda: "cpu"),)

_MEMORY_MONITOR = memory_monitor(_titan.MEMORY_STATS)  # patch 2

#: patches 1-4, for the run (no GPU)
CPU = (
    Patch.to(_titan.BUILD_MEMORY_MONITOR, _MEMORY_MONITOR),
    Patch.to(_titan.MEMORY_MONITOR, _MEMORY_MONITOR, optional=True),
    Patch.to(_titan.SET_PG_TIMEOUTS, set_pg_timeouts),
    Patch.to(_titan.PEAK_FLOPS, measured_peak_flops),
    # patch 1, last: the modules imported by the patches above are rebound too
    *(
        Patch.to(Target(module, attr), value, optional=True)
        for module in _titan.DEVICE_MODULES
        for attr, value in (("device_type", "cpu"), ("device_module", torch.cpu))
    ),
)

#: patch 5, for one BitPipe train step (the scope's argument: the schedule)
BITPIPE_STEP = (Patch(_titan.CLIP_GRAD_NORM, clip_counting_each_chunk_once),)


def _check_chunk_aware(modules: Any, cp_mesh: Any, attention_type: str) -> None:
    del cp_mesh, attention_type
    for m in modules:
        if not isinstance(m, ChunkAwareSDPA):
            raise ValueError(
                f"{type(m).__name__} is not chunk-aware attention: Seq1F1B's context "
                "parallelism needs every attention layer converted (make_chunk_aware)"
            )


#: patch 6, for the parallelize_fn call when the schedule does context parallelism
PARALLELIZE_WITHOUT_CP = (Patch.to(_titan.APPLY_CP, _check_chunk_aware),)


def _saving_chunk_aware_attention(save_list: Any) -> set:
    return set(save_list) | checkpoint_save_ops()


#: patch 8, for every parallelize_fn call
SAC_SAVES_ATTENTION = (Patch(_titan.SAC_SAVE_LIST, _saving_chunk_aware_attention),)

#: patch 7, for the trainer's __init__
TRAINER_INIT = (
    Patch.to(_titan.METRICS_DATETIME, RunStamp),
    Patch.to(_titan.PP_LOSS_WARNING, no_pp_loss_warning),
)


def install_cpu() -> Installed | None:
    """Patches 1-4 when there is no GPU (None otherwise); the caller uninstalls them.

    Best called before anything imports torchtitan; if it was imported earlier, the modules
    that copied its device choice are rebound.
    """
    installed = install_cpu_support(
        CPU, import_first=_titan.DEVICE_READERS, while_importing=WHILE_IMPORTING
    )
    if installed is not None:
        import torchtitan.tools.utils

        assert torchtitan.tools.utils.device_type == "cpu"
    return installed
