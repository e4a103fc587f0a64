#!/usr/bin/env bash
# Set up a venv with a pinned torch (and, with the titan extra, a pinned torchtitan) and this
# package, once. Later calls return at once (a stamp records what was installed); pip runs again
# only when pyproject.toml, the constraints or this script change, or a different torch or
# torchtitan is asked for. Works offline once the venv is complete.
#
#   scripts/setup_env.sh [VENV] [TORCH_VERSION] [EXTRAS]     (defaults: .venv, the venv's own
#                                   torch, else 2.15.0 (2.13.0 with torchtitan 0.2.2), titan,test,bench)
#   TORCHTITAN_VERSION=0.2.2 scripts/setup_env.sh ...          (only with extra titan; default: the
#                                                            venv's own, 0.3.0 for a new venv)
#
# VENV is relative to the repository root unless absolute. torchtitan is pinned the way torch is:
# through the generated constraint file, so pip installs exactly that version (up or down) even
# where pyproject only asks for a minimum, and no other dependency can replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
EXTRAS="${3:-titan,test,bench}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.seq1f1b-setup"
TITAN="${TORCHTITAN_VERSION:-}"
TORCH="${2:-${TORCH_VERSION:-}}"
if [ -f "$STAMP" ]; then
  # a venv keeps the torch and torchtitan it was made with (SEQ1F1B_VENV=.venv-titan022
  # ./run_train.sh), unless another version is asked for
  if [ -z "$TITAN" ]; then
    TITAN="$(grep -o 'torchtitan==[^ ]*' "$STAMP" | cut -d= -f3 || true)"
  fi
  if [ -z "$TORCH" ]; then
    TORCH="$(grep -o 'torch==[^ ]*' "$STAMP" | cut -d= -f3 || true)"
  fi
fi
TITAN="${TITAN:-0.3.0}"   # the current release; TORCHTITAN_VERSION=0.2.2 for the previous one
# the current torch with the current torchtitan (0.3's FSDP / TP need torch 2.15); 0.2.2 was
# made for 2.13 (and runs on it from the local CPU wheel)
if [ -z "$TORCH" ]; then
  if [ "$TITAN" = 0.2.2 ]; then TORCH=2.13.0; else TORCH=2.15.0; fi
fi
WANT="$(cat pyproject.toml scripts/constraints.txt scripts/setup_env.sh | sha256sum | cut -c1-16)"
WANT="$WANT torch==$TORCH extras=$EXTRAS"
WITH_TITAN=0
if [[ ",$EXTRAS," == *",titan,"* ]]; then
  WITH_TITAN=1
  WANT="$WANT torchtitan==$TITAN"   # another torchtitan version is another venv content
fi
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
WHAT="torch $TORCH"
if [ "$WITH_TITAN" = 1 ]; then
  WHAT="$WHAT, torchtitan $TITAN"
fi
echo "seq1f1b: setting up $VENV ($WHAT, extras [$EXTRAS]); first time only:" \
  "about 1 minute with the local CPU wheel, 3-5 minutes for a CUDA build from the registry" >&2
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
# The machine-wide pip cap (torch<=2.14.1 here) must not block a newer torch in its own venv;
# our own constraint pins the torch (and torchtitan) this venv is for, so no dependency can
# replace them. A constraint only narrows: without the titan extra it installs nothing.
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
sed -e "s/^torch==.*/torch==$TORCH/" -e "s/^torchtitan==.*/torchtitan==$TITAN/" \
  scripts/constraints.txt > "$CONSTRAINT"
export PIP_CONSTRAINT=/dev/null
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH' else 1)" \
    2>/dev/null; then
  "$VPY" -m pip install --quiet "torch==$TORCH"
fi
# compat editable mode: the checkout goes on sys.path (a .pth), so a folder named seq1f1b in
# the working directory cannot shadow the package (setuptools' default finder loses to it)
"$VPY" -m pip install --quiet -c "$CONSTRAINT" -e ".[$EXTRAS]" \
  --config-settings editable_mode=compat
echo "$WANT" > "$STAMP"
READY="torch $("$VPY" -c 'import torch; print(torch.__version__)')"
if [ "$WITH_TITAN" = 1 ]; then
  READY="$READY, torchtitan $("$VPY" -c 'import importlib.metadata as m; print(m.version("torchtitan"))')"
fi
echo "seq1f1b: $VENV ready ($READY)" >&2
