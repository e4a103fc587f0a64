#!/usr/bin/env bash
# workspace.sh: (re)build upstream/.work, the git repository the series is written in: a first
# commit (tag base) with torch 2.15.0's torch/distributed/pipelining from .venv, then
# one commit per patch of series/ (git am), on branch series.
set -euo pipefail
UP="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$(cd "$UP/.." && pwd)"
SITE="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE="$SITE/torch/distributed/pipelining"
(cd "$BASE" && sha256sum -c --quiet "$UP/series/BASE.sha256")
WORK="$UP/.work"
rm -rf "$WORK"
mkdir -p "$WORK/torch/distributed" "$WORK/test/distributed/pipelining"
cp -r "$BASE" "$WORK/torch/distributed/pipelining"
rm -rf "$WORK/torch/distributed/pipelining/__pycache__"
touch "$WORK/test/distributed/pipelining/.keep"
cd "$WORK"
git init -q -b series
git add -A
git -c user.name=seq1f1b -c user.email=seq1f1b@example.com commit -qm \
  "torch 2.15.0: torch/distributed/pipelining (base)"
git tag base
git -c user.name=seq1f1b -c user.email=seq1f1b@example.com am -q "$UP"/series/[0-9]*.patch
git log --oneline
