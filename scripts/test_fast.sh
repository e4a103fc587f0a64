#!/usr/bin/env bash
# The fast tier, for iterating (the full suite stays the test command and CI's): ruff, then the
# tests marked fast on themselves (tests/tiers.py): partition, attention kernels, masks, a
# sampled order grid, lowering equality, and schedule equivalence with several stages on one
# rank. Under 3 minutes on 2 cores, in the default .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv
export OMP_NUM_THREADS=1
.venv/bin/python -m ruff check seq1f1b torchtitan_integration tests examples benchmarks
exec .venv/bin/python -m pytest -q -m fast "$@"
