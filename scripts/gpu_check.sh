#!/usr/bin/env bash
# Everything GPU-only, in one call on the lent GPU machine as it is (no network, its own
# python3 and torch, under 8 minutes on an H200); docs/tests.md has the recipe. It
#   1. installs the wheels folder (.whl, from scripts/prepare_gpu_wheels.sh) into a temporary
#      target, offline, and puts it and this checkout on PYTHONPATH (nothing else installed);
#   2. runs tests/test_gpu.py: every attention path in bf16 against the float32 math reference
#      (gradients included), FLA's gated delta rule against the torch kernel, several stages
#      on one rank under Seq1F1B / ZBVSeq1F1B / Interleaved1F1B (exact, eager and compiled,
#      step times, peak memory), a compiled block's selective checkpointing;
#   3. runs the segment-overhead benchmark at K = 1, 2, 4, 8;
#   4. prints what ran, what was skipped and why, and the numbers.
# Without CUDA it says so and exits 0, unless asked for the CPU rehearsal (--cpu or
# SEQ1F1B_GPU_REHEARSAL=1: the device-generic parts on CPU at small sizes, the CUDA-only ones
# reported as skipped; scripts/test_gpu_rehearsal.sh runs it on the lent machine's versions).
# PYTHON picks the interpreter (default python3); under $OUT (the device tool's) the log and
# the benchmark's tables are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHL="${SEQ1F1B_WHEELS:-.whl}"
LOGDIR="${OUT:-$(mktemp -d)}"
mkdir -p "$LOGDIR"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1
start=$SECONDS
say() { echo "gpu_check: $*"; }
ran=()
skipped=()

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  mode=cuda
elif [ "${1:-}" = --cpu ] || [ "${SEQ1F1B_GPU_REHEARSAL:-}" = 1 ]; then
  mode=cpu
else
  say "no CUDA device here (torch $("$PY" -c 'import torch; print(torch.__version__)')):" \
    "nothing to run (--cpu rehearses it on CPU)"
  exit 0
fi
export SEQ1F1B_GPU_REHEARSAL=$([ "$mode" = cpu ] && echo 1 || echo 0)
export SEQ1F1B_GPU_NUMBERS="$LOGDIR/one_rank_steps.txt"
: >"$SEQ1F1B_GPU_NUMBERS"

# 1. the carried wheels, offline, into a target of their own (the image's packages untouched)
SITE="$(mktemp -d)/site"
if compgen -G "$WHL/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHL"/*.whl
  ran+=("wheels: $(cd "$WHL" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')")
else
  skipped+=("wheels: no $WHL/*.whl (bash scripts/prepare_gpu_wheels.sh): FLA's kernels skip")
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
skipped+=("flash-attn: no binary wheel on PyPI (source build only): torch's CUDA flash kernels run")
skipped+=("torchtitan: its runs need seq1f1b's schedules on torch >= 2.13; not carried")

"$PY" - <<'EOF'
import importlib.util, platform, sys
import torch, triton, transformers
import seq1f1b, seq1f1b.attention, seq1f1b.schedules  # noqa: F401  (the package imports)
from seq1f1b._runtime import PIPELINING_RUNTIME
fla = importlib.util.find_spec("fla")
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU rehearsal)"
print(f"gpu_check: {dev}; python {platform.python_version()} ({sys.executable}), torch "
      f"{torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
      f", fla {'present' if fla else 'absent'}; seq1f1b imports; schedules "
      f"{'run' if PIPELINING_RUNTIME else 'refused: they need torch >= 2.13'}")
EOF
ran+=("imports: seq1f1b, its attention and schedules, torch, triton, transformers")

# 2. the gpu tests (-s: their numbers; -rs: every skip with its reason)
status=0
limit=$([ "$mode" = cuda ] && echo 330 || echo 300)
set +e
timeout "$limit" "$PY" -m pytest -q -s -rs -p no:cacheprovider -m gpu --timeout 240 \
  tests/test_gpu.py 2>&1 | tee "$LOGDIR/gpu_tests.log"
rc=${PIPESTATUS[0]}
set -e
tests_line="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$LOGDIR/gpu_tests.log" | tail -1)"
if [ "$rc" = 0 ]; then ran+=("tests/test_gpu.py: $tests_line"); else
  status=1
  ran+=("tests/test_gpu.py: FAILED (exit $rc${tests_line:+: $tests_line})")
fi
while IFS= read -r line; do skipped+=("test: ${line#SKIPPED }"); done \
  < <(grep '^SKIPPED' "$LOGDIR/gpu_tests.log" || true)

# 3. the segment-overhead benchmark (CUDA: bf16, 4k-32k; rehearsal: one short length)
bench=(-m benchmarks.step_time.segment_overhead --device "$mode" --chunks 1 2 4 8 --out "$LOGDIR")
if [ "$mode" = cpu ]; then bench+=(--lengths 512 --repeats 1); fi
set +e
timeout 150 "$PY" "${bench[@]}" 2>&1 | tee "$LOGDIR/segment_overhead.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 0 ]; then ran+=("segment overhead ($mode, K = 1 2 4 8): table above"); else
  status=1
  ran+=("segment overhead: FAILED (exit $rc)")
fi

echo "================ gpu_check summary ($mode, $((SECONDS - start)) s) ================"
for line in "${ran[@]}"; do say "ran     $line"; done
for line in "${skipped[@]}"; do say "skipped $line"; done
if [ -s "$SEQ1F1B_GPU_NUMBERS" ]; then cat "$SEQ1F1B_GPU_NUMBERS"; fi
grep -o 'gpu_check: \(attention\|fla\) .*' "$LOGDIR/gpu_tests.log" || true
say "done in $((SECONDS - start)) s (exit $status)"
exit "$status"
