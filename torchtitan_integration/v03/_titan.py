"""The seam to torchtitan 0.3.0: every torchtitan name this version folder uses that is
private, reassigned by a patch, or an internal registry it writes to.

Nothing else in ``v03/`` names these; the other modules use torchtitan's public API
(``Trainer`` and its ``Config``, ``ConfigManager``, ``Validator``, the llama3
``model_registry``, the loss and optimizer configs). Each name is a
:class:`~torchtitan_integration.patches.Target` (imported only when used).

Names below are under ``torchtitan.`` unless they say otherwise.

| torchtitan name                    | what for                | rel.  | hook that would remove it |
|------------------------------------|-------------------------|-------|---------------------------|
| <device modules>.device_type,      | patch 1: modules that   | 0.3.0 | a device type from the    |
| <device modules>.device_module     | copied the import-time  |       | config                    |
|                                    | device see cpu          |       |                           |
| components.metrics.                | patch 2: memory metrics | 0.3.0 | a CPU memory monitor      |
| DeviceMemoryMonitor,               | from resident memory    |       |                           |
| build_device_memory_monitor,       |                         |       |                           |
| DeviceMemStats                     |                         |       |                           |
| distributed.utils.set_pg_timeouts  | patch 3: barrier        | 0.3.0 | device_ids for NCCL only  |
|                                    | without CUDA device_ids |       |                           |
|                                    | (gloo)                  |       |                           |
| tools.utils.get_peak_flops         | patch 4: MFU against    | 0.3.0 | a peak-FLOPs setting      |
|                                    | the measured CPU peak   |       |                           |
| tools.utils.get_local_device       | patch 5: the CPU device | 0.3.0 | as patch 1                |
|                                    | for every LOCAL_RANK    |       |                           |
| distributed.utils.clip_grad_norm_  | patch 6: BitPipe's norm | 0.3.0 | a clip function in the    |
|                                    | counts each chunk once  |       | model spec                |
| components.metrics.datetime        | patch 7: one            | 0.3.0 | a run id in the metrics   |
|                                    | TensorBoard folder per  |       | config                    |
|                                    | run                     |       |                           |
| trainer.ensure_pp_loss_visible     | patch 7: no 'PP loss    | 0.3.0 | a trainer giving every    |
|                                    | not visible' warning    |       | rank the PP loss          |
| hf_datasets.text_datasets.DATASETS | offline pycode datasets | 0.3.0 | a dataset registration    |
|                                    | (entries added)         |       | function                  |
| protocols.module.Module            | patch 8: a dry run's    | 0.3.0 | an init switch (meta-only |
| ._init_param                       | fake weights are not    |       | or skip) in the trainer   |
|                                    | initialised             |       |                           |
| distributed.pipeline_parallel.     | Seq1F1B's and BitPipe's | 0.3.0 | a public stage-split API  |
| _generate_llm_fqn_per_model_part,  | stages cut as           |       |                           |
| _pipeline_module_split,            | torchtitan cuts         |       |                           |
| _split_module,                     |                         |       |                           |
| _build_get_mesh_callback           |                         |       |                           |
"""

from __future__ import annotations

from ..patches import Target

#: modules of 0.3.0 that bind ``tools.utils.device_type`` / ``device_module`` at import
DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiler",
)

_METRICS = "torchtitan.components.metrics"
_DIST_UTILS = "torchtitan.distributed.utils"
_TOOLS = "torchtitan.tools.utils"
_PIPELINE = "torchtitan.distributed.pipeline_parallel"

MEMORY_MONITOR = Target(_METRICS, "DeviceMemoryMonitor")
BUILD_MEMORY_MONITOR = Target(_METRICS, "build_device_memory_monitor")
MEMORY_STATS = Target(_METRICS, "DeviceMemStats")
SET_PG_TIMEOUTS = Target(_DIST_UTILS, "set_pg_timeouts")
PEAK_FLOPS = Target(_TOOLS, "get_peak_flops")
LOCAL_DEVICE = Target(_TOOLS, "get_local_device")
CLIP_GRAD_NORM = Target(_DIST_UTILS, "clip_grad_norm_")
METRICS_DATETIME = Target(_METRICS, "datetime")
PP_LOSS_WARNING = Target("torchtitan.trainer", "ensure_pp_loss_visible")
DATASETS = Target("torchtitan.hf_datasets.text_datasets", "DATASETS")
DATASET_CONFIG = Target("torchtitan.hf_datasets", "DatasetConfig")
FQNS_PER_PART = Target(_PIPELINE, "_generate_llm_fqn_per_model_part")
MODULE_SPLIT = Target(_PIPELINE, "_pipeline_module_split")
SPLIT_MODULE = Target(_PIPELINE, "_split_module")
MESH_CALLBACK = Target(_PIPELINE, "_build_get_mesh_callback")
#: patch 8 (the dry run): each module's parameter initialiser
INIT_PARAM = Target("torchtitan.protocols.module", "Module._init_param")
