#!/usr/bin/env bash
# Fetches, on a Debian machine with network, the Debian packages that a GPU machine without
# network lacks for building meshtrain (toml++ and SentencePiece; it has CMake, nvcc, the
# CUDA libraries, OpenMPI, OpenBLAS, GoogleTest and nlohmann-json), into .gpudeps/ (ignored
# by git). Carry .gpudeps to the GPU machine and run scripts/gpu_build.sh there.
#
#   bash scripts/gpu_deps.sh            # here
#   bash scripts/gpu_build.sh           # there: builds into build-gpu/
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpudeps/debs
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpudeps/' "$exclude" 2>/dev/null || echo '/.gpudeps/' >> "$exclude"
cd .gpudeps/debs
apt-get download libtomlplusplus-dev libtomlplusplus3 libsentencepiece-dev libsentencepiece0 >/dev/null
ls -1 *.deb
