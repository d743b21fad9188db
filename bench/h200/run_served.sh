#!/usr/bin/env bash
# The served figure on the lent H200 (issue 13): offline install -> full-size random checkpoint ->
# `duplex serve` (detached, survives the device call) -> the Realtime load generator. bench/h200/README.md.
#
#   bench/h200/run_served.sh fixtures            # HERE (needs espeak-ng + sox): speech fixtures to carry
#   bench/h200/run_served.sh setup ckpt serve    # on the H200: install, write /tmp/ckpt, start and wait
#   bench/h200/run_served.sh load logs           # on the H200: the sweep, then log tails into $OUT
#   bench/h200/run_served.sh all                 # setup ckpt serve load logs in one call
#   bench/h200/run_served.sh status | stop
#
# Every step prints a `[h200] <step> ... s` timing line; steps already done on a warm machine (venv,
# checkpoint, a server that answers /ready) are skipped. Knobs (environment):
#   BUNDLE   dist/duplex-offline-py312.tar.xz   VENV /tmp/duplex-venv   CKPT /tmp/ckpt
#   CKPT_ARGS (extra make_full_checkpoint.py flags, e.g. --no-vision)   PROFILE deploy/profiles/h200-scripted.yaml
#   PORT 8000   METRICS_PORT 8003   SERVE_DIR /tmp/duplex-serve (cache dir: model repository + logs)
#   READY_TIMEOUT 420 (s the serve step waits for /ready)   SESSIONS 1,8,16,32,64   DURATION 20
#   KEEP_GOING (set: the sweep runs every N, also after one that did not hold)
#   FIXTURES .cache/loadgen-fixtures (espeak-ng WAVs made by `fixtures`; carry it)   OUT ($OUT or /tmp/duplex-out)
#   COMMIT (recorded in the results; default: the file COMMIT beside this checkout, else git HEAD)
#   UNIT_ALIGN_S (set: the gateway's DUPLEX_UNIT_ALIGN_S for `serve` and the load generator's --unit-align-s,
#     over the profile's unit_align_s; 0 turns it off; unset: both follow the profile)
#   INSTRUCTIONS_CHARS (set: the load generator's --instructions-chars, each session's system prompt that many
#     characters: sessions that start about that many KV positions deep, as long calls do)
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$(pwd)"

BUNDLE="${BUNDLE:-dist/duplex-offline-py312.tar.xz}"
VENV="${VENV:-/tmp/duplex-venv}"
CKPT="${CKPT:-/tmp/ckpt}"
CKPT_ARGS="${CKPT_ARGS:-}"
PROFILE="${PROFILE:-deploy/profiles/h200-scripted.yaml}"
PORT="${PORT:-8000}"
METRICS_PORT="${METRICS_PORT:-8003}"
SERVE_DIR="${SERVE_DIR:-/tmp/duplex-serve}"
READY_TIMEOUT="${READY_TIMEOUT:-420}"
SESSIONS="${SESSIONS:-1,8,16,32,64}"
DURATION="${DURATION:-20}"
FIXTURES="$(realpath -m "${FIXTURES:-.cache/loadgen-fixtures}")"
OUT="${OUT:-/tmp/duplex-out}"
COMMIT="${COMMIT:-$(cat COMMIT 2>/dev/null || true)}"
mkdir -p "$OUT" "$SERVE_DIR"
PIDFILE="$SERVE_DIR/serve.pid"
SERVE_LOG="$SERVE_DIR/serve.log"
URL="http://127.0.0.1:$PORT"

say() { echo "[h200] $*"; }
timed() {  # timed STEP FUNCTION: run it and print how long it took
  local t0=$SECONDS
  say "$1 ..."
  "$2"
  say "$1 done in $(( SECONDS - t0 )) s"
}
ready() {  # python3, not curl: the one tool every host with the project has
  python3 -c 'import sys, urllib.request as u
try: sys.exit(u.urlopen(sys.argv[1], timeout=2).status != 200)
except Exception: sys.exit(1)' "$URL/ready"
}
serving() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

do_fixtures() {
  DUPLEX_LOADGEN_CACHE="$FIXTURES" .venv/bin/python -c \
    'from bench.loadgen.fixtures import speech_fixtures; print(sum(len(a) for a in speech_fixtures()) / 16000, "s of speech")'
  ls -la "$FIXTURES"
}

do_setup() {
  local stamp="$VENV/.offline-bundle.sha256" sum
  [[ -f "$BUNDLE" ]] || { say "no bundle at $BUNDLE: build it here with scripts/offline_bundle.sh and carry dist"; return 1; }
  sum="$(sha256sum "$BUNDLE" | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$sum" ]]; then say "venv $VENV already holds this bundle"; return; fi
  bash scripts/install_offline.sh "$BUNDLE" "$VENV" "$REPO"
  echo "$sum" > "$stamp"
}

