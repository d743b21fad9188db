#!/usr/bin/env bash
# An A/B of deploy profiles in ONE device call (bench/h200/README.md): for each NAME:PROFILE:SESSIONS[:SECONDS] a
# serve of PROFILE through final_run.sh, stopped before the next. The load JSON is kept as $OUT/NAME.json (the
# cancel run's as $OUT/NAME-cancel.json), every step's output goes to $OUT/runs.txt, the diagnostics are dropped:
# a device call brings back at most 8 files. Run from the checkout, carrying dist and .cache/loadgen-fixtures:
#   COMMIT=<12 hex of HEAD> bash bench/h200/ab_run.sh a:deploy/profiles/h200-scripted.yaml:16,32 b:deploy/profiles/ab-x.yaml:16,32
# COMMIT is needed: the device copy's git is not this checkout's (it named an older commit at stop 35).
# Variant profiles: bench/h200/variant_profile.py BASE OUT KEY=VALUE..., made here before the call (checked as a
# profile, engine option names included); they travel untracked.
# SECONDS defaults to 110 + 25 per load level, + 60 for the first variant (install and checkpoint); a variant
# that runs out keeps the levels it finished. CANCEL_RUN (default 0 here), KEEP_GOING (default 1) and the other
# knobs of final_run.sh / run_served.sh pass through.
set -u
cd "$(dirname "$0")/../.."
[[ -n "${COMMIT:-}" ]] || { echo "set COMMIT=\$(git rev-parse --short=12 HEAD), written into the command" >&2; exit 2; }
(( $# )) || { echo "usage: COMMIT=... $0 NAME:PROFILE:SESSIONS[:SECONDS] ..." >&2; exit 2; }
export COMMIT CANCEL_RUN="${CANCEL_RUN:-0}" KEEP_GOING="${KEEP_GOING:-1}" PYSPY_AT="${PYSPY_AT:-100000}"
OUT="${OUT:-/tmp/duplex-out}"
mkdir -p "$OUT"
first=1
for v in "$@"; do
  IFS=: read -r name profile sessions seconds <<< "$v"
  [[ -n "$name" && -f "$profile" && -n "$sessions" ]] || { echo "bad variant $v (NAME:PROFILE:SESSIONS[:SECONDS])" >&2; exit 2; }
  levels=$(tr ',' '\n' <<< "$sessions" | wc -l)
  seconds="${seconds:-$(( 110 + 25 * levels + 60 * first ))}"
  dir="$OUT/ab-$name"
  mkdir -p "$dir"
  echo "== $name: $profile, sessions $sessions, at most $seconds s, $(date +%T)" >> "$OUT/runs.txt"
  PROFILE="$profile" SESSIONS="$sessions" OUT="$dir" timeout "$seconds" bash bench/h200/final_run.sh >> "$OUT/runs.txt" 2>&1
  echo "== $name: exit $?, $(date +%T)" >> "$OUT/runs.txt"
  bash bench/h200/run_served.sh stop >> "$OUT/runs.txt" 2>&1
  [[ -f "$dir/load-h200.json" ]] && mv "$dir/load-h200.json" "$OUT/$name.json"
  [[ -f "$dir/load-h200-cancel.json" ]] && mv "$dir/load-h200-cancel.json" "$OUT/$name-cancel.json"
  rm -rf "$dir"
  first=0
  sleep 2
done
ls "$OUT"
