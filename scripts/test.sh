#!/usr/bin/env bash
# Set up the venv (idempotent) and run the whole test suite. CI (.ci/run) runs exactly this.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m pytest -q -ra test/ "$@"
