#!/usr/bin/env bash
# Set up the venv (idempotent) and run the demo: all nodes in one process around the trained demo model,
# plus the MuJoCo robot with cameras, closing the loop. Ctrl-C stops it. Extra arguments go to
# oxygen_bringup (e.g. --duration 20).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# shellcheck disable=SC1091
. .venv/bin/activate
exec oxygen_bringup --demo "$@"
