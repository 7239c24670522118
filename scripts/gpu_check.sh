#!/usr/bin/env bash
# The prepared GPU check: one command on a machine with an NVIDIA GPU whose python3 has torch + triton
# (checked with Python 3.12, torch 2.11, triton 3.6; no ROS, no network needed). It installs
# nothing into that python: the package is staged in a temporary folder (kernels/ placed as
# oxygen_ros/kernels), so no pip/setuptools version matters. Wheels carried in .whl/ are unpacked into a
# private site folder first. docs/gpu.md has the exact call and what to do with the results.
#
# Steps, in order of value (each has its own time limit; a failing step does not stop the next one; the
# whole run stops starting steps past GPU_CHECK_BUDGET_S, default 330 s, so it ends inside its caller's
# timeout and still writes its summary):
#   kernel_tests      the Triton kernel tests compiled on the GPU (incl. bf16 end to end and the oracle case
#                     through the Triton backend when .gpu/oracle or ../shared/oracle is there) and the
#                     fixed-shape step tests, which capture real CUDA graphs there;
#   microbench        each Triton kernel against torch SDPA / eager at pi0.5 size in bf16;
#   bench             the side-by-side benchmark (isolated, shared_kv, oxygen) at full pi0.5 size with
#                     random bf16 weights at the paper's workload, with CUDA graphs;
#   bench_eager       oxygen alone without CUDA graphs (what the graphs buy);
#   fleet             issue #17's fleet benchmark at full size: N = 1, 2, 4 robots on one engine vs N
#                     single-robot engines (runs last: only if the budget has room left).
# The random weights are built once on the CPU (a float64 RNG: the slow part), in the background while the
# kernel steps run, and saved for both benches.
#
# Results, all under $OUT (default ./gpu_out; 6 files):
#   summary.json  environment (GPU, driver, versions, date) + each step's exit code, seconds and log tail,
#                 rewritten after every step; steps.log  every step's full output;
#   microbench.json, bench_<preset>.json, bench_<preset>_eager.json, fleet_<preset>.json.
#
# Knobs (environment): GPU_CHECK_STEPS=kernel_tests,microbench,bench,bench_eager,fleet (a rerun of some only),
# GPU_CHECK_BUDGET_S, GPU_CHECK_DEVICE=cpu (rehearsal on a machine without a GPU: kernels through the
# Triton interpreter, the `tiny` preset, microbench --cpu-smoke), GPU_CHECK_PRESET, GPU_CHECK_PYTEST_ARGS
# (extra pytest arguments, e.g. -k to select), PYTHON (default python3).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)"
PY="${PYTHON:-python3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
BUDGET="${GPU_CHECK_BUDGET_S:-330}"
STEPS=",${GPU_CHECK_STEPS:-kernel_tests,microbench,bench,bench_eager,fleet},"
if [[ "$DEVICE" == cuda ]]; then PRESET="${GPU_CHECK_PRESET:-pi05}"; else PRESET="${GPU_CHECK_PRESET:-tiny}"; fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/oxygen_gpu_check.XXXXXX")"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TRITON_CACHE_DIR="$WORK/triton_cache"
: > "$OUT/steps.log"
: > "$WORK/steps.tsv"

# Carried wheels (scripts/gpu_prepare.sh fills .whl/ from scripts/gpu_wheels.txt): into a private site
# folder, never into the image's python.
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$ROOT"/.whl/*.whl >> "$OUT/steps.log" 2>&1 || echo "installing .whl/ failed (see steps.log)"
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# Stage the package: the repository's layout with kernels/ where the installed package has it. Tests find
# the oracle cases at <stage>/../shared/oracle: the checkout's ../shared, or .gpu/oracle carried by
# scripts/gpu_prepare.sh (for a GPU machine that has the checkout only).
STAGE="$WORK/src"
mkdir -p "$STAGE" "$WORK/shared"
cp -r "$ROOT/oxygen_ros" "$ROOT/test" "$STAGE/"
cp -r "$ROOT/kernels" "$STAGE/oxygen_ros/kernels"
for oracle in "$ROOT/.gpu/oracle" "$ROOT/../shared/oracle"; do
  if [[ -d "$oracle" ]]; then ln -s "$oracle" "$WORK/shared/oracle"; break; fi
done
[[ -e "$WORK/shared/oracle" ]] || echo "WARNING: no oracle cases (.gpu/oracle: run scripts/gpu_prepare.sh and copy .gpu along):" \
  "the oracle tests of kernel_tests will fail" | tee -a "$OUT/steps.log"
cd "$STAGE"

summary() {
  "$PY" "$ROOT/scripts/gpu_check_summary.py" --out "$OUT" --steps "$WORK/steps.tsv" --logs "$WORK" \
    --device "$DEVICE" --root "$ROOT" || echo "summary.json could not be written"
}

want() { [[ "$STEPS" == *",$1,"* ]]; }

record() {  # name, exit code, seconds, limit, command (for the log)
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$WORK/steps.tsv"
  { echo "===== $1: exit $2 after $3 s (limit $4 s): $5"; cat "$WORK/$1.log"; } >> "$OUT/steps.log"
  echo "$1: exit $2 after $3 s (limit $4 s)"
  summary
}

