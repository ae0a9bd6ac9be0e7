#!/usr/bin/env bash
# The core engine benchmark: one training step (forward, backward, clip, AdamW) of the
# benchmark GPT-2 (6 layers, d_model 384, 6 heads, seq_len 256, vocab 8192, 8 sequences)
# in meshtrain and in PyTorch CPU eager, same threads, side by side in one invocation.
#
#   bash bench/core.sh [--threads N] [--steps K] [--model gpt2|llama]
# Both sides run the same OpenBLAS kernel set (OPENBLAS_CORETYPE, or OpenBLAS's choice for
# this CPU), which the report names. "% of sgemm" is against OpenBLAS's own sgemm rate with
# those kernels and threads; the tile grid's rate on the same product is printed beside.
# Targets: meshtrain's step at most 0.6x PyTorch's and at least 85% of the sgemm rate.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/step_options.sh "$@"
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
print(f"{m['family']} step, {m['threads']} threads, {flops / 1e9:.1f} GFLOP per step")
print(f"BLAS: meshtrain {m['blas']}; pytorch {p['blas']} kernels, {p['threads']} threads")
if m["blas_warning"]:
    print("note: " + m["blas_warning"])
print(f"sgemm rate (2048 x 1536 x 384): OpenBLAS threaded {m['sgemm_gflops']:.1f} GFLOP/s, "
      f"meshtrain's tile grid {m['grid_gflops']:.1f} GFLOP/s")
row("meshtrain", m)
row("pytorch", p)
ratio = m["step_ms_median"] / p["step_ms_median"]
rate = flops / (m["step_ms_median"] / 1000) / 1e9
share = rate / m["sgemm_gflops"]
print(f"ratio meshtrain / pytorch = {ratio:.2f}  (target <= 0.60: {'met' if ratio <= 0.6 else 'NOT met'}); "
      f"meshtrain at {100 * share:.0f}% of OpenBLAS's sgemm rate (target >= 85%: {'met' if share >= 0.85 else 'NOT met'}), "
      f"{100 * rate / max(m['sgemm_gflops'], m['grid_gflops']):.0f}% of the best rate measured for that product")
print(f"meshtrain peak memory {m['peak_bytes'] / 2**20:.0f} MiB")
PY
