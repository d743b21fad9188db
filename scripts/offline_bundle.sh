#!/usr/bin/env bash
# Pack what `duplex serve` (and bench/load_realtime.py) need beyond a host with Python + CUDA torch into
# ONE xz archive, for air-gapped GPU hosts (docs/deploy.md, "Offline install"):
#   - tritonserver 2.51 + the Python backend + the stub of ONE Python version, trimmed from the pinned
#     nvidia-pytriton wheel (scripts/pack_wheels.py triton),
#   - the gateway's and the stub's wheels for that Python (pins from requirements/*.txt), numpy 1.x
#     included (the 2.51 stub fails every output tensor with numpy 2.x), torch NOT included,
#   - a pip wheel (the installer runs pip from it: no pip or ensurepip needed on the host),
#   - scripts/install_offline.sh, which installs it all into a venv (no network).
# Wheels are re-zipped uncompressed so that xz packs the files themselves (~2x smaller than deflate).
#
#   scripts/offline_bundle.sh [--python 3.12] [--out dist/] [--host-provides "onnxruntime pillow"]
#
# --host-provides names packages NOT packed because the target host already has them: the lent H200's
# image has onnxruntime 1.30 (server VAD; its 28 MB wheel would push the bundle past the 64 MiB a device
# call carries) and Pillow (camera frames only, 7 MB). The installer checks that each one imports.
# Pass --host-provides "" to pack everything (about 25 MB more). Default bundle for 3.12: 55 MB (52 MB before pytest and py-spy).
# Needs network to PyPI (pip download) and `readelf`; downloads are cached in .cache/offline-wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

PY_VERSION=3.12
OUT=dist
HOST_PROVIDES="onnxruntime pillow"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PY_VERSION="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --host-provides) HOST_PROVIDES="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "offline_bundle: unknown argument $1" >&2; exit 2 ;;
  esac
done

# What the gateway, the client/loadgen and the stub import (engine: tokenizers, safetensors, yaml, numpy),
# with the dependencies pip would pull in. torch and its dependencies come from the host.
PACKAGES=(
  fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing_extensions
  typing-inspection opentelemetry-api importlib_metadata zipp anyio idna uvicorn h11 click websockets
  tritonclient python-rapidjson urllib3 grpcio protobuf numpy onnxruntime flatbuffers packaging
  silero-vad soundfile cffi pycparser soxr prometheus_client PyYAML safetensors tokenizers pillow
  nvidia-pytriton
  # diagnosis on the GPU host (5 MB): the CUDA-graph tests (pytest) and stack dumps of a stage under load
  pytest pluggy iniconfig Pygments pytest-asyncio pytest-timeout py-spy
)
PIP_PIN="pip==25.3"
PY_TAG="cp${PY_VERSION/./}"
CACHE=".cache/offline-wheels/$PY_TAG"
NAME="duplex-offline-py${PY_VERSION/./}"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$CACHE" "$OUT" "$STAGE/$NAME/wheels"

pin() {  # NAME -> NAME==VERSION from requirements/base.txt or nodeps.txt (case-insensitive, - == _)
  local want line key
  want="$(echo "$1" | tr 'A-Z_' 'a-z-')"
  while read -r line; do
    key="$(echo "${line%%==*}" | tr 'A-Z_' 'a-z-')"
    [[ "$key" == "$want" ]] && { echo "$line"; return; }
  done < <(grep -h '==' requirements/base.txt requirements/nodeps.txt)
  echo "offline_bundle: $1 has no pin in requirements/" >&2; exit 1
}

specs=("$PIP_PIN")
for pkg in "${PACKAGES[@]}"; do
  [[ " $HOST_PROVIDES " == *" $pkg "* ]] && continue
  specs+=("$(pin "$pkg")")
done

t0=$SECONDS
echo "[bundle] downloading ${#specs[@]} wheels for $PY_TAG into $CACHE"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$CACHE" "${specs[@]}"

wheel_of() {  # NAME==VERSION -> the cached wheel file
  local spec="$1" name version
  name="$(echo "${spec%%==*}" | tr 'A-Z-' 'a-z_')"; version="${spec##*==}"
  find "$CACHE" -maxdepth 1 -iname "${name}-${version}-*.whl" | head -1
}

W="$STAGE/$NAME/wheels"
for spec in "${specs[@]}"; do
  whl="$(wheel_of "$spec")"
  [[ -n "$whl" ]] || { echo "offline_bundle: no wheel for $spec in $CACHE" >&2; exit 1; }
  case "${spec%%==*}" in
    nvidia-pytriton) python3 scripts/pack_wheels.py triton "$whl" "$W" --python "$PY_VERSION" ;;
    # perf_analyzer / perf_client (2 x 20 MB) are benchmark tools, not used by `duplex serve`.
    tritonclient) python3 scripts/pack_wheels.py trim "$whl" "$W" --drop '*/data/bin/*' ;;
    # the gateway's VAD reads silero_vad/data/silero_vad_16k_op15.onnx only (gateway/vad/model.py MODEL_FILE;
    # tests/deploy/test_offline_bundle.py holds the two together).
    silero-vad) python3 scripts/pack_wheels.py trim "$whl" "$W" --drop 'silero_vad/data/*.jit' \
                  'silero_vad/data/*.safetensors' 'silero_vad/data/silero_vad.onnx' 'silero_vad/data/silero_vad_[!1]*' \
                  'silero_vad/data/silero_vad_16k_[!o]*' ;;
    *) python3 scripts/pack_wheels.py store "$whl" "$W" >/dev/null ;;
  esac
done

cp scripts/install_offline.sh "$STAGE/$NAME/"
{
  echo "python=$PY_VERSION"
  echo "host_provides=$HOST_PROVIDES"
  echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$STAGE/$NAME/BUNDLE"
(cd "$W" && ls -1 *.whl) > "$STAGE/$NAME/WHEELS"

ARCHIVE="$OUT/$NAME.tar.xz"
echo "[bundle] packing $(du -sm "$STAGE/$NAME" | cut -f1) MB of files with xz"
tar -C "$STAGE" -cf - "$NAME" | xz "${XZ_LEVEL:--9}" -T0 > "$ARCHIVE.part"  # XZ_LEVEL=-1: quick test builds
mv "$ARCHIVE.part" "$ARCHIVE"
echo "[bundle] $ARCHIVE: $(( $(stat -c %s "$ARCHIVE") / 1000000 )) MB in $(( SECONDS - t0 )) s"
