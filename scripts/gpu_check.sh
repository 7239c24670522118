#!/usr/bin/env bash
# The prepared GPU check (< 8 minutes on one H200): run it on a machine with an NVIDIA GPU whose python3
# has torch + triton (it installs nothing else; no ROS needed). Everything lands under $OUT (default
# ./gpu_out): nvidia-smi.txt, kernel_tests.log, microbench.json/.log, bench_pi05.json/.log, summary.txt.
#   1. the kernel tests, compiled on the GPU (OXYGEN_KERNEL_TEST_DEVICE=cuda; incl. bf16 end to end), and the
#      fixed-shape step tests, which there capture real CUDA graphs (test/test_graphs.py);
#   2. each Triton kernel against torch SDPA / eager at pi0.5 size in bf16 (kernels/microbench.py);
#   3. the side-by-side benchmark at full pi0.5 size with random bf16 weights: isolated vs shared_kv vs
#      oxygen at the paper's workload (10 denoise steps, 30-token replies, 5 tokens/frame, 1 request/frame),
#      with CUDA graphs; then oxygen alone without them (what the graphs buy).
# Each step has its own time limit; a failing step does not stop the next one.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# kernels/ installs as oxygen_ros.kernels; without pip access an editable install still works offline.
"$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (see install.log)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/summary.txt"

step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
step kernel_tests 120 env OXYGEN_KERNEL_TEST_DEVICE=cuda \
  "$PY" -m pytest -q -p no:cacheprovider test/test_kernels.py test/test_kernels_model.py test/test_graphs.py
step microbench 90 "$PY" -m oxygen_ros.kernels.microbench --json "$OUT/microbench.json"
step bench_pi05 180 "$PY" -m oxygen_ros.bench --preset pi05 --device cuda --frames 8 --repeat 3 \
  --warmup-frames 2 --json "$OUT/bench_pi05.json"
step bench_pi05_eager 80 "$PY" -m oxygen_ros.bench --preset pi05 --device cuda --frames 8 --repeat 1 \
  --warmup-frames 2 --settings oxygen --no-cuda-graphs --json "$OUT/bench_pi05_eager.json"
tail -n 40 "$OUT/bench_pi05.log" >> "$OUT/summary.txt"
tail -n 12 "$OUT/bench_pi05_eager.log" >> "$OUT/summary.txt"
