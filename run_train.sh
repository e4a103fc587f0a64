#!/usr/bin/env bash
# torchtitan-compatible launcher: Seq1F1B training of the debug Llama3 on whatever is here —
# GPUs with NCCL, or CPU processes with gloo. Sets up .venv (pinned torch, torchtitan 0.2.2)
# and the offline tokenizer/dataset on first use.
#
#   CONFIG_FILE=train_configs/<x>.toml NGPU=<processes> LOG_RANK=<ranks> ./run_train.sh [--section.key value ...]
#
# Same variables as torchtitan's run_train.sh: CONFIG_FILE, NGPU, LOG_RANK, TRAIN_FILE.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
PY=.venv/bin/python
CONFIG_FILE="${CONFIG_FILE:-./train_configs/llama3_debug_seq1f1b.toml}"
TRAIN_FILE="${TRAIN_FILE:-torchtitan_integration.train}"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NGPU="${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
else
  NGPU="${NGPU:-2}"                                  # CPU: 2 processes with gloo
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # one core per rank, no oversubscription
fi
export LOG_RANK="${LOG_RANK:-$((NGPU - 1))}"         # a last-stage rank prints the loss
"$PY" -m torchtitan_integration.assets >/dev/null    # tokenizer + corpus (once)
exec "$PY" -m torch.distributed.run --nproc-per-node="$NGPU" --rdzv-backend c10d \
  --rdzv-endpoint="localhost:0" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
