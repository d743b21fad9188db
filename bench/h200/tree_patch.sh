#!/usr/bin/env bash
# Older commits to serve beside HEAD in ONE device call (bench/h200/README.md), as patches against HEAD: a call
# carries at most 64 MiB, and dist alone is 53, so whole trees (2.7 MB each) fit one at a time; a patch is
# 0.3-0.5 MB. For each REV: .cache/treepatch/REV.patch = `git diff HEAD REV` without tests, docs, bench/results and
# README.md. Make them at the commit the call runs (a patch against another HEAD will not apply), carry
# .cache/treepatch beside dist and .cache/loadgen-fixtures, and serve them with bench/h200/serve_trees.sh.
#   bash bench/h200/tree_patch.sh 5988a12 c9beb48
set -euo pipefail
cd "$(dirname "$0")/../.."
(( $# )) || { echo "usage: $0 REV [REV ...]" >&2; exit 2; }
[[ -z "$(git status --porcelain --untracked-files=no)" ]] || { echo "commit first: the device copy is HEAD's tree" >&2; exit 2; }
mkdir -p .cache/treepatch
for rev in "$@"; do
  short="$(git rev-parse --short=7 "$rev")"
  git diff --binary HEAD "$short" -- . ':!tests' ':!docs' ':!bench/results' ':!README.md' > ".cache/treepatch/$short.patch"
  echo ".cache/treepatch/$short.patch ($(du -h ".cache/treepatch/$short.patch" | cut -f1))"
done
