#!/usr/bin/env bash
# Multi-node Seq1F1B training on Slurm: one run_train.sh (one torchrun) per node, all meeting at
# a c10d rendezvous on the job's first node. Submit from the directory the TOML's relative paths
# (outputs, assets) are relative to, usually this repository:
#
#   CONFIG_FILE=my.toml sbatch --nodes=4 --gpus-per-node=8 examples/slurm_run_train.sh [--section.key value ...]
#
# Slurm runs a copy of this script, so it finds run_train.sh in SEQ1F1B_ROOT, else in the
# submission directory. Every other variable of run_train.sh passes through (sbatch exports the
# submitting shell's environment): CONFIG_FILE or MODULE/CONFIG, LOG_RANK, SEQ1F1B_VENV, NGPU
# (default: the GPUs Slurm gives each node). The venv and the offline assets are set up once
# here, before the nodes start, so that nodes sharing a file system never install concurrently.
#SBATCH --job-name=seq1f1b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --output=%x-%j.out
set -euo pipefail
ROOT="${SEQ1F1B_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
if [ ! -f "$ROOT/run_train.sh" ]; then
  echo "slurm_run_train.sh: no run_train.sh in $ROOT: submit from the seq1f1b repository or" \
    "set SEQ1F1B_ROOT=/path/to/seq1f1b" >&2
  exit 2
fi
: "${SLURM_JOB_ID:?run this with sbatch (or inside an salloc allocation)}"
# awk reads all of it: with pipefail, "| head -n 1" can end in SIGPIPE (exit 141) for scontrol
FIRST_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')"
export NNODES="$SLURM_JOB_NUM_NODES"
export RDZV_ENDPOINT="${RDZV_ENDPOINT:-$FIRST_HOST:29500}"
export RDZV_ID="$SLURM_JOB_ID"
GPUS="${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
export NGPU="${NGPU:-${GPUS##*:}}"                   # "h100:8" -> 8
VENV="${SEQ1F1B_VENV:-.venv}"
case "$VENV" in
  /*) ;;
  *) VENV="$ROOT/$VENV" ;;
esac
bash "$ROOT/scripts/setup_env.sh" "$VENV"             # once, on this (the first) node
"$VENV/bin/python" -m torchtitan_integration.assets >/dev/null
echo "slurm_run_train.sh: $NNODES nodes x $NGPU GPUs, rendezvous $RDZV_ENDPOINT (id $RDZV_ID)" >&2
# One task per node; each derives its NODE_RANK from Slurm's node index. Single quotes: the
# variables expand on each node, not here.
srun --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'NODE_RANK="$SLURM_NODEID" exec bash "$0" "$@"' "$ROOT/run_train.sh" "$@"
