#!/usr/bin/env bash
# upstream/check.sh: the patch series against torch 2.15.0's torch/distributed/pipelining,
# checked end to end on a scratch venv (see upstream/README.md).
#
#   1. .venv (torch 2.15.0 + torchtitan 0.3.0, scripts/setup_env.sh) is the base; the
#      series applies to ITS files, which must be 2.15.0's (series/BASE.sha256);
#   2. upstream/.tree gets a copy of those files and upstream/.venv-check a torch whose
#      pipelining is that copy (tools/mkvenv.sh: links, nothing else copied);
#   3. per patch, in order: its new tests alone must FAIL on the tree before it, the patch
#      applies cleanly, then its tests PASS (QUICK=1: not one by one); at the end every
#      patch's tests pass together;
#   4. on the fully patched torch: this package's seam reports every hook found (so the
#      matching workarounds are off), then its tests run there (QUICK=1: the fast tier, the
#      lowering-equality grid, the core equivalence tests and PP 2 x TP 2; default: the whole suite but the
#      torchtitan grid and the launcher), then the lowering-equality grid.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
UP="$ROOT/upstream"
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1

TORCHTITAN_VERSION=0.3.0 bash scripts/setup_env.sh .venv 2.15.0 titan,test,bench >/dev/null
SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE="$SITE/torch/distributed/pipelining"
(cd "$BASE" && sha256sum -c --quiet "$UP/series/BASE.sha256") || {
  echo "check.sh: $BASE is not torch 2.15.0's pipelining (series/BASE.sha256)" >&2
  exit 1
}

TREE="$UP/.tree"
rm -rf "$TREE"
mkdir -p "$TREE/torch/distributed" "$TREE/test/distributed/pipelining"
cp -r "$BASE" "$TREE/torch/distributed/pipelining"
rm -rf "$TREE/torch/distributed/pipelining/__pycache__"
git -C "$TREE" init -q  # its own repository: git apply then takes paths from the tree's root
bash "$UP/tools/mkvenv.sh" "$UP/.venv-check" "$TREE/torch/distributed/pipelining"
PY="$UP/.venv-check/bin/python"

new_tests() {  # the test files a patch adds
  grep -E '^\+\+\+ b/test/.*\.py$' "$1" | sed 's#^+++ b/##' | grep -v '/bench_' || true
}

run_tests() {  # pytest over test files relative to the tree
  (cd "$TREE" && "$PY" -m pytest -q -p no:cacheprovider "$@")
}

done_tests=()
for patch in "$UP"/series/[0-9]*.patch; do
  name="$(basename "$patch")"
  mapfile -t tests < <(new_tests "$patch")
  [ "${#tests[@]}" -gt 0 ] || { echo "check.sh: $name adds no test" >&2; exit 1; }
  echo "== $name: its tests before it (must fail)"
  (cd "$TREE" && git apply --include='test/*' "$patch")
  if run_tests "${tests[@]}" >"$UP/.tree/$name.before.log" 2>&1; then
    echo "check.sh: $name's tests pass WITHOUT it (see .tree/$name.before.log)" >&2
    exit 1
  fi
  tail -n 1 "$UP/.tree/$name.before.log"
  (cd "$TREE" && git apply --exclude='test/*' "$patch")
  if [ "${QUICK:-0}" = 1 ]; then  # each patch's tests pass below, on the whole series
    echo "== $name: applied"
  else
    echo "== $name: applied, its tests (must pass)"
    run_tests "${tests[@]}"
  fi
  done_tests+=("${tests[@]}")
done
echo "== every patch's tests on the whole series"
run_tests "${done_tests[@]}"

echo "== the seam on the patched torch: every hook found, its workaround off"
"$PY" - <<'PY'
import seq1f1b._runtime as rt

missing = [name for name, found in rt.TORCH_HOOKS.items() if not found]
assert not missing, f"hooks not found on the patched torch: {missing}"
print("hooks in use:", ", ".join(rt.TORCH_HOOKS))
PY

echo "== this package's suite on the patched torch"
if [ "${QUICK:-0}" = 1 ]; then
  "$PY" -m pytest -q -p no:cacheprovider -m fast
  "$PY" -m pytest -q -p no:cacheprovider tests/test_equivalence.py \
    -k "different_lengths or zero_bubble_split_backward_matches_reference[2-1] or gradients_match_reference[2-1]"
  # TP's DTensor activations through patch 5's receive metadata (sharded, strided layouts)
  "$PY" -m pytest -q -p no:cacheprovider tests/test_titan.py -k test_pp2_x_tp2
else
  "$PY" -m pytest -q -p no:cacheprovider -m "not titan_grid and not default_release_only" \
    --deselect tests/test_main_job.py --deselect tests/test_launcher.py
fi

echo "== the lowering-equality grid (ours == the patched torch's, every rank)"
"$PY" -m pytest -q -p no:cacheprovider tests/test_scale.py tests/test_order_closed_form.py
echo "upstream/check.sh: OK"
