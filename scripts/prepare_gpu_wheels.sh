#!/usr/bin/env bash
# Fill the wheels folder that scripts/gpu_check.sh installs from on the lent GPU machine (no
# network there): run it on a machine that reaches the registry. Pure-Python wheels only, for
# that machine's Python 3.12 on x86-64, none of their dependencies (the machine's image has
# them: torch, triton, einops, transformers); the folder stays under 64 MiB with the tree.
#
#   bash scripts/prepare_gpu_wheels.sh [DIR]      (default .whl, git-ignored)
#
# Carried: fla-core (FLA's Gated DeltaNet kernels, which the check compares with the torch
# kernel). Not carried, and why (gpu_check.sh says so again):
# - flash-attn: PyPI has no binary wheel (a source build takes hours and needs that machine's
#   CUDA toolkit); the check runs torch's CUDA flash kernels instead;
# - torchtitan: its runs go through seq1f1b's schedules, which need torch >= 2.13 (the lent
#   machine has 2.11), and its dependencies (datasets, torchdata, tyro) are not in its image.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY="${PYTHON:-python3}"
WHEELS=("fla-core==0.6.0")
mkdir -p "$DIR"
start=$SECONDS
# the machine-wide pip cap does not apply to a download for another machine
PIP_CONSTRAINT=/dev/null "$PY" -m pip download --quiet --no-cache-dir --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" "${WHEELS[@]}"
# one version of each package: two would stop the install there
names="$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | sort)"
if [ -n "$(uniq -d <<<"$names")" ]; then
  echo "prepare_gpu_wheels: two versions of $(uniq -d <<<"$names") in $DIR: remove one" >&2
  exit 1
fi
size_kib="$(du -sk "$DIR" | cut -f1)"
if [ "$size_kib" -gt $((48 * 1024)) ]; then
  echo "prepare_gpu_wheels: $DIR holds ${size_kib} KiB: over 48 MiB leaves too little of the" \
    "64 MiB a call carries for the tree" >&2
  exit 1
fi
echo "prepare_gpu_wheels: $DIR ready in $((SECONDS - start)) s (${size_kib} KiB):" \
  "$(ls "$DIR" | tr '\n' ' ')"