limit_for() {  # a step's own limit, cut to what is left of the budget; fails when too little is left
  local left=$((BUDGET - SECONDS))
  if ((left < 20)); then
    printf '%s\tskipped\t0\t0\n' "$2" >> "$WORK/steps.tsv"
    echo "$2: skipped (GPU_CHECK_BUDGET_S=$BUDGET spent)" >&2
    summary >&2
    return 1
  fi
  echo $(($1 < left ? $1 : left))
}

step() {  # name, limit in seconds, command...
  local name=$1 limit
  limit=$(limit_for "$2" "$name") || return 0
  shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  record "$name" $? $((SECONDS - t0)) "$limit" "$*"
}

summary   # the environment alone, before anything can hang
if [[ "$DEVICE" == cuda ]]; then
  nvidia-smi >> "$OUT/steps.log" 2>&1
  KERNEL_ENV=(env OXYGEN_KERNEL_TEST_DEVICE=cuda)
  MICRO=()
  BENCH=(--frames 8 --repeat 3 --warmup-frames 2)
  EAGER=(--frames 8 --repeat 1 --warmup-frames 2)
  FLEET=(--frames 4 --repeat 1 --warmup-frames 1 --robots 1,2,4)
else
  KERNEL_ENV=(env)
  MICRO=(--cpu-smoke --quick --reps 1)
  BENCH=(--frames 2 --repeat 1 --warmup-frames 1 --check-frames 1)
  EAGER=(--frames 2 --repeat 1 --warmup-frames 1 --check-frames 0)
  FLEET=(--frames 1 --repeat 1 --warmup-frames 0 --robots 2)
fi
# The benches' weights, built once and saved in openpi layout for both benches (loaded with the shipped small
# tokenizer: random weights have no tokenizer of their own). Building full-size random weights is CPU work
# (a float64 RNG, single-threaded), so it runs in the background while the GPU steps before the benches run.
WEIGHTS="$WORK/weights_$PRESET"
WEIGHTS_CMD=("$PY" -c "
import sys, torch
from oxygen_ros.engine.factory import build_model, model_config
from oxygen_ros.model.checkpoint import save_checkpoint
dtype = torch.bfloat16 if sys.argv[2] == 'cuda' else torch.float32   # what the bench loads them as
print(save_checkpoint(build_model(model_config(sys.argv[1]), device='cpu', dtype=dtype), sys.argv[3]))
" "$PRESET" "$DEVICE" "$WEIGHTS")
WEIGHTS_PID=
if want bench || want bench_eager || want fleet; then
  if WEIGHTS_LIMIT=$(limit_for 240 weights); then
    WEIGHTS_T0=$SECONDS
    (timeout -k 10 "$WEIGHTS_LIMIT" "${WEIGHTS_CMD[@]}" > "$WORK/weights.log" 2>&1
     echo "$? $SECONDS" > "$WORK/weights.done") &
    WEIGHTS_PID=$!
  fi
fi
# Compilation dominates the kernel tests on a GPU: spread them over processes where pytest-xdist exists.
PYTEST_PAR=()
if [[ "$DEVICE" == cuda ]] && "$PY" -c "import xdist" 2> /dev/null; then PYTEST_PAR=(-n 8); fi
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of words on purpose
want kernel_tests && step kernel_tests 150 "${KERNEL_ENV[@]}" "$PY" -m pytest -q -rfEs --durations=8 -p no:cacheprovider \
  "${PYTEST_PAR[@]}" ${GPU_CHECK_PYTEST_ARGS:-} test/test_kernels.py test/test_kernels_model.py test/test_graphs.py
want microbench && step microbench 90 "$PY" -m oxygen_ros.kernels.microbench "${MICRO[@]}" --json "$OUT/microbench.json"

if [[ -n "$WEIGHTS_PID" ]]; then
  wait "$WEIGHTS_PID"
  read -r rc t1 < "$WORK/weights.done"
  record weights "$rc" $((t1 - WEIGHTS_T0)) "$WEIGHTS_LIMIT" "build_model + save_checkpoint ($PRESET, $WEIGHTS)"
fi
TOKENIZER="$STAGE/oxygen_ros/model/assets/tiny_tokenizer.model"
want bench && step bench 180 "$PY" -m oxygen_ros.bench --preset "$PRESET" --device "$DEVICE" --checkpoint "$WEIGHTS" \
  --tokenizer "$TOKENIZER" "${BENCH[@]}" --json "$OUT/bench_$PRESET.json"
want bench_eager && step bench_eager 100 "$PY" -m oxygen_ros.bench --preset "$PRESET" --device "$DEVICE" --checkpoint "$WEIGHTS" \
  --tokenizer "$TOKENIZER" "${EAGER[@]}" --settings oxygen --no-cuda-graphs --json "$OUT/bench_${PRESET}_eager.json"
want fleet && step fleet 90 "$PY" -m oxygen_ros.bench --preset "$PRESET" --device "$DEVICE" --checkpoint "$WEIGHTS" \
  --tokenizer "$TOKENIZER" "${FLEET[@]}" --json "$OUT/fleet_$PRESET.json"

rm -rf "$WORK"
echo "done in $SECONDS s: $OUT/summary.json"
