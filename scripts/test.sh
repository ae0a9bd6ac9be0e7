#!/usr/bin/env bash
# Builds meshtrain and its tests (installing what is missing, PyTorch for the parity tests
# included) and runs the whole test suite through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cd build && ctest --output-on-failure -j 2 --timeout 600
