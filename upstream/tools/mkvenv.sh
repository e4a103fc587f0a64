#!/usr/bin/env bash
# mkvenv.sh DEST PIPELINING_DIR: a scratch venv whose torch is the 2.15.0 of .venv with
# torch/distributed/pipelining replaced by PIPELINING_DIR (a patched copy of its files).
#
# Nothing of torch is copied but those files: DEST's site-packages holds a "symlink farm" of the
# installed torch (every entry a link) in which distributed/ is a real folder of links whose
# pipelining entry points at PIPELINING_DIR. The rest of .venv (numpy, torchtitan, this
# package in editable mode, pytest, ...) is reached through a .pth file after DEST's own
# site-packages (then the system's, as .venv has them), so DEST's torch wins.
set -euo pipefail
DEST="$1"
PIPELINING="$(cd "$2" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BASE="$ROOT/.venv"
BASE_SITE="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
[ -d "$BASE_SITE/torch/distributed/pipelining" ] || {
  echo "mkvenv.sh: $BASE has no torch (run: bash scripts/setup_env.sh .venv 2.15.0)" >&2
  exit 1
}
rm -rf "$DEST"
"$BASE/bin/python" -m venv --without-pip --system-site-packages "$DEST"
SITE="$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/torch/distributed"
for entry in "$BASE_SITE"/torch/*; do
  name="$(basename "$entry")"
  [ "$name" = distributed ] || ln -s "$entry" "$SITE/torch/$name"
done
for entry in "$BASE_SITE"/torch/distributed/*; do
  name="$(basename "$entry")"
  [ "$name" = pipelining ] || ln -s "$entry" "$SITE/torch/distributed/$name"
done
ln -s "$PIPELINING" "$SITE/torch/distributed/pipelining"
ln -s "$BASE_SITE"/torch-*.dist-info "$SITE/"
# an import line: site.addsitedir also runs the base's own .pth files (the editable install)
echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zz_venv_latest.pth"
# torch's test helpers (torch.testing._internal) need expecttest, which no extra installs
"$BASE/bin/python" -m pip install -q --no-deps --target "$SITE" expecttest
# the editable install of this package (its .pth and finder) comes with the base site-packages
"$DEST/bin/python" - <<PY
import torch.distributed.pipelining as p, torch
assert p.__path__[0].startswith("$SITE"), p.__path__
print("mkvenv.sh:", "$DEST", "torch", torch.__version__, "pipelining ->", "$PIPELINING")
PY
