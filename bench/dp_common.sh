# Sourced by bench/ddp.sh and bench/zero.sh: builds, makes $work with a random token file
# for the benchmark GPT-2 (vocab 8192), and defines the options every data-parallel run
# of the benchmark shares ($dp_opts: global batch 8 x 256 tokens, 4 sequences per rank,
# one thread per rank, steps+2 steps of which the first two are warm-up).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=5
[ "${1:-}" = "--steps" ] && steps=$2
bash scripts/setup.sh
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
