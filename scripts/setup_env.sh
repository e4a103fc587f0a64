#!/usr/bin/env bash
# Set up a venv with a pinned torch and this package, once. Later calls return at once (a stamp
# records what was installed); pip runs again only when pyproject.toml, the constraints or this
# script change, or a different torch is asked for. Works offline once the venv is complete.
#
#   scripts/setup_env.sh [VENV] [TORCH_VERSION] [EXTRAS]     (defaults: .venv 2.13.0 titan,test,bench)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
TORCH="${2:-${TORCH_VERSION:-2.13.0}}"
EXTRAS="${3:-titan,test,bench}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.seq1f1b-setup"
WANT="$(cat pyproject.toml scripts/constraints.txt scripts/setup_env.sh | sha256sum | cut -c1-16)"
WANT="$WANT torch==$TORCH extras=$EXTRAS"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "seq1f1b: setting up $VENV (torch $TORCH, extras [$EXTRAS]); first time only:" \
  "about 1 minute with the local CPU wheel, 3-5 minutes for a CUDA build from the registry" >&2
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
# The machine-wide pip cap (torch<=2.14.1 here) must not block a newer torch in its own venv;
# our own constraint pins the torch this venv is for, so no dependency can replace it.
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
sed "s/^torch==.*/torch==$TORCH/" scripts/constraints.txt > "$CONSTRAINT"
export PIP_CONSTRAINT=/dev/null
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH' else 1)" \
    2>/dev/null; then
  "$VPY" -m pip install --quiet "torch==$TORCH"
fi
"$VPY" -m pip install --quiet -c "$CONSTRAINT" -e ".[$EXTRAS]"
echo "$WANT" > "$STAMP"
echo "seq1f1b: $VENV ready (torch $("$VPY" -c 'import torch; print(torch.__version__)'))" >&2
