#!/usr/bin/env bash
# The suite on the newest torch release (2.15.0, a CUDA build that runs on CPU) in .venv-latest.
# torchtitan's end-to-end tests run on the pinned torch in scripts/test.sh; here they are not
# installed and skip with that reason (they also pass on 2.15: see README, "Supported torch").
# Larger variants marked default_release_only (4-rank mask / zero-bubble grids) are deselected
# for CI's time budget; their 2-rank versions run here.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_LATEST="${TORCH_LATEST:-2.15.0}"
bash scripts/setup_env.sh .venv-latest "$TORCH_LATEST" test,bench
export OMP_NUM_THREADS=1
exec .venv-latest/bin/python -m pytest -q -m "not default_release_only" "$@"
