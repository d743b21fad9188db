#!/usr/bin/env bash
# Installs everything `make run` / `make test` need, pinned, and nothing twice.
#   Debian packages from requirements/apt.txt (only the missing ones),
#   a venv at $1 (default .venv) with requirements/base.txt, then requirements/nodeps.txt with --no-deps,
#   then this project itself (editable, no deps) so the `duplex` console script exists.
# A stamp in the venv holds the hash of every input; when it matches, nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
STAMP="$VENV/.duplex-install-stamp"

apt_missing() {
  local pkg
  while read -r pkg; do
    [[ -z "$pkg" || "$pkg" == \#* ]] && continue
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
  done < requirements/apt.txt
}

missing="$(apt_missing | tr '\n' ' ')"
if [[ -n "${missing// /}" ]]; then
  echo "[install] Debian packages missing: $missing"
  SUDO=""
  if [[ "$(id -u)" != "0" ]]; then
    command -v sudo >/dev/null || { echo "[install] need root or sudo to apt-get install: $missing" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

inputs_hash="$(cat requirements/base.txt requirements/nodeps.txt requirements/apt.txt scripts/install.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$inputs_hash" ]]; then
  echo "[install] $VENV is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON="${PYTHON:-}"
  if [[ -z "$PYTHON" ]]; then
    for cand in python3.11 python3; do
      if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        PYTHON="$cand"; break
      fi
    done
  fi
  [[ -n "$PYTHON" ]] || { echo "[install] Python 3.11 not found (the Triton Python backend stub is built for 3.11)" >&2; exit 1; }
  echo "[install] creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "[install] pip install -r requirements/base.txt (first time: a few minutes)"
"${PIP[@]}" install -q -r requirements/base.txt
"${PIP[@]}" install -q --no-deps -r requirements/nodeps.txt
"${PIP[@]}" install -q --no-deps -e .
# A CUDA torch would be several GB and useless on these machines: fail loudly if one slipped in.
"$VENV/bin/python" -c 'import torch, sys; sys.exit(f"torch {torch.__version__} is a CUDA build" if torch.version.cuda else 0)'
echo "$inputs_hash" > "$STAMP"
echo "[install] done"
