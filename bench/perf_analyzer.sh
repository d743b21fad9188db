#!/usr/bin/env bash
# perf_analyzer over gRPC streaming with sequences, for the `duplex` pipeline or one stage.
#   bench/perf_analyzer.sh [MODEL] [extra perf_analyzer args...]        MODEL: duplex (default) | stage0
# Environment: TRITON_GRPC_URL (127.0.0.1:8002), PA_DATA (bench/perf_data/session_2units.json),
#   PA_CONCURRENCY (2 = two concurrent sessions), PA_MEASURE_MS (3000), VENV (.venv).
# Each stream in PA_DATA is one session (open, appends, close); perf_analyzer sets START/END itself.
# perf_analyzer ships with tritonclient 2.51; it needs Debian's libb64-0d and libcudart.so.12 from the
# nvidia-cuda-runtime-cu12 wheel (both installed by `make install`), even on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
MODEL="${1:-duplex}"
[[ $# -gt 0 ]] && shift
CUDART="$("$VENV/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')"
export LD_LIBRARY_PATH="$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$VENV/bin/perf_analyzer" -m "$MODEL" -u "${TRITON_GRPC_URL:-127.0.0.1:8002}" -i grpc --streaming \
  --input-data "${PA_DATA:-bench/perf_data/session_2units.json}" \
  --concurrency-range "${PA_CONCURRENCY:-2}" --measurement-interval "${PA_MEASURE_MS:-3000}" \
  --sequence-id-range 1:1000000 "$@"
