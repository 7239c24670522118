#!/usr/bin/env bash
# Run before scripts/gpu_check.sh (docs/gpu.md), where the oracle cases and git are: fills two ignored
# folders, to be copied along with the checkout to a GPU machine that has neither (or no network).
#   .gpu/oracle/case_a  the oracle case the Triton model tests read (from ../shared/oracle);
#   .gpu/commit         the commit (and whether the tree was dirty), for a copy without git history;
#   .whl/               wheels of the packages in scripts/gpu_wheels.txt, for Python 3.12 on x86-64
#                       manylinux (gpu_check.sh unpacks them into a private folder there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SHARED="${SHARED:-$ROOT/../shared}"

rm -rf .gpu .whl
mkdir -p .gpu/oracle .whl
cp -r "$SHARED/oracle/case_a" .gpu/oracle/
chmod -R u+w .gpu
{ git rev-parse HEAD; git diff --quiet HEAD && echo clean || echo "dirty (uncommitted changes)"; } > .gpu/commit

mapfile -t WHEELS < <(grep -vE '^\s*(#|$)' scripts/gpu_wheels.txt || true)
if ((${#WHEELS[@]})); then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
fi
echo "ready: .gpu ($(du -sh .gpu | cut -f1)), .whl (${#WHEELS[@]} wheels, $(du -sh .whl | cut -f1))"
