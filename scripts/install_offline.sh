#!/usr/bin/env bash
# Install the offline bundle (scripts/offline_bundle.sh) into a venv on a host with no package index.
#
#   scripts/install_offline.sh BUNDLE.tar.xz|BUNDLE_DIR VENV [REPO]
#
# The host must have the bundle's Python (python3, or $PYTHON) with libpython (the Triton stub links
# it) and a CUDA torch importable by that Python. The venv gets:
#   - the bundle's wheels, installed with pip run from the bundled pip wheel (--no-index --no-deps),
#   - a .pth line to the host's torch site-packages, written AFTER the wheels: the venv's own
#     site-packages come first, so the Triton stub sees numpy 1.26 (the 2.51 stub needs numpy 1.x)
#     and torch from the host (the stub ignores PYTHONPATH; it reads the venv leading PATH),
#   - a .pth line to REPO (default: this script's repo) and a `duplex` script, so `engine`, `gateway`,
#     `serve` and `model_repository` import in the gateway and in the stub without a build step.
# Then `VENV/bin/duplex serve ...` runs as usual. Re-running replaces the venv.
set -euo pipefail

[[ $# -ge 2 ]] || { sed -n '2,15p' "$0"; exit 2; }
BUNDLE="$1"
VENV="$(realpath -m "$2")"
REPO="$(realpath "${3:-$(dirname "$0")/..}")"
PYTHON="${PYTHON:-python3}"
t0=$SECONDS

if [[ -f "$BUNDLE" ]]; then
  UNPACK="$(mktemp -d)"
  trap 'rm -rf "$UNPACK"' EXIT
  tar -C "$UNPACK" -xJf "$BUNDLE"
  BUNDLE="$(find "$UNPACK" -mindepth 1 -maxdepth 1 -type d | head -1)"
fi
[[ -f "$BUNDLE/BUNDLE" ]] || { echo "install_offline: $BUNDLE is not an offline bundle" >&2; exit 1; }
want="$(sed -n 's/^python=//p' "$BUNDLE/BUNDLE")"
host_provides="$(sed -n 's/^host_provides=//p' "$BUNDLE/BUNDLE")"
have="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
[[ "$have" == "$want" ]] || { echo "install_offline: bundle is for Python $want, $PYTHON is $have" >&2; exit 1; }
torch_site="$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" || {
  echo "install_offline: $PYTHON cannot import torch (install a CUDA torch for Python $want first)" >&2; exit 1; }

echo "[offline] venv $VENV (Python $have; torch from $torch_site)"
rm -rf "$VENV"
"$PYTHON" -m venv --without-pip "$VENV"
PIP_WHEEL="$(ls "$BUNDLE"/wheels/pip-*.whl)"
"$VENV/bin/python" "$PIP_WHEEL/pip" install -q --disable-pip-version-check --no-index --no-deps \
  --no-compile "$BUNDLE"/wheels/*.whl
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$REPO" > "$SITE/_duplex_repo.pth"
echo "$torch_site" > "$SITE/_duplex_host_torch.pth"
cat > "$VENV/bin/duplex" <<EOF
#!$VENV/bin/python
import sys
from serve.cli import main
sys.exit(main())
EOF
chmod +x "$VENV/bin/duplex"

# Check what a broken install would only show at serve time: numpy 1.x first, torch from the host,
# tritonserver with the stub for this Python, the gateway importable, host-provided packages present.
"$VENV/bin/python" - "$host_provides" <<'EOF'
import importlib, os, pathlib, sys
MODULES = {"pillow": "PIL", "pyyaml": "yaml"}  # distribution -> module where they differ
for name in sys.argv[1].split():  # first: the gateway imports onnxruntime at start
    try:
        importlib.import_module(MODULES.get(name.lower(), name.replace("-", "_")))
    except ImportError as exc:
        sys.exit(f"install_offline: {name} is not in the bundle and the host has none ({exc})")
import numpy, torch, pytriton, fastapi, tritonclient.grpc, gateway.app  # noqa: E401, F401
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__}: the Triton 2.51 stub needs numpy 1.x"
server = pathlib.Path(pytriton.__file__).parent / "tritonserver"
py = f"{sys.version_info[0]}.{sys.version_info[1]}"
assert os.access(server / "bin" / "tritonserver", os.X_OK), f"{server}/bin/tritonserver is not executable"
assert (server / "python_backend_stubs" / py / "triton_python_backend_stub").exists(), f"no stub for {py}"
print(f"[offline] ok: numpy {numpy.__version__}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"tritonserver {server}")
EOF
echo "[offline] installed in $(( SECONDS - t0 )) s; run: $VENV/bin/duplex serve --help"
