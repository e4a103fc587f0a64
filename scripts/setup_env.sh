#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and this package (idempotent; used by tests and training).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
# torch is pinned: a bare 'torch' would pull a multi-GB CUDA build. 2.13.0 is the CPU wheel here.
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  "$VPY" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
# torchtitan 0.2.2 and its deps (triton is needed to import it, even on CPU); the constraint keeps
# every dependency on the pinned torch.
"$VPY" -m pip install --quiet -c scripts/constraints.txt -e ".[titan,test]"
