#!/usr/bin/env bash
# Set up (or bring up to date) the project's virtual environment in .venv. Idempotent and fast when
# nothing changed: pip runs only when requirements.txt changed, the interface package is rebuilt only
# when its sources changed, the editable install only when setup.py changed.
#   OXYGEN_TORCH=skip   keep the torch already in .venv (a GPU robot's CUDA build) instead of the pin.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"

if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMPS=.venv/.oxygen_stamps
mkdir -p "$STAMPS"

fingerprint() { cat "$@" | sha256sum | cut -d' ' -f1; }

REQ_HASH="$(fingerprint requirements.txt requirements-nodeps.txt)${OXYGEN_TORCH:-}"
if [[ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$REQ_HASH" ]]; then
  echo "[setup] installing requirements (pinned torch==2.13.0: a bare 'torch' would pull a multi-GB CUDA build)"
  python -m pip install -q --upgrade pip wheel setuptools
  if [[ "${OXYGEN_TORCH:-}" == "skip" ]]; then
    grep -vE '^(torch|triton)==' requirements.txt > "$STAMPS/requirements-notorch.txt"
    python -m pip install -q -r "$STAMPS/requirements-notorch.txt"
  else
    python -m pip install -q -r requirements.txt
  fi
  python -m pip install -q --no-deps -r requirements-nodeps.txt
  echo "$REQ_HASH" > "$STAMPS/requirements"
fi

bash scripts/build_interfaces.sh

# The console's browser test drives a real headless Chromium (Debian packages; CI runs as root on Debian).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    echo "[setup] installing chromium and chromium-driver (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "[setup] chromium/chromedriver missing: the console browser test will fail (apt-get install chromium chromium-driver)"
  fi
fi

PKG_HASH="$(fingerprint setup.py setup.cfg package.xml)"
if [[ "$(cat "$STAMPS/package" 2>/dev/null)" != "$PKG_HASH" ]] || ! python -c "import oxygen_ros.kernels" 2>/dev/null; then
  echo "[setup] installing oxygen_ros (editable)"
  python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$PKG_HASH" > "$STAMPS/package"
fi
echo "[setup] ready: . .venv/bin/activate"
