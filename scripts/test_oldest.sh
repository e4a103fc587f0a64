#!/usr/bin/env bash
# The library suite on the oldest supported torch (2.13.0, the local CPU wheel) in .venv-oldest,
# with torchtitan 0.3.0 installed: every library test, and torchtitan 0.3's config mapping,
# but not the torchtitan end-to-end runs (their FSDP / TP need torch 2.15: scripts/test.sh runs
# them), nor the main job and the launcher (scripts/test.sh), nor the larger 4-rank grids and
# the benchmark tooling's smoke tests (default_release_only; their 2-rank versions run here).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_OLDEST="${TORCH_OLDEST:-2.13.0}"
TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv-oldest "$TORCH_OLDEST" titan,test,bench
export OMP_NUM_THREADS=1
exec .venv-oldest/bin/python -m pytest -q -m "not default_release_only and not titan_grid" \
  --deselect tests/test_main_job.py --deselect tests/test_launcher.py "$@"
