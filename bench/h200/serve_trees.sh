#!/usr/bin/env bash
# On the device: serve older commits one after another (patches of bench/h200/tree_patch.sh), each in its own copy
# of this tree and its own venv, through its ab_run.sh (HEAD's when it has none). The load JSON of REV lands in
# $OUT/tREV/tREV.json, its steps' output in $OUT/tREV/runs.txt.
#   export BUNDLE=$PWD/dist/duplex-offline-py312.tar.xz FIXTURES=$PWD/.cache/loadgen-fixtures
#   PROFILE=deploy/profiles/ab-old.yaml bash bench/h200/serve_trees.sh 5988a12:170 c9beb48:125
# REV:SECONDS: the serve's time limit (the first also installs and writes the checkpoint: about 150 s, the others
# about 120). PROFILE (default deploy/profiles/h200-scripted.yaml) is taken from THIS tree into every copy, so every
# commit serves one configuration (a profile key an older commit lacks fails its load: check before the call).
# SESSIONS (default 16) as in ab_run.sh.
set -u
cd "$(dirname "$0")/../.."
here="$PWD" out="${OUT:-/tmp/duplex-out}" profile="${PROFILE:-deploy/profiles/h200-scripted.yaml}"
[[ -f "$profile" ]] || { echo "no profile $profile" >&2; exit 2; }
(( $# )) || { echo "usage: PROFILE=... $0 REV:SECONDS [REV:SECONDS ...]" >&2; exit 2; }
for spec in "$@"; do
  rev="${spec%%:*}" seconds="${spec#*:}"
  tree="/tmp/tree-$rev"
  [[ -f ".cache/treepatch/$rev.patch" ]] || { echo "no .cache/treepatch/$rev.patch (bench/h200/tree_patch.sh)" >&2; continue; }
  rm -rf "$tree" && mkdir -p "$tree"
  tar -C "$here" --exclude=./dist --exclude=./.cache -cf - . | tar -C "$tree" -xf -
  (cd "$tree" && patch -p1 -s < "$here/.cache/treepatch/$rev.patch") || { echo "$rev: the patch does not apply" >&2; continue; }
  [[ -f "$tree/bench/h200/ab_run.sh" ]] || cp bench/h200/ab_run.sh "$tree/bench/h200/"
  mkdir -p "$(dirname "$tree/$profile")" && cp "$profile" "$tree/$profile"
  (cd "$tree" && VENV="/tmp/venv-$rev" OUT="$out/t$rev" COMMIT="$rev" \
    bash bench/h200/ab_run.sh "t$rev:$profile:${SESSIONS:-16}:$seconds" > /dev/null 2>&1)
  rm -rf "/tmp/venv-$rev" "$tree"
  grep -h "^N |\|^[0-9]* |\|^== \|done in" "$out/t$rev/runs.txt"
done
