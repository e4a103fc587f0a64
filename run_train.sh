#!/usr/bin/env bash
# torchtitan-compatible launcher: Seq1F1B training of the debug Llama3 on whatever is here —
# GPUs with NCCL, or CPU processes with gloo. Runs from any directory: CONFIG_FILE and the
# TOML's relative paths (outputs, assets) are relative to where you run it, as with torchtitan.
# The first launch sets up the venv (SEQ1F1B_VENV, default .venv beside this script; once, see
# scripts/setup_env.sh), later launches start training directly (no pip, works offline).
#
#   CONFIG_FILE=train_configs/<x>.toml NGPU=<processes> LOG_RANK=<ranks> ./run_train.sh [--section.key value ...]
#   MODULE=<module> CONFIG=<config function> ./run_train.sh [...]       (torchtitan 0.3's variables)
#
# Same variables as torchtitan's run_train.sh: CONFIG_FILE (or MODULE and CONFIG), NGPU,
# LOG_RANK, TRAIN_FILE. Multi-node: run it on every node with the same rendezvous (torchrun's
# c10d): NNODES=<nodes> NODE_RANK=<this node, optional> RDZV_ENDPOINT=<host:port reachable from
# every node> RDZV_ID=<job id, optional> RDZV_BACKEND=<default c10d>, NGPU = processes per node.
# On Slurm, examples/slurm_run_train.sh sets these from the job and runs this on each node.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${SEQ1F1B_VENV:-.venv}"
case "$VENV" in
  /*) ;;
  *) VENV="$ROOT/$VENV" ;;                             # relative: beside this script
esac
TRAIN_FILE="${TRAIN_FILE:-torchtitan_integration.train}"
if [ -n "${MODULE:-}" ] && [ -z "${CONFIG_FILE:-}" ]; then
  # torchtitan 0.3: a config function in a module; the train entry reads --module/--config
  if [ -z "${CONFIG:-}" ]; then
    echo "run_train.sh: MODULE=$MODULE needs CONFIG=<a config function of its config_registry>," \
      "e.g. MODULE=torchtitan_integration CONFIG=seq1f1b_debugmodel (torchtitan 0.3)" >&2
    exit 2
  fi
  JOB_ARGS=(--module "$MODULE" --config "$CONFIG")
else
  CONFIG_FILE="${CONFIG_FILE:-$ROOT/train_configs/llama3_debug_seq1f1b.toml}"
  if [ ! -f "$CONFIG_FILE" ]; then
    echo "run_train.sh: CONFIG_FILE=$CONFIG_FILE not found (relative to $(pwd))" >&2
    exit 2
  fi
  JOB_ARGS=(--job.config_file "$CONFIG_FILE")
fi
NNODES="${NNODES:-1}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-localhost:0}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
if ! [[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]]; then
  echo "run_train.sh: NNODES=$NNODES is not a node count (or MIN:MAX)" >&2
  exit 2
fi
if [ "$NNODES" != 1 ] && [ "$RDZV_ENDPOINT" = "localhost:0" ]; then
  echo "run_train.sh: NNODES=$NNODES needs a rendezvous every node can reach: set" \
    "RDZV_ENDPOINT=host:port reachable from every node (e.g. node 0's hostname:29500), the" \
    "same on all nodes (examples/slurm_run_train.sh does this on Slurm)" >&2
  exit 2
fi
# the settings are checked above, before any set-up: a wrong one fails at once, without pip
bash "$ROOT/scripts/setup_env.sh" "$VENV"
PY="$VENV/bin/python"
for arg in "$@"; do                                  # --help: one process prints it, no torchrun
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$PY" -m "$TRAIN_FILE" "${JOB_ARGS[@]}" --help
  fi
done
for arg in "$@"; do          # --seq1f1b.dry_run: one process simulates every rank, no torchrun
  if [ "$arg" = "--seq1f1b.dry_run" ] || [[ "$arg" == --seq1f1b.dry_run=* ]]; then
    "$PY" -m torchtitan_integration.assets >/dev/null
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
    exec "$PY" -m "$TRAIN_FILE" "${JOB_ARGS[@]}" "$@"
  fi
done
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  NGPU="${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
  export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
else
  NGPU="${NGPU:-2}"                                  # CPU: 2 processes with gloo
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # one core per rank, no oversubscription
fi
export LOG_RANK="${LOG_RANK:-0}"                        # as torchtitan: rank 0 logs (every PP rank has the loss)
"$PY" -m torchtitan_integration.assets >/dev/null    # tokenizer + corpus in ./assets (once)
NODE_ARGS=(--nnodes="$NNODES")
if [ -n "${NODE_RANK:-}" ]; then
  NODE_ARGS+=(--node-rank="$NODE_RANK")
fi
if [ -n "${RDZV_ID:-}" ]; then
  NODE_ARGS+=(--rdzv-id="$RDZV_ID")
fi
CMD=("$PY" -m torch.distributed.run --nproc-per-node="$NGPU" "${NODE_ARGS[@]}"
  --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint="$RDZV_ENDPOINT"
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3
  -m "$TRAIN_FILE" "${JOB_ARGS[@]}" "$@")
echo "+ ${CMD[*]}" >&2
exec "${CMD[@]}"
