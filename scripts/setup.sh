#!/usr/bin/env bash
# Set up (or bring up to date) the project's virtual environment in .venv: the pinned requirements
# (requirements.txt: requirements-python.txt plus colcon and ROS 2 Kilted from PyPI), the oxygen_interfaces
# package built into it, this package in editable mode. Idempotent and fast when nothing changed: pip runs
# only when a requirements file or OXYGEN_TORCH changed, the interface package is rebuilt only when its
# sources changed, the editable install only when setup.py changed. Each step prints its progress.
#   PYTHON=python3.12  the interpreter of a new .venv: Python 3.10, 3.11 or 3.12 (default python3)
#   OXYGEN_TORCH       which torch 2.13.0 build, printed with the reason:
#     auto (default)   keep the torch 2.13.0 in .venv, else cuda where an NVIDIA GPU answers nvidia-smi,
#                      else cpu
#     cpu              the CPU build: a torch 2.13.0 wheel pip finds without an index (pip's find-links),
#                      else PyTorch's CPU index (OXYGEN_TORCH_CPU_INDEX, default https://download.pytorch.org/whl/cpu)
#     cuda             PyPI's build, the CUDA one (about 2.7 GB with its NVIDIA wheels)
#     skip             keep whatever torch .venv has (a robot's own build); install neither torch nor triton
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PROGRESS_TAG=setup
# shellcheck source=scripts/progress.sh
. scripts/progress.sh

PYTHON_GIVEN="${PYTHON:-}"
PYTHON="${PYTHON:-python3}"
TORCH_MODE="${OXYGEN_TORCH:-auto}"
CPU_INDEX="${OXYGEN_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
TORCH_VERSION="$(sed -nE 's/^torch==([^ ;#]+).*/\1/p' requirements-python.txt)"
LOGS=.venv/.oxygen_stamps/logs
export PIP_PROGRESS_BAR=off     # the logs get pip's lines, not its progress bars

case "$TORCH_MODE" in
  auto | cpu | cuda | skip) ;;
  *) say "error: OXYGEN_TORCH=$TORCH_MODE: expected auto, cpu, cuda or skip" >&2; exit 2 ;;
esac

python_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

if [[ ! -x .venv/bin/python ]]; then
  version="$(python_version "$PYTHON")" || { say "error: PYTHON=$PYTHON: no such interpreter" >&2; exit 2; }
  case "$version" in
    3.10 | 3.11 | 3.12) ;;
    *) say "error: PYTHON=$PYTHON is Python $version; the pins are for Python 3.10, 3.11 and 3.12 (e.g. PYTHON=python3.12)" >&2; exit 2 ;;
  esac
  say "creating .venv with Python $version ($PYTHON)"
  "$PYTHON" -m venv .venv 2>/dev/null || {
    rm -rf .venv
    say "error: '$PYTHON -m venv' failed: on Debian/Ubuntu install python$version-venv (apt)" >&2
    exit 2
  }
elif [[ -n "$PYTHON_GIVEN" && "$(python_version "$PYTHON")" != "$(python_version .venv/bin/python)" ]]; then
  say "error: .venv has Python $(python_version .venv/bin/python), PYTHON=$PYTHON asks for another: remove .venv to recreate it" >&2
  exit 2
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMPS=.venv/.oxygen_stamps
mkdir -p "$STAMPS"

fingerprint() { cat "$@" | sha256sum | cut -d' ' -f1; }

# pip_step LABEL NAME ARGS...: pip ARGS with progress, its output in $LOGS/NAME.log; a failure is explained
# in a few lines.
pip_step() {
  local label="$1" log="$LOGS/$2.log"
  shift 2
  run_step "$label" "$log" python -m pip "$@" || {
    explain_pip_failure "$label" "$log" >&2
    exit 1
  }
}

