#!/usr/bin/env bash
# bf16 training on the CPU: one training step of the benchmark GPT-2 (bench/core.sh's: 6
# layers, d_model 384, 6 heads, seq_len 256, vocab 8192, 8 sequences) in meshtrain at fp32,
# at bf16 with its products on the CPU's bf16 instructions (ops/gemm_bf16.h, where the CPU
# has AVX512_BF16), and at bf16 with them off (MESHTRAIN_CPU_BF16=off: fp32 products of
# rounded operands), beside PyTorch CPU eager in fp32 and under bf16 autocast, same threads,
# in one invocation. meshtrain's step time is the median of `meshtrain train`'s step_ms
# over the timed steps (the first two are warm-up), on the built-in tasks' tokens.
#
#   bash bench/bf16.sh [--threads N] [--steps K] [--model gpt2|llama]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/step_options.sh "$@"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mt() {  # name, precision, extra environment
  env $3 ./build/meshtrain train --model.family="$model" --model.n_layer=6 --model.d_model=384 --model.n_head=6 \
    --model.seq_len=256 --model.vocab_size=8192 --training.global_batch=8 --training.micro_batch=8 \
    --training.steps=$((steps + 2)) --training.val_every=0 --training.precision="$2" --logging.progress=off \
    --logging.plot= --logging.metrics="$dir/$1.jsonl" --checkpoint.dir="$dir/ck_$1" > "$dir/$1.log"
}
mt fp32 fp32 ""
mt bf16 bf16 ""
mt bf16_off bf16 "MESHTRAIN_CPU_BF16=off"
pt32=$(/usr/bin/python3 bench/torch_step.py --model "$model" --threads "$threads" --steps "$steps")
pt16=$(/usr/bin/python3 bench/torch_step.py --model "$model" --threads "$threads" --steps "$steps" --autocast)
/usr/bin/python3 - "$dir" "$pt32" "$pt16" <<'PY'
import json, statistics, sys
d, pt32, pt16 = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
def step_ms(name):
    rows = [json.loads(l) for l in open(f"{d}/{name}.jsonl") if '"step_ms"' in l and '"event"' not in l]
    return statistics.median(r["step_ms"] for r in rows[2:])
flops = pt32["flops_per_step"]  # bench/torch_step.py documents the count
kernel = next((l.split("bf16 products: ")[1].strip() for l in open(f"{d}/bf16.log") if "bf16 products: " in l), "?")
rows = [("meshtrain fp32", step_ms("fp32")), ("meshtrain bf16", step_ms("bf16")),
        ("meshtrain bf16, MESHTRAIN_CPU_BF16=off", step_ms("bf16_off")),
        ("pytorch fp32", pt32["step_ms_median"]), ("pytorch bf16 autocast", pt16["step_ms_median"])]
print(f"{pt32['model']} step, {pt32['threads']} threads, {flops / 1e9:.1f} GFLOP per step; "
      f"meshtrain's bf16 products: {kernel}; BLAS {pt32['blas']}")
for name, ms in rows:
    print(f"  {name:40s} {ms:8.1f} ms  {flops / (ms / 1000) / 1e9:7.1f} GFLOP/s")
print(f"meshtrain bf16: {rows[0][1] / rows[1][1]:.2f}x as fast as its fp32 step, "
      f"{rows[2][1] / rows[1][1]:.2f}x as fast as with MESHTRAIN_CPU_BF16=off, "
      f"{rows[4][1] / rows[1][1]:.2f}x as fast as pytorch bf16 autocast")
PY
