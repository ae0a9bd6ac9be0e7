#!/usr/bin/env bash
# Builds meshtrain (installing what is missing; the first build takes several minutes) and
# runs `meshtrain train` with the given options; with none it trains the default model on the
# built-in tasks (about a minute on 2 cores). Only what training needs: no PyTorch, no tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --train-only
exec ./build/meshtrain train "$@"
