#!/usr/bin/env bash
# The suite on the newest torch release (2.15.0, a CUDA build that runs on CPU) in .venv-latest,
# with torchtitan 0.3.0: the library again, and torchtitan 0.3's equivalence grid (marker
# titan_grid), whose FSDP / TP / CP runs need torch 2.15. The main job and the two-node launch
# ran in scripts/test.sh; the larger 4-rank mask / zero-bubble grids and the benchmark tooling's
# smoke tests (default_release_only) run there too, the grids' 2-rank versions here: CI's time
# budget.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_LATEST="${TORCH_LATEST:-2.15.0}"
TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv-latest "$TORCH_LATEST" titan,test,bench
export OMP_NUM_THREADS=1
exec .venv-latest/bin/python -m pytest -q -m "not default_release_only" \
  --deselect tests/test_main_job.py --deselect tests/test_launcher.py "$@"
