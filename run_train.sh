#!/usr/bin/env bash
# Main job: a short Seq1F1B training run on whatever hardware is here (CPU processes with gloo,
# or GPUs with NCCL). Sets up .venv on first use.
#   NGPU=<processes> ./run_train.sh [extra args for the training script]
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
if .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NGPU="${NGPU:-$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')}"
else
  NGPU="${NGPU:-2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
TRAIN_FILE="${TRAIN_FILE:-examples/direct_pipelining.py}"
exec .venv/bin/python -m torch.distributed.run --nproc-per-node "$NGPU" --local-ranks-filter "${LOG_RANK:-0,1}" \
  "$TRAIN_FILE" "$@"
