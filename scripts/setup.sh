#!/usr/bin/env bash
# Installs the Debian packages meshtrain builds and tests with, then configures and builds
# it in build/. Safe to run again: it installs only what is missing and rebuilds what changed.
#
#   bash scripts/setup.sh               everything: the tests' and benchmarks' packages too
#                                       (python3-torch, python3-numpy), every target
#   bash scripts/setup.sh --train-only  what training needs, and only the meshtrain program
#
# MESHTRAIN_CMAKE_ARGS: more CMake options, separated by spaces, given after the script's own
# (-DCMAKE_BUILD_TYPE=Release), e.g. MESHTRAIN_CMAKE_ARGS=-DMESHTRAIN_CUDA=OFF to leave out
# the CUDA backend where a CUDA toolkit is installed but cannot build it.
set -euo pipefail
cd "$(dirname "$0")/.."

train_only=false
case "$*" in
  "") ;;
  --train-only) train_only=true ;;
  *) echo "setup: unknown options: $* (the one option is --train-only)" >&2; exit 2 ;;
esac

packages=(build-essential cmake pkg-config libopenblas-openmp-dev libopenmpi-dev openmpi-bin
          libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libsentencepiece-dev libgtest-dev procps)
$train_only || packages+=(python3-torch python3-numpy)  # the parity tests and benchmarks
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  if [ "$(id -u)" -eq 0 ]; then
    as_root=(env)
  elif command -v sudo > /dev/null; then
    as_root=(sudo)  # sudo VAR=value: sudo's env_reset would drop a variable set before it
  else
    echo "setup: these packages must be installed as root, and sudo is not installed:" \
         "run this as root, or install sudo (as root: apt-get install sudo; adduser $(id -un) sudo)" >&2
    exit 1
  fi
  "${as_root[@]}" apt-get update -q
  "${as_root[@]}" DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

read -r -a cmake_args <<< "${MESHTRAIN_CMAKE_ARGS:-}"
if $train_only; then
  build_args=(--target meshtrain) what="meshtrain"
else
  build_args=() what="meshtrain, its tests and benchmarks"
fi
echo "setup: building $what into build/ (the first build takes several minutes; log in build.log)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cmake_args[@]}" > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j "$(nproc)" "${build_args[@]}" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
