#!/usr/bin/env bash
# The core engine benchmark: one training step (forward, backward, clip, AdamW) of the
# benchmark GPT-2 (6 layers, d_model 384, 6 heads, seq_len 256, vocab 8192, 8 sequences)
# in meshtrain and in PyTorch CPU eager, same threads, side by side in one invocation.
#
#   bash bench/core.sh [--threads N] [--steps K] [--model gpt2|llama]
# Target: meshtrain's step at most 0.6x PyTorch's.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) steps=5 model=gpt2
while (($#)); do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
export OMP_NUM_THREADS=$threads
mt=$(./build/bench/bench_step --family "$model" --threads "$threads" --steps "$steps")
pt=$(/usr/bin/python3 bench/torch_step.py --model "$model" --threads "$threads" --steps "$steps")
/usr/bin/python3 - "$mt" "$pt" <<'PY'
import json, sys
m, p = json.loads(sys.argv[1]), json.loads(sys.argv[2])
flops = p["flops_per_step"]  # one FLOP count for both (bench/torch_step.py documents it)
def row(name, d):
    gf = flops / (d["step_ms_median"] / 1000) / 1e9
    print(f"  {name:10s} median {d['step_ms_median']:9.1f} ms   min {d['step_ms_min']:9.1f} ms   {gf:7.1f} GFLOP/s "
          f"({100 * gf / m['sgemm_gflops']:.0f}% of sgemm)")
print(f"{m['family']} step, {m['threads']} threads, {flops / 1e9:.1f} GFLOP per step; "
      f"machine sgemm rate {m['sgemm_gflops']:.1f} GFLOP/s")
row("meshtrain", m)
row("pytorch", p)
ratio = m["step_ms_median"] / p["step_ms_median"]
print(f"ratio meshtrain / pytorch = {ratio:.2f}  (target <= 0.60: {'met' if ratio <= 0.6 else 'NOT met'})")
print(f"meshtrain peak memory {m['peak_bytes'] / 2**20:.0f} MiB")
PY
