#!/usr/bin/env bash
# The README's test command, on CPU/gloo, in two venvs of the pinned fast torch (2.13.0):
#   1. .venv (torchtitan 0.3.0, the default): ruff, then the whole suite except the torchtitan
#      equivalence grid (marker titan_grid: it needs torch 2.15 on torchtitan 0.3, so
#      scripts/test_latest.sh runs it there): the library, the 0.3 TOML mapping, its native
#      --module/--config entry, the main job and the two-node launch;
#   2. .venv-titan022 (torchtitan 0.2.2): torchtitan's tests only, the grid included.
# Extra arguments go to both pytest runs. TIER=default or TIER=titan022 runs one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
TIER="${TIER:-all}"
if [ "$TIER" = all ] || [ "$TIER" = default ]; then
  TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv
  .venv/bin/python -m ruff check seq1f1b torchtitan_integration tests examples benchmarks
  .venv/bin/python -m pytest -q -m "not titan_grid" "$@"
fi
if [ "$TIER" = all ] || [ "$TIER" = titan022 ]; then
  TORCHTITAN_VERSION=0.2.2 bash scripts/setup_env.sh .venv-titan022 "${TORCH_VERSION:-2.13.0}" \
    titan,test,bench
  .venv-titan022/bin/python -m pytest -q tests/test_titan.py tests/test_titan_config.py \
    tests/test_main_job.py "$@"
fi
