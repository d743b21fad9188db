#!/usr/bin/env bash
# The served figure in one device call (bench/RESULTS.md): install, checkpoint, serve PROFILE, the sweep
# (SESSIONS, default 1,8,16,32), then 8 sessions with a cancel every 5 s; log tails and memory into $OUT.
# Run from a git archive of the commit, carrying dist (scripts/offline_bundle.sh) and .cache/loadgen-fixtures
# (run_served.sh fixtures):  cd .snap && bash bench/h200/final_run.sh
set -u
cd "$(dirname "$0")/../.."
export BUNDLE="${BUNDLE:-../dist/duplex-offline-py312.tar.xz}" FIXTURES="${FIXTURES:-../.cache/loadgen-fixtures}"
export DURATION="${DURATION:-20}" SESSIONS="${SESSIONS:-1,8,16,32}" OUT="${OUT:-/tmp/duplex-out}"
export PROFILE="${PROFILE:-deploy/profiles/h200-scripted.yaml}" READY_TIMEOUT="${READY_TIMEOUT:-240}"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY  # duplex serve starts its own MPS daemon (mps: auto)
R=bench/h200/run_served.sh
bash $R setup ckpt serve || exit 1
grep -h "MPS" /tmp/duplex-serve/serve.log | head -3
grep -hE "warm-up (done|finished)" /tmp/duplex-serve/logs/tritonserver*.log | cut -c1-200
nvidia-smi --query-compute-apps=pid,used_memory,name --format=csv | tee "$OUT/mem.txt"
bash $R load
DUPLEX_LOADGEN_CACHE="$(realpath "$FIXTURES")" /tmp/duplex-venv/bin/python bench/load_realtime.py \
  --url ws://127.0.0.1:8000 --sessions 8 --duration "$DURATION" --cancel-every 5 --profile "$PROFILE" \
  --triton-metrics http://127.0.0.1:8003/metrics --out "$OUT/load-h200-cancel.json" 2>&1 | tail -3
bash $R logs stop
pgrep -a nvidia-cuda-mps || echo "no MPS process left"
