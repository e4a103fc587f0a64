#!/usr/bin/env bash
# Everything GPU-only, in one call on one GPU (well under 10 minutes): the gpu-marked tests
# (CUDA and flash-attn block kernels against the float32 math reference in bf16, compiled
# blocks, several stages on one rank under Seq1F1B on CUDA, selective checkpointing keeping
# the compiled attention), then the segment-overhead
# benchmark's CUDA mode. Prints a summary. Without a GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv >/dev/null
PY=.venv/bin/python
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here (torch $("$PY" -c 'import torch; print(torch.__version__)')):" \
    "nothing to run; the gpu-marked tests skip on CPU"
  exit 0
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
status=0
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/ || status=$?
"$PY" -m benchmarks.step_time.segment_overhead --device cuda || status=$?
echo "gpu_check: done (exit $status)"
exit "$status"