# The installed torch's version ("2.13.0+cpu"), empty without one.
installed_torch() {
  python -c 'from importlib.metadata import version
try: print(version("torch"))
except Exception: pass'
}
# The build of a torch version: its local label (+cpu, +cu128), or "cuda" for PyPI's unlabelled Linux build.
torch_build() { [[ "$1" == *+* ]] && echo "${1#*+}" || echo cuda; }
has_nvidia_gpu() { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

# Decide what to do about torch, print it with the reason, and install the CPU build when that is the choice
# (the CUDA build comes from PyPI with the other requirements).
torch_step() {
  local have choice reason
  have="$(installed_torch)"
  case "$TORCH_MODE" in
    skip)
      if [[ -n "$have" ]]; then
        say "torch: keeping the torch $have in .venv (OXYGEN_TORCH=skip)"
      else
        say "warning: OXYGEN_TORCH=skip and .venv has no torch: install your torch $TORCH_VERSION build into .venv before running the model"
      fi
      return ;;
    auto)
      if [[ "${have%%+*}" == "$TORCH_VERSION" ]]; then
        say "torch: keeping the torch $have in .venv (OXYGEN_TORCH=auto; cpu or cuda replaces it)"
        return
      elif has_nvidia_gpu; then
        choice=cuda reason="an NVIDIA GPU answers nvidia-smi"
      else
        choice=cpu reason="no NVIDIA GPU answers nvidia-smi"
      fi ;;
    *) choice="$TORCH_MODE" reason="OXYGEN_TORCH=$TORCH_MODE" ;;
  esac
  if [[ "${have%%+*}" == "$TORCH_VERSION" && "$(torch_build "$have")" == "$choice" ]]; then
    say "torch: keeping the torch $have in .venv ($reason)"
    return
  fi
  if [[ -n "$have" ]]; then
    pip_step "torch: removing the torch $have in .venv for the $choice build" torch-uninstall uninstall -y torch
  fi
  if [[ "$choice" == cuda ]]; then
    say "torch: $TORCH_VERSION, PyPI's CUDA build ($reason): about 2.7 GB to download with its NVIDIA wheels"
    return
  fi
  # The CPU build alone (--no-deps); its dependencies come from PyPI with the other requirements.
  if run_step "torch: $TORCH_VERSION, the CPU build ($reason): looking for a wheel pip finds without an index" \
    "$LOGS/torch-local.log" python -m pip install --no-index --no-deps "torch==$TORCH_VERSION"; then
    return
  fi
  say "  none; from PyTorch's CPU index $CPU_INDEX (about 190 MB)"
  run_step "torch: downloading $TORCH_VERSION (CPU build)" "$LOGS/torch-cpu.log" \
    python -m pip install --no-deps --index-url "$CPU_INDEX" "torch==$TORCH_VERSION" || {
    explain_pip_failure "torch $TORCH_VERSION from PyTorch's CPU index" "$LOGS/torch-cpu.log" >&2
    say "  Or: OXYGEN_TORCH=cuda (PyPI's CUDA build, ~2.7 GB), or install torch $TORCH_VERSION into .venv yourself and run OXYGEN_TORCH=skip $0" >&2
    exit 1
  }
}

REQ_HASH="$(fingerprint requirements.txt requirements-python.txt requirements-nodeps.txt)$TORCH_MODE"
if [[ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$REQ_HASH" ]]; then
  pip_step "upgrading pip, setuptools and wheel" pip install --upgrade pip setuptools wheel
  torch_step
  if [[ "$TORCH_MODE" == skip ]]; then
    # requirements.txt without torch and triton (the robot's torch brings the triton it needs).
    { grep -vE '^-r ' requirements.txt; grep -vE '^(torch|triton)==' requirements-python.txt; } > "$STAMPS/requirements-notorch.txt"
    pip_step "installing the requirements but torch and triton (requirements.txt)" requirements install -r "$STAMPS/requirements-notorch.txt"
  else
    pip_step "installing the requirements (requirements.txt)" requirements install -r requirements.txt
  fi
  pip_step "installing requirements-nodeps.txt (without their dependency pins)" nodeps install --no-deps -r requirements-nodeps.txt
  echo "$REQ_HASH" > "$STAMPS/requirements"
else
  say "requirements up to date (torch $(installed_torch || true))"
fi

bash scripts/build_interfaces.sh

PKG_HASH="$(fingerprint setup.py setup.cfg package.xml)"
if [[ "$(cat "$STAMPS/package" 2>/dev/null)" != "$PKG_HASH" ]] \
  || ! python -c "import importlib.util as u; assert u.find_spec('oxygen_ros.kernels')" 2>/dev/null; then
  pip_step "installing oxygen_ros (editable)" package install --no-deps --no-build-isolation -e .
  echo "$PKG_HASH" > "$STAMPS/package"
fi
say "ready: . .venv/bin/activate"
