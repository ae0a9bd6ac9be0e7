# Sourced by bench/ddp.sh and bench/zero.sh: builds, makes $work with a random token file
# for the benchmark GPT-2 (vocab 8192), and defines the options every data-parallel run
# of the benchmark shares ($dp_opts: global batch 8 x 256 tokens, 4 sequences per rank,
# one thread per rank, steps+2 steps of which the first two are warm-up), and blas_info,
# which prints the OpenBLAS build, kernel set and threads meshtrain runs with here.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=5
[ "${1:-}" = "--steps" ] && steps=$2
bash scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/same_kernels.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$work/tokens.bin" <<'PY'
import sys, os
sys.path.insert(0, os.path.join("tests", "parity"))
import numpy as np, st
st.write_tokens(sys.argv[1], np.random.RandomState(0).randint(0, 8192, size=200000))
PY
export OMP_NUM_THREADS=1
dp_opts=(--config configs/gpt2_bench.toml --data.path="$work/tokens.bin" --training.steps=$((steps + 2))
         --training.global_batch=8 --training.micro_batch=4 --training.val_every=0 --optim.warmup_steps=0
         --checkpoint.dir= --logging.progress=off --logging.plot= --training.threads=1)

blas_info() {  # the OpenBLAS that build/meshtrain loads, asked under this environment
  local lib
  lib=$(ldd build/meshtrain | awk '/libopenblas/ {print $3}')
  /usr/bin/python3 - "$lib" <<'PY'
import ctypes, os, sys
blas = ctypes.CDLL(sys.argv[1])
blas.openblas_get_corename.restype = blas.openblas_get_config.restype = ctypes.c_char_p
print(f"meshtrain BLAS: {blas.openblas_get_config().decode()}; kernels {blas.openblas_get_corename().decode()} "
      f"(OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset: detected')}), "
      f"{blas.openblas_get_num_threads()} thread(s) per rank")
PY
}
