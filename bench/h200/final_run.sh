#!/usr/bin/env bash
# The served figure in one device call (bench/RESULTS.md): install, checkpoint, serve PROFILE, the sweep
# (SESSIONS, default 1,8,16,32), then 8 sessions with a cancel every 5 s; the load JSONs into $OUT, log tails,
# memory, top, GPU use and py-spy profiles into $OUT/diag.tgz. PYSPY_AT: seconds after the sweep starts when
# the stubs are profiled (default 55: inside the N=16 level of the default sweep); CANCEL_RUN=0 skips the cancel run.
# Run from a git archive of the commit, carrying dist (scripts/offline_bundle.sh) and .cache/loadgen-fixtures
# (run_served.sh fixtures):  cd .snap && bash bench/h200/final_run.sh
set -u
cd "$(dirname "$0")/../.."
# from a snapshot (.snap) the bundle and fixtures sit one level up; run from the checkout they sit here (stop 36:
# a call from the checkout without BUNDLE / FIXTURES set found no bundle)
up() { if [[ -e "../$1" ]]; then echo "../$1"; else echo "$1"; fi; }
export BUNDLE="${BUNDLE:-$(up dist/duplex-offline-py312.tar.xz)}" FIXTURES="${FIXTURES:-$(up .cache/loadgen-fixtures)}"
export DURATION="${DURATION:-20}" SESSIONS="${SESSIONS:-1,8,16,32}" OUT="${OUT:-/tmp/duplex-out}"
export PROFILE="${PROFILE:-deploy/profiles/h200-scripted.yaml}" READY_TIMEOUT="${READY_TIMEOUT:-240}"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY  # duplex serve starts its own MPS daemon (mps: auto)
R=bench/h200/run_served.sh
# the background jobs below (top, dmon, the py-spy sleeper) end with this script, also when `timeout` stops it: a
# sleeper left behind profiled the next serve of an A/B call into this run's OUT (stop 35)
trap 'kill $(jobs -p) 2>/dev/null' EXIT
trap 'exit 143' TERM INT
export COMMIT="${COMMIT:-$(cat COMMIT 2>/dev/null || true)}"  # written by the snapshot step
bash $R setup ckpt serve || exit 1
grep -h "MPS" /tmp/duplex-serve/serve.log | head -3
grep -hE "warm-up (done|finished)" /tmp/duplex-serve/logs/tritonserver*.log | cut -c1-200
nvidia-smi --query-compute-apps=pid,used_memory,name --format=csv | tee "$OUT/mem.txt"
# what the host does while the sweep runs: top every 5 s, GPU use every second; during N=16 a 10 s py-spy
# profile of every stage stub (collapsed stacks, non-blocking, so the stage is not paused) and one dump
top -b -d 5 -n 30 -w 250 > "$OUT/top.txt" 2>&1 &
nvidia-smi dmon -s u -d 1 -c 150 > "$OUT/dmon.txt" 2>&1 &
( sleep "${PYSPY_AT:-55}"; for p in $(pgrep -f triton_python_backend_stub); do
    m=$(tr '\0' ' ' < /proc/$p/cmdline | grep -oE 'models/[a-z0-9_]+|/(stage0|tts|token2wav|duplex)/' | head -1 | tr -d '/')
    /tmp/duplex-venv/bin/py-spy record --pid "$p" --duration 10 --rate 100 --nonblocking --format raw \
      --output "$OUT/pyspy-${m:-stub}-$p.txt" > /dev/null 2>&1 &
    /tmp/duplex-venv/bin/py-spy dump --pid "$p" --nonblocking >> "$OUT/py-spy.txt" 2>&1
  done; wait ) &
bash $R load
[[ "${CANCEL_RUN:-1}" == 1 ]] && DUPLEX_LOADGEN_CACHE="$(realpath "$FIXTURES")" /tmp/duplex-venv/bin/python bench/load_realtime.py \
  --url ws://127.0.0.1:8000 --sessions 8 --duration "$DURATION" --cancel-every 5 --profile "$PROFILE" \
  ${COMMIT:+--commit "$COMMIT"} \
  --triton-metrics http://127.0.0.1:8003/metrics --out "$OUT/load-h200-cancel.json" 2>&1 | tail -3
bash $R logs stop
pgrep -a nvidia-cuda-mps || echo "no MPS process left"
# a device call brings back at most 8 files: the diagnostics travel as one archive
( cd "$OUT" && tar -czf diag.tgz --remove-files ./*.txt ./*.log 2>/dev/null; ls "$OUT" )
