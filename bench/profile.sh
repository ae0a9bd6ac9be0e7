#!/usr/bin/env bash
# The profiler's cost: the benchmark GPT-2 (configs/gpt2_bench.toml, 8 sequences of 256
# tokens per step) trained with logging.profile off and on, alternately, `rounds` times
# each; reports the median step time of each (the first step of every run left out) and
# prints the last profiled run's table.
#
#   bash bench/profile.sh [--threads N] [--steps K] [--rounds R]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) steps=6 rounds=3
while (($#)); do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
/usr/bin/python3 - "$dir/tokens.bin" <<'PY'
import random, struct, sys
n = 400000
random.seed(1)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *[random.randrange(8192) for _ in range(n)]))
PY
export OMP_NUM_THREADS=$threads
common=(--config configs/gpt2_bench.toml --data.path="$dir/tokens.bin" --training.steps="$steps"
        --training.global_batch=8 --training.val_every=0 --checkpoint.dir= --logging.progress=off)
for r in $(seq "$rounds"); do
  for p in false true; do
    ./build/meshtrain train "${common[@]}" --logging.profile=$p --logging.metrics="$dir/$p-$r.jsonl" > "$dir/$p.out"
  done
done
/usr/bin/python3 - "$dir" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def steps(p):
    ms = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{d}/{p}-{r}.jsonl")]
        ms += [l["step_ms"] for l in lines if "event" not in l][1:]
    return statistics.median(ms)
off, on = steps("false"), steps("true")
print(f"step time, median of {rounds} runs each: profile off {off:.1f} ms, on {on:.1f} ms ({100 * (on / off - 1):+.1f}%)")
PY
grep -A200 "^profile:" "$dir/true.out" | sed '/^---/,$d'
