#!/usr/bin/env bash
# torchtitan-compatible launcher: Seq1F1B training of the debug Llama3 on whatever is here —
# GPUs with NCCL, or CPU processes with gloo. Runs from any directory: CONFIG_FILE and the
# TOML's relative paths (outputs, assets) are relative to where you run it, as with torchtitan.
# The first launch sets up .venv beside this script (once; see scripts/setup_env.sh), later
# launches start training directly (no pip, works offline).
#
#   CONFIG_FILE=train_configs/<x>.toml NGPU=<processes> LOG_RANK=<ranks> ./run_train.sh [--section.key value ...]
#
# Same variables as torchtitan's run_train.sh: CONFIG_FILE, NGPU, LOG_RANK, TRAIN_FILE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$ROOT/scripts/setup_env.sh" .venv
PY="$ROOT/.venv/bin/python"
CONFIG_FILE="${CONFIG_FILE:-$ROOT/train_configs/llama3_debug_seq1f1b.toml}"
TRAIN_FILE="${TRAIN_FILE:-torchtitan_integration.train}"
if [ ! -f "$CONFIG_FILE" ]; then
  echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE not found (relative to $(pwd))" >&2
  exit 2
fi
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NGPU="${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
else
  NGPU="${NGPU:-2}"                                  # CPU: 2 processes with gloo
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # one core per rank, no oversubscription
fi
export LOG_RANK="${LOG_RANK:-0}"                        # as torchtitan: rank 0 logs (every PP rank has the loss)
"$PY" -m torchtitan_integration.assets >/dev/null    # tokenizer + corpus in ./assets (once)
CMD=("$PY" -m torch.distributed.run --nproc-per-node="$NGPU" --rdzv-backend c10d
  --rdzv-endpoint="localhost:0" --local-ranks-filter "$LOG_RANK" --role rank --tee 3
  -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@")
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"
