#!/usr/bin/env bash
# The planner with this repository's venv, from any directory: sets the venv up once (as
# run_train.sh does, SEQ1F1B_VENV or .venv beside the repository) and runs
# `python -m torchtitan_integration.planner` with the venv's python, arguments passed through.
# A plain `python -m ...` only works where seq1f1b is importable; this always is.
#
#   scripts/plan.sh --model llama3-8b --seq-len 32768 --gpus 8 --gpu-memory-gb 80 --output my.toml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SEQ1F1B_VENV:-.venv}"
case "$VENV" in
  /*) ;;
  *) VENV="$ROOT/$VENV" ;;
esac
bash "$ROOT/scripts/setup_env.sh" "$VENV"
exec "$VENV/bin/python" -m torchtitan_integration.planner "$@"
