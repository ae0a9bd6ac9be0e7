#!/usr/bin/env bash
# Builds meshtrain (installing what is missing) and runs `meshtrain train` with the given
# options; with none it trains the default model on the built-in tasks (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ./build/meshtrain train "$@"