do_ckpt() {
  if [[ -f "$CKPT/config.json" ]]; then say "checkpoint $CKPT present ($(du -sh "$CKPT" | cut -f1))"; return; fi
  rm -rf "$CKPT"
  # shellcheck disable=SC2086
  "$VENV/bin/python" build/make_full_checkpoint.py --out "$CKPT" --device cuda $CKPT_ARGS
}

do_serve() {
  if ready; then say "already serving at $URL"; return; fi
  if ! serving; then
    # setsid: its own session, so the server outlives this device call and a later call reuses it.
    # Only a set UNIT_ALIGN_S reaches the gateway: unset, the profile's unit_align_s holds.
    ${UNIT_ALIGN_S:+env "DUPLEX_UNIT_ALIGN_S=$UNIT_ALIGN_S"} setsid "$VENV/bin/duplex" serve --profile "$PROFILE" --checkpoint "$CKPT" --port "$PORT" \
      --triton-metrics-port "$METRICS_PORT" --cache-dir "$SERVE_DIR" > "$SERVE_LOG" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    say "started duplex serve (pid $(cat "$PIDFILE")), log $SERVE_LOG"
  fi
  local t0=$SECONDS last=$SECONDS
  until ready; do
    if ! serving; then say "duplex serve exited:"; tail -n 40 "$SERVE_LOG"; return 1; fi
    if (( SECONDS - t0 > READY_TIMEOUT )); then
      say "not ready after ${READY_TIMEOUT} s (still starting; run 'serve' again to keep waiting)"
      tail -n 5 "$SERVE_LOG"; return 1
    fi
    if (( SECONDS - last >= 15 )); then last=$SECONDS; say "waiting for /ready ($(( SECONDS - t0 )) s): $(tail -n 1 "$SERVE_LOG")"; fi
    sleep 2
  done
  say "ready at $URL"
}

do_load() {
  ready || { say "no server answers $URL/ready: run 'serve' first"; return 1; }
  DUPLEX_LOADGEN_CACHE="$FIXTURES" PYTHONUNBUFFERED=1 "$VENV/bin/python" bench/load_realtime.py \
    --url "ws://127.0.0.1:$PORT" --sessions "$SESSIONS" --duration "$DURATION" --profile "$PROFILE" \
    --triton-metrics "http://127.0.0.1:$METRICS_PORT/metrics" --out "$OUT/load-h200.json" \
    ${COMMIT:+--commit "$COMMIT"} ${KEEP_GOING:+--keep-going} ${UNIT_ALIGN_S:+--unit-align-s "$UNIT_ALIGN_S"} \
    ${INSTRUCTIONS_CHARS:+--instructions-chars "$INSTRUCTIONS_CHARS"}
}

do_logs() {
  tail -n 300 "$SERVE_LOG" > "$OUT/serve-tail.log" 2>/dev/null || true
  local tlog  # the launcher names it tritonserver-<port>.log (tritonserver.log before)
  tlog="$(ls -t "$SERVE_DIR"/logs/tritonserver*.log 2>/dev/null | head -1)"
  [[ -n "$tlog" ]] && tail -n 500 "$tlog" > "$OUT/tritonserver-tail.log"
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  ls -la "$OUT"
}

do_status() {
  serving && say "duplex serve pid $(cat "$PIDFILE") alive" || say "no duplex serve running"
  ready && say "$URL/ready: 200" || say "$URL/ready: not ready"
  tail -n 5 "$SERVE_LOG" 2>/dev/null || true
}

do_stop() {
  # duplex serve stops the gateway, then tritonserver (its stubs free 100 GB), then quits its MPS daemon: wait
  # for all of it (up to 120 s), so a check after this step sees what a clean stop leaves
  if serving; then
    kill -TERM -- "-$(cat "$PIDFILE")" 2>/dev/null || true
    for _ in $(seq 120); do serving || break; sleep 1; done
    serving && say "duplex serve still running 120 s after SIGTERM"
  fi
  rm -f "$PIDFILE"
}

[[ $# -gt 0 ]] || { sed -n '2,20p' "$0"; exit 2; }
# A failed step still leaves the log tails in $OUT (what comes back from a device call).
trap 'rc=$?; if [[ $rc -ne 0 ]]; then do_logs >/dev/null 2>&1 || true; fi; exit $rc' EXIT
steps=("$@")
[[ "${steps[*]}" == "all" ]] && steps=(setup ckpt serve load logs)
for step in "${steps[@]}"; do
  case "$step" in
    fixtures|setup|ckpt|serve|load|logs|status|stop) timed "$step" "do_$step" ;;
    *) echo "run_served: unknown step $step (fixtures setup ckpt serve load logs status stop all)" >&2; exit 2 ;;
  esac
done
