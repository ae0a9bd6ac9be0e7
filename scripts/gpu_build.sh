#!/usr/bin/env bash
# Builds meshtrain with CUDA on a GPU machine that has CMake, nvcc, the CUDA libraries,
# OpenMPI, OpenBLAS, GoogleTest and nlohmann-json but no network: the packages it lacks
# come as .deb files in .gpudeps/debs (scripts/gpu_deps.sh fetches them on a machine with
# network), unpacked here into .gpudeps/root and found through pkg-config; the programs
# find their libraries through the build tree's RPATH.
#
#   bash scripts/gpu_build.sh [BUILD_DIR] [cmake args...]   # default build-gpu
#   GPU_BUILD_TARGETS="meshtrain bench_gpu_step" bash scripts/gpu_build.sh   # some targets only
# Then: BUILD_DIR/meshtrain train --training.device=cuda ...; BUILD_DIR/tests/test_cuda_*.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
shift || true
root=$PWD/.gpudeps/root
if ls .gpudeps/debs/*.deb >/dev/null 2>&1; then
  mkdir -p "$root"
  for f in .gpudeps/debs/*.deb; do dpkg-deb -x "$f" "$root"; done
  # The packages' pkg-config files name /usr: point them at the unpacked tree.
  for pc in "$root"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
    sed -i "s|^prefix=/usr\$|prefix=$root/usr|" "$pc"
  done
  export PKG_CONFIG_PATH=$root/usr/lib/x86_64-linux-gnu/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
elif ! pkg-config --exists tomlplusplus sentencepiece; then
  echo "gpu_build.sh: toml++ and SentencePiece are missing: run scripts/gpu_deps.sh on a machine with" \
       "network and carry .gpudeps here" >&2
  exit 1
fi
export PATH=/usr/local/cuda/bin:$PATH
# NCCL's header: the toolkit's, else the one in Python's nvidia packages (PyTorch's NCCL).
nccl=()
if [ ! -e /usr/local/cuda/include/nccl.h ]; then
  h=$(python3 -c 'import glob, site, sys
for d in site.getsitepackages():
    for h in glob.glob(d + "/nvidia/**/include/nccl.h", recursive=True): print(h); sys.exit()' 2>/dev/null || true)
  [ -n "$h" ] && nccl=(-DNCCL_ROOT="$(dirname "$(dirname "$h")")")
fi
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMESHTRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${nccl[@]}" "$@" >"$build.cmake.log" 2>&1 ||
  { tail -30 "$build.cmake.log"; exit 1; }
grep -E "^-- (CUDA|NCCL|OpenBLAS)" "$build.cmake.log" || true
targets=()
for t in ${GPU_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
set +o pipefail
cmake --build "$build" -j"$(nproc)" "${targets[@]}" 2>&1 | grep -E "error|Error" | head -40
set -o pipefail
test -x "$build/meshtrain" || { echo "gpu_build.sh: the build failed (see above)" >&2; exit 1; }
echo "built $build/meshtrain"
