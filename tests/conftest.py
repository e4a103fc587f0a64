"""pytest: helper modules and benchmarks/ come from ``pythonpath`` in pyproject.toml.

The fast tier (``bash scripts/test_fast.sh``, marker ``fast``) is chosen here, in one place:
whole files that run in seconds, and a sample of the larger grids (the full suite runs them
all). A name in :data:`FAST` is a file (every test in it) or a file's test id prefix.
"""

from __future__ import annotations

import pytest

FAST = (
    "test_partition.py",
    "test_attention.py",
    "test_masks.py",
    "test_unit_kwargs.py",
    "test_titan_checks.py",
    "test_simulate.py",
    "test_registry.py",
    "test_runtime_seam.py",
    "test_errors.py",
    "test_action_context.py",
    "test_options.py",
    # orders: the published example, a sampled grid (pp 2 and 4 of 1..8), CSV round trips
    "test_order.py::test_published_example_p4_m3_k2",
    "test_order.py::test_grid_passes_torch_validators_and_rules[2]",
    "test_order.py::test_grid_passes_torch_validators_and_rules[4]",
    "test_order.py::test_zero_bubble_grid_passes_torch_validators[2]",
    "test_order.py::test_interleaved_when_k_does_not_divide_pp",
    "test_order.py::test_csv_round_trip",
    # ZBV-Seq1F1B orders: a sampled grid, ZB-V itself at K = 1, placement errors
    "test_order_v.py::test_grid_passes_torch_validators_and_comms_simulator[2]",
    "test_order_v.py::test_k1_is_torchs_zbv_order",
    "test_order_v.py::test_wrong_placement_is_refused_with_the_fix",
    # lowering: every rank equals torch's (sampled), FSDP pass, deadlock report
    "test_scale.py::test_every_rank_equals_torch_lowering[3]",
    "test_scale.py::test_torch_schedules_lower_identically",
    "test_scale.py::test_add_unshard_reshard_equals_torch",
    "test_scale.py::test_deadlock_is_reported_like_torch",
    # schedule equivalence with several stages on one rank (K/V, checkpointing, ZB, documents)
    "test_equivalence.py::test_single_rank_pipeline",
    "test_equivalence.py::test_single_rank_zero_bubble_and_documents",
    "test_equivalence.py::test_instance_overrides_of_stage_methods_are_called_and_kept",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        file_id = item.nodeid.split("/")[-1]
        if any(file_id == f or file_id.startswith(f) for f in FAST):
            item.add_marker(pytest.mark.fast)
