"""The seam to torchtitan 0.2.2: every torchtitan name this version folder uses that is
private, reassigned by a patch, or an internal registry it writes to.

Nothing else in ``v022/`` names these; the other modules use torchtitan's public API
(``Trainer``, ``ConfigManager``, the llama3 model, the train-spec functions). Each name is a
:class:`~torchtitan_integration.patches.Target` (imported only when used).

Names below are under ``torchtitan.`` unless they say otherwise.

| torchtitan name                    | what for                | rel.  | hook that would remove it |
|------------------------------------|-------------------------|-------|---------------------------|
| torch._utils.                      | patch 1: torchtitan     | 0.2.2 | as below                  |
| _get_available_device_type         | imported seeing cpu     |       |                           |
|                                    | (torch's name:          |       |                           |
|                                    | seq1f1b._runtime)       |       |                           |
| <device modules>.device_type,      | patch 1: modules that   | 0.2.2 | a device type from the    |
| <device modules>.device_module     | copied the import-time  |       | config                    |
|                                    | device see cpu          |       |                           |
| components.metrics.                | patch 2: memory metrics | 0.2.2 | a CPU memory monitor      |
| DeviceMemoryMonitor,               | from resident memory    |       |                           |
| build_device_memory_monitor,       |                         |       |                           |
| DeviceMemStats                     |                         |       |                           |
| distributed.utils.set_pg_timeouts  | patch 3: barrier        | 0.2.2 | device_ids for NCCL only  |
|                                    | without CUDA device_ids |       |                           |
|                                    | (gloo)                  |       |                           |
| tools.utils.get_peak_flops         | patch 4: MFU against    | 0.2.2 | a peak-FLOPs setting      |
|                                    | the measured CPU peak   |       |                           |
| distributed.utils.clip_grad_norm_  | patch 5: BitPipe's norm | 0.2.2 | a clip function in the    |
|                                    | counts each chunk once  |       | train spec                |
| models.llama3.infra.parallelize.   | patch 6: the schedule's | 0.2.2 | a per-model switch for    |
| apply_cp_to_attention_module       | ring attention, not     |       | how CP reaches attention  |
|                                    | torch's CP              |       |                           |
| models.llama3.infra.parallelize.   | patch 8: selective AC   | 0.2.2 | a save-list hook (0.3:    |
| _op_sac_save_list                  | saves the chunk-aware   |       | SelectiveAC.get_save_ops) |
|                                    | attention too           |       |                           |
| components.metrics.datetime        | patch 7: one            | 0.2.2 | a run id in the metrics   |
|                                    | TensorBoard folder per  |       | config                    |
|                                    | run                     |       |                           |
| train.ensure_pp_loss_visible       | patch 7: no 'PP loss    | 0.2.2 | a trainer giving every    |
|                                    | not visible' warning    |       | rank the PP loss          |
| protocols.train_spec.              | registration is         | 0.2.2 | a public lookup of        |
| _extra_train_specs                 | idempotent              |       | registered specs          |
| hf_datasets.text_datasets.DATASETS | offline pycode datasets | 0.2.2 | a dataset registration    |
|                                    | (entries added)         |       | function                  |
| distributed.pipeline_parallel.     | stages cut as           | 0.2.2 | -                         |
| generate_llm_fqn_per_model_part,   | torchtitan cuts (public |       |                           |
| pipeline_module_split              | in 0.2.2)               |       |                           |

torch's ``_get_available_device_type`` (patch 1, for the length of torchtitan's import) is
torch's name: it comes from :func:`seq1f1b._runtime.device_type_probe`.
"""

from __future__ import annotations

from ..patches import Target

#: modules of 0.2.2 that bind ``tools.utils.device_type`` / ``device_module`` at import
DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.tools.profiling",
    "torchtitan.train",
)
#: what must be imported while torch reports "cpu" (they read the device at import)
DEVICE_READERS = (
    "torchtitan.distributed.dual_pipe_v",
    "torchtitan.tools.utils",
    "torchtitan.train",
)

_METRICS = "torchtitan.components.metrics"
_DIST_UTILS = "torchtitan.distributed.utils"
_PIPELINE = "torchtitan.distributed.pipeline_parallel"

MEMORY_MONITOR = Target(_METRICS, "DeviceMemoryMonitor")
BUILD_MEMORY_MONITOR = Target(_METRICS, "build_device_memory_monitor")
MEMORY_STATS = Target(_METRICS, "DeviceMemStats")
SET_PG_TIMEOUTS = Target(_DIST_UTILS, "set_pg_timeouts")
PEAK_FLOPS = Target("torchtitan.tools.utils", "get_peak_flops")
CLIP_GRAD_NORM = Target(_DIST_UTILS, "clip_grad_norm_")
_PARALLELIZE = "torchtitan.models.llama3.infra.parallelize"
APPLY_CP = Target(_PARALLELIZE, "apply_cp_to_attention_module")
SAC_SAVE_LIST = Target(_PARALLELIZE, "_op_sac_save_list")
METRICS_DATETIME = Target(_METRICS, "datetime")
PP_LOSS_WARNING = Target("torchtitan.train", "ensure_pp_loss_visible")
EXTRA_TRAIN_SPECS = Target("torchtitan.protocols.train_spec", "_extra_train_specs")
DATASETS = Target("torchtitan.hf_datasets.text_datasets", "DATASETS")
DATASET_CONFIG = Target("torchtitan.hf_datasets", "DatasetConfig")
FQNS_PER_PART = Target(_PIPELINE, "generate_llm_fqn_per_model_part")
MODULE_SPLIT = Target(_PIPELINE, "pipeline_module_split")
