#!/usr/bin/env bash
# Run here, before a device run of scripts/gpu_check.sh (docs/gpu.md): fills the two ignored folders the
# `run` call carries (`carry: [".gpu", ".whl"]`), since only the repository travels to a device machine.
#   .gpu/oracle/case_a  the oracle case the Triton model tests read (../shared does not travel);
#   .gpu/commit         the commit (and whether the tree was dirty): the device copy has no git history;
#   .whl/               wheels of the packages in scripts/gpu_wheels.txt, for the device's Python 3.12 on
#                       x86-64 manylinux (gpu_check.sh unpacks them into a private folder there).
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
size_kib=$(du -sk --exclude=.git --exclude=.venv . | cut -f1)
echo "ready: .gpu ($(du -sh .gpu | cut -f1)), .whl (${#WHEELS[@]} wheels, $(du -sh .whl | cut -f1));" \
  "repository + carried folders ~$((size_kib / 1024)) MiB of the 64 MiB a device call may send"
if ((size_kib > 60 * 1024)); then echo "WARNING: over 60 MiB: carry less" >&2; exit 1; fi
