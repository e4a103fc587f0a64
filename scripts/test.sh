#!/usr/bin/env bash
# The README's test command, on CPU/gloo:
#   1. .venv (torch 2.15.0, the current release, with torchtitan 0.3.0: the default environment
#      that ./run_train.sh uses): ruff, then the whole suite: the library, compiled blocks, the
#      0.3 TOML mapping and native entry, its end-to-end grid (FSDP, TP, CP), the main job and
#      the two-node launch;
#   2. .venv-titan022 (torch 2.13.0 + torchtitan 0.2.2): torchtitan's tests only, the grid
#      but its titan_current_only runs (variants whose 0.2.2 glue another run covers).
# The oldest supported torch (2.13.0) runs the library suite in scripts/test_oldest.sh (CI runs
# it too). Extra arguments go to both pytest runs. TIER=default or TIER=titan022 runs one;
# CI's two lanes split the default tier in two: TIER=default-a (all but the compiled-blocks
# file) and TIER=default-b (tests/test_compile.py), which together are TIER=default.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
TIER="${TIER:-all}"
COMPILED=tests/test_compile.py
PART=()  # the default tier's part: all of it (the paths in pyproject's testpaths)
case "$TIER" in default-a) PART=(--ignore "$COMPILED") ;; default-b) PART=("$COMPILED") ;; esac
if [ "$TIER" = all ] || [ "${TIER%-[ab]}" = default ]; then
  TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv "${TORCH_VERSION:-2.15.0}"
  if [ "$TIER" != default-b ]; then
    .venv/bin/python -m ruff check seq1f1b torchtitan_integration tests examples benchmarks
  fi
  .venv/bin/python -m pytest -q --durations=40 -m "not grid_script" ${PART[@]+"${PART[@]}"} "$@"
fi
if [ "$TIER" = all ] || [ "$TIER" = titan022 ]; then
  TORCHTITAN_VERSION=0.2.2 bash scripts/setup_env.sh .venv-titan022 "${TORCH_VERSION:-2.13.0}" \
    titan,test,bench
  .venv-titan022/bin/python -m pytest -q -m "not titan_current_only and not grid_script" \
    tests/test_titan.py tests/test_titan_config.py \
    tests/test_main_job.py "$@"
fi
