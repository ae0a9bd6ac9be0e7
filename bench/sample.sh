#!/usr/bin/env bash
# Generation speed: `meshtrain sample` (fp32, key/value cache) against PyTorch CPU eager
# with a key/value cache (bench/torch_sample.py), side by side in one invocation, on GPT-2
# 124M (configs/gpt2_124m.toml's shapes; meshtrain's weights from one training step on
# random token ids, PyTorch's random), the same threads, a prompt of P tokens and K tokens
# generated in one window (P + K <= 1024), sampling with temperature 0.8 and top-k 40.
# Each side runs twice, alternating; the faster run is reported.
#
# tokens/s counts the tokens after the first (which the prompt's forward gives), with the
# sampling between them. The ceiling: a new token reads every weight once, so the memory
# read bandwidth (measured by the PyTorch side: sums of a 1 GiB tensor) over 4 bytes per
# parameter bounds any fp32 implementation's tokens/s. Target: meshtrain at least as fast
# as PyTorch. Measured on 2 cores (AMD EPYC, AVX-512, Cooperlake kernels): 40.8 tokens/s
# against PyTorch's 23.1 (1.77x). The ceiling is noisy on a shared machine: the same sum
# read 52.6 GB/s in that run and 33 GB/s half an hour later. A product of one row reads its
# weights at about 26 GB/s here with 2 threads (OpenBLAS's matrix-vector kernels and a
# hand-written AVX-512 one alike), so 40 tokens/s (20 GB/s) is near what such kernels give.
#
#   bash bench/sample.sh [--threads N] [--prompt-tokens P] [--tokens K]
set -euo pipefail
cd "$(dirname "$0")/.."
threads=$(nproc) prompt=64 tokens=256
while (($#)); do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --prompt-tokens) prompt=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
((prompt >= 1 && tokens >= 2 && prompt + tokens <= 1024)) || { echo "need P >= 1, K >= 2, P + K <= 1024" >&2; exit 2; }
bash scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/same_kernels.sh"
export OMP_NUM_THREADS=$threads
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "training one step of GPT-2 124M for a checkpoint (about a minute) ..."
/usr/bin/python3 - "$work/tokens.bin" <<'PY'
import sys, os
sys.path.insert(0, os.path.join("tests", "parity"))
import numpy as np, st
st.write_tokens(sys.argv[1], np.random.RandomState(0).randint(0, 50257, size=5000))
PY
./build/meshtrain train --config configs/gpt2_124m.toml --data.path="$work/tokens.bin" --training.steps=1 \
  --training.global_batch=1 --training.micro_batch=1 --training.val_every=0 --optim.warmup_steps=0 \
  --checkpoint.dir="$work/ck" --logging.metrics= --logging.plot= --logging.progress=off \
  --training.threads="$threads" > /dev/null
# P letters: the byte-level tokenizer the checkpoint records reads each as one token
text=$(head -c "$prompt" /dev/zero | tr '\0' 'a')
for run in 1 2; do
  ./build/meshtrain sample --checkpoint "$work/ck" --prompt "$text" --tokens "$tokens" --seed "$run" \
    2> "$work/mt$run.err" > /dev/null
  /usr/bin/python3 bench/torch_sample.py --threads "$threads" --prompt-tokens "$prompt" --tokens "$tokens" \
    > "$work/pt$run.json"
done
/usr/bin/python3 - "$work" "$tokens" <<'PY'
import json, re, sys
work, want = sys.argv[1], int(sys.argv[2])
mt, pt = [], []
for run in (1, 2):
    err = open(f"{work}/mt{run}.err").read()
    m = re.search(r"sample: (\d+) tokens; the prompt's (\d+) read in ([\d.]+) s, then ([\d.]+) tokens/s", err)
    if not m:
        sys.exit("meshtrain sample printed no summary:\n" + err)
    mt.append(dict(tokens=int(m[1]), prompt=int(m[2]), prompt_s=float(m[3]), tps=float(m[4])))
    pt.append(json.loads(open(f"{work}/pt{run}.json").read()))
m = max(mt, key=lambda r: r["tps"])
p = max(pt, key=lambda r: r["tokens_per_s"])
ceiling = p["ceiling_tokens_per_s"]
print(f"GPT-2 124M generation, fp32, {p['threads']} threads, prompt {p['prompt_tokens']} tokens, "
      f"{want} generated; BLAS: {p['blas']}")
print(f"memory read bandwidth {p['read_gb_per_s']:.1f} GB/s: ceiling {ceiling:.1f} tokens/s "
      f"({p['params'] / 1e6:.1f} M parameters x 4 bytes per token)")
if m["tokens"] < want:
    print(f"note: meshtrain's run stopped at end-of-text after {m['tokens']} tokens")
for name, tps, ps in (("meshtrain", m["tps"], m["prompt_s"]), ("pytorch", p["tokens_per_s"], p["prompt_s"])):
    print(f"  {name:10s} {tps:7.1f} tokens/s  ({100 * tps / ceiling:3.0f}% of the ceiling)   prompt {ps:.3f} s")
print(f"meshtrain / pytorch: {m['tps'] / p['tokens_per_s']:.2f}x tokens/s")
PY
