#!/usr/bin/env bash
# The GPU check rehearsed on CPU against the lent GPU machine's own environment, so that it
# cannot rot between lent GPUs (CI runs it): a venv of that machine's versions (Python 3.12,
# torch 2.11.0, triton 3.6.0, transformers 5.17.0, einops, numpy, pytest, pytest-timeout;
# PyPI serves torch 2.11 as its CUDA build only, which runs on CPU), the wheels folder
# prepared as for the machine, then scripts/gpu_check.sh --cpu with no network: pip offline,
# its config and local links dropped, every proxy pointed at a closed port, so a step that
# tries to download fails here as it would there.
#
#   bash scripts/test_gpu_rehearsal.sh      (venv .venv-gpu211, made once: about 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SEQ1F1B_GPU_VENV:-.venv-gpu211}"
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 einops==0.8.2 numpy pytest pytest-timeout)
WANT="${PINS[*]}"
STAMP="$VENV/.seq1f1b-gpu-rehearsal"
start=$SECONDS
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  PY312=""
  for py in /root/.pyenv/versions/3.12.1/bin/python3 python3.12; do
    if command -v "$py" >/dev/null; then PY312="$py"; break; fi
  done
  if [ -z "$PY312" ]; then
    PY312=python3
    echo "gpu rehearsal: no Python 3.12 here; $($PY312 --version) instead (the machine has 3.12)"
  fi
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  # the machine-wide pip cap must not block torch 2.11; nothing cached outside the clone
  PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install --quiet --no-cache-dir "${PINS[@]}"
  echo "$WANT" >"$STAMP"
fi
echo "gpu rehearsal: $VENV ready in $((SECONDS - start)) s ($("$VENV/bin/python" --version))"
bash scripts/prepare_gpu_wheels.sh .whl
closed=http://127.0.0.1:9
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
  http_proxy=$closed https_proxy=$closed HTTP_PROXY=$closed HTTPS_PROXY=$closed no_proxy= \
  OMP_NUM_THREADS=1 PYTHON="$VENV/bin/python" bash scripts/gpu_check.sh --cpu
echo "gpu rehearsal: done in $((SECONDS - start)) s"
