#!/usr/bin/env bash
# Set up the venv (idempotent) and run the whole test suite. CI (.ci/run) runs exactly this.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PROGRESS_TAG=test
# shellcheck source=scripts/progress.sh
. scripts/progress.sh

# The console's browser test (test_console.py) drives a real headless Chromium: Debian's packages, installed
# here when missing and this runs as root with apt (as CI does); otherwise that one test fails and says so.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    run_step "installing chromium and chromium-driver (apt) for the console's browser test" .venv/.oxygen_stamps/logs/chromium.log \
      bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver' || {
      say "warning: apt-get could not install chromium (log: .venv/.oxygen_stamps/logs/chromium.log): the console's browser test will fail"
    }
  else
    say "warning: chromium/chromedriver missing: the console's browser test will fail (apt-get install chromium chromium-driver)"
  fi
fi

# shellcheck disable=SC1091
. .venv/bin/activate
# One worker per core, at most 4 (pytest-xdist); a test file stays in one worker (its module fixtures, e.g. one
# bringup, are built once). The slowest files start first (test/conftest.py); the slowest tests are listed at
# the end. OXYGEN_TEST_WORKERS=1 runs the suite in one process.
workers="${OXYGEN_TEST_WORKERS:-$(python -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')}"
exec python -m pytest -q -ra -n "$workers" --dist loadfile --durations=25 test/ "$@"
