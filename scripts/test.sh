#!/usr/bin/env bash
# The README's test command: set up .venv (pinned CPU torch) and run the whole suite on CPU/gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv
export OMP_NUM_THREADS=1
.venv/bin/python -m ruff check seq1f1b torchtitan_integration tests examples benchmarks
exec .venv/bin/python -m pytest -q "$@"
