#!/usr/bin/env bash
# Attention, materialized (keeps att[B, NH, T, T]) against fused (keeps lse[B, NH, T] and
# recomputes the probabilities in backward), side by side in one invocation:
#   (a) the attention op, forward + backward, at T = 256 and 1024, with GPT-2 124M's heads
#       (NH 12, D 64, B 4) and the benchmark GPT-2's (NH 6, D 64, B 8 at T 256, B 2 at 1024);
#   (b) one training step (forward, backward, clip, AdamW; bench_step) of the benchmark GPT-2
#       (configs/gpt2_bench.toml's model) at T = 256 with B = 8 and at T = 1024 with B = 2
#       (the same tokens per step): two runs of each path, alternating, K timed steps each;
#       the median and the fastest of the 2K steps;
#   (c) GPT-2 124M (configs/gpt2_124m.toml) at T = 1024, micro-batch 4, three training
#       steps through `meshtrain train`: the summary's activation peak (mem_activations),
#       the first step's time (it also maps the activation pages) and the mean of the
#       other two.
# It prints the BLAS kernel set and thread counts it ran with; run it again under
# `env -u OPENBLAS_CORETYPE` (or with another OPENBLAS_CORETYPE) to compare kernel sets.
# Targets: (c)'s activation peak drops by at least 2 GB; (b)'s steps are no slower.
#
#   bash bench/attention.sh [--threads N] [--steps K] [--skip-124m]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) steps=5 big=1
while (($#)); do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --skip-124m) big=0; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/same_kernels.sh"
export OMP_NUM_THREADS=$threads
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# (a) the op
for shape in "4 256 12" "4 1024 12" "8 256 6" "2 1024 6"; do
  read -r b t nh <<< "$shape"
  ./build/bench/bench_attention --batch "$b" --seq "$t" --heads "$nh" --head-dim 64 --reps 5 >> "$work/op.jsonl"
done
# (b) the benchmark GPT-2's step, the two paths alternating
for tb in "256 8" "1024 2" "256 8" "1024 2"; do
  read -r t b <<< "$tb"
  for a in materialized fused; do
    ./build/bench/bench_step --threads "$threads" --steps "$steps" --seq-len "$t" --batch "$b" --attention "$a" \
      >> "$work/step.jsonl"
  done
done
# (c) GPT-2 124M through the trainer, on random GPT-2 token ids
if ((big)); then
  /usr/bin/python3 - "$work/tokens.bin" <<'PY'
import sys, os
sys.path.insert(0, os.path.join("tests", "parity"))
import numpy as np, st
st.write_tokens(sys.argv[1], np.random.RandomState(0).randint(0, 50257, size=30000))
PY
  for a in materialized fused; do
    ./build/meshtrain train --config configs/gpt2_124m.toml --data.path="$work/tokens.bin" --training.steps=3 \
      --training.global_batch=4 --training.micro_batch=4 --training.attention=$a --training.val_every=0 \
      --optim.warmup_steps=0 --checkpoint.dir= --logging.progress=off --logging.plot= \
      --logging.metrics="$work/124m_$a.jsonl" --training.threads="$threads" > /dev/null
  done
fi

/usr/bin/python3 - "$work" "$big" <<'PY'
import json, os, statistics, sys
work, big = sys.argv[1], sys.argv[2] == "1"
op = [json.loads(l) for l in open(f"{work}/op.jsonl")]
step = [json.loads(l) for l in open(f"{work}/step.jsonl")]
print(f"attention: materialized vs fused | OpenBLAS kernels {op[0]['blas']}, {op[0]['blas_threads']} BLAS threads, "
      f"{op[0]['omp_threads']} OpenMP threads")
print("(a) attention op, forward + backward (fastest of 5), ms")
print(f"  {'B':>2} {'T':>5} {'NH':>3} {'D':>3} | {'materialized':>21} | {'fused':>21} | fused/mat")
for d in op:
    m = d["materialized_fwd_ms"] + d["materialized_bwd_ms"]
    f = d["fused_fwd_ms"] + d["fused_bwd_ms"]
    print(f"  {d['B']:>2} {d['T']:>5} {d['NH']:>3} {d['D']:>3} | {d['materialized_fwd_ms']:7.2f} + "
          f"{d['materialized_bwd_ms']:7.2f} = {m:7.2f} | {d['fused_fwd_ms']:7.2f} + {d['fused_bwd_ms']:7.2f} = "
          f"{f:7.2f} | {f / m:.2f}")
print("(b) benchmark GPT-2 (6 x 384, vocab 8192) training step, ms: median (fastest)")
ok = True
for t in sorted({d["seq_len"] for d in step}):
    runs = {a: [d for d in step if d["seq_len"] == t and d["attention"] == a] for a in ("materialized", "fused")}
    ms = {a: sorted(x for d in r for x in d["step_ms_all"]) for a, r in runs.items()}
    med = {a: statistics.median(v) for a, v in ms.items()}
    m, f = runs["materialized"][0], runs["fused"][0]
    r = med["fused"] / med["materialized"]
    ok &= r <= 1.0
    print(f"  T {t:>5} B {m['batch']}: materialized {med['materialized']:7.1f} ({ms['materialized'][0]:7.1f})  "
          f"fused {med['fused']:7.1f} ({ms['fused'][0]:7.1f})  fused/mat {r:.3f}  "
          f"| peak memory {m['peak_bytes'] / 2**20:.0f} -> {f['peak_bytes'] / 2**20:.0f} MiB")
print(f"  target fused step <= materialized: {'met' if ok else 'NOT met'}")
if big:
    print("(c) GPT-2 124M, T 1024, micro-batch 4 (meshtrain train, 3 steps)")
    res = {}
    for a in ("materialized", "fused"):
        lines = [json.loads(l) for l in open(f"{work}/124m_{a}.jsonl")]
        ms = [l["step_ms"] for l in lines if "event" not in l]
        summary = next(l for l in lines if l.get("event") == "summary")
        res[a] = (summary["mem_activations"], sum(ms[1:]) / len(ms[1:]))
        print(f"  {a:12s} mem_activations {summary['mem_activations'] / 2**30:6.2f} GiB   first step {ms[0]:7.0f} ms"
              f"   steps 2-3 {res[a][1]:7.0f} ms")
    drop = res["materialized"][0] - res["fused"][0]
    print(f"  activation peak drop {drop / 1e9:.2f} GB ({drop / 2**30:.2f} GiB); target >= 2 GB: "
          f"{'met' if drop >= 2e9 else 'NOT met'}; steps 2-3 fused/mat {res['fused'][1] / res['materialized'][1]:.3f}")
PY
