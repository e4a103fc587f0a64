#!/usr/bin/env bash
# The combination grid's long part (tests/combination_grid.py): its 31 rows, each a torchtitan
# 0.3 PP=2 run against PP=1 in the same configuration (about an hour on 2 cores; CI runs the
# grid's covering and start-up checks, and the hand-written runs of tests/test_titan*.py but
# those marked grid_script, which run here after the rows).
# Extra arguments go to pytest (e.g. -k qwen3_moe).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv 2.15.0
export OMP_NUM_THREADS=1 SEQ1F1B_GRID=1
# the rows, then the hand-written runs that the rows cover too (marked grid_script: CI leaves
# them out)
.venv/bin/python -m pytest -q -rA tests/test_combination_grid.py "$@"
rc=0
.venv/bin/python -m pytest -q -rA -m grid_script tests "$@" || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 5 ]  # 5: a -k that selects none of them
