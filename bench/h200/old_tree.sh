#!/usr/bin/env bash
# An older commit's tree to serve beside HEAD in ONE device call (bench/h200/README.md): `git archive` of REV into
# .cache/tree-<rev>, without tests, docs and bench/results (to fit a call's 64 MiB beside dist), with HEAD's
# ab_run.sh when the old tree has none, and the commit written to its COMMIT file. Carry the printed path beside
# dist and .cache/loadgen-fixtures; on the device run it from that folder with its own venv (its .pth names its tree):
#   (cd .cache/tree-<rev> && BUNDLE=$PWD/../../dist/duplex-offline-py312.tar.xz FIXTURES=$PWD/../loadgen-fixtures \
#     VENV=/tmp/duplex-venv-old OUT=$OUT/old COMMIT=$(cat COMMIT) bash bench/h200/ab_run.sh old:deploy/profiles/h200-scripted.yaml:8,16)
set -euo pipefail
cd "$(dirname "$0")/../.."
rev="$(git rev-parse --short=12 "${1:?usage: $0 REV}")"
dir=".cache/tree-${rev:0:7}"
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir" --exclude=tests --exclude=docs --exclude=bench/results
[[ -f "$dir/bench/h200/ab_run.sh" ]] || cp bench/h200/ab_run.sh "$dir/bench/h200/ab_run.sh"
echo "$rev" > "$dir/COMMIT"
echo "$dir ($(du -sh "$dir" | cut -f1))"
