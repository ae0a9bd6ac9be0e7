#!/usr/bin/env bash
# On the GPU machine: build (scripts/gpu_build.sh), run every CUDA test program, then the
# GPT-2 benchmark beside PyTorch (bench/gpu.sh). Logs go to $OUT (or ./gpu-check) so that
# they survive the machine.
#
#   bash scripts/gpu_check.sh [tests|bench|all]     # default all
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
targets="meshtrain bench_gpu_step $(cd tests && ls test_cuda_*.cpp | sed 's/\.cpp$//' | tr '\n' ' ')"
if ! GPU_BUILD_TARGETS="$targets" bash scripts/gpu_build.sh build-gpu > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
status=0
if [[ $what == tests || $what == all ]]; then
  for t in build-gpu/tests/test_cuda_*; do
    name=$(basename "$t")
    if "$t" --gtest_brief=1 > "$out/$name.log" 2>&1; then
      echo "$name: $(grep -E '^\[  PASSED  \]' "$out/$name.log")"
    else
      status=1
      echo "$name: FAILED"
      grep -E "Failure|error|Expected|Which is|actual|got|FAILED|mt::Error|what\(\)" "$out/$name.log" | head -40
    fi
  done
fi
if [[ $what == bench || $what == all ]]; then
  bash bench/gpu.sh build-gpu 2>&1 | tee "$out/bench.log" | tail -8
fi
exit $status
