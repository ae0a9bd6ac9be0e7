#!/usr/bin/env bash
# GPT-2 124M (12 layers, d_model 768, 12 heads, T 1024, vocab 50304) training steps in bf16
# on one GPU: meshtrain (bench_gpu_step) beside PyTorch eager and torch.compile (bench/gpu_torch.py,
# the same model, batch and bf16 autocast with flash attention and fused AdamW), in one run.
#
#   bash bench/gpu.sh [BUILD_DIR] [--batch 8] [--steps 20]     # BUILD_DIR default build-gpu
#
# Builds with scripts/gpu_build.sh when BUILD_DIR has no bench_gpu_step. Prints each side's
# JSON line, then the table: tokens/s, MFU, peak memory, and meshtrain's ratio to each peer.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-gpu
if [[ $# -gt 0 && $1 != --* ]]; then build=$1; shift; fi
[[ -x $build/bench/bench_gpu_step ]] || bash scripts/gpu_build.sh "$build" >/dev/null
out=$(mktemp -d)
"$build/bench/bench_gpu_step" --precision bf16 "$@" | tee "$out/meshtrain.json"
python3 bench/gpu_torch.py "$@" | tee "$out/torch.json"
python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
rows = [json.loads(l) for f in ("meshtrain.json", "torch.json") for l in open(f"{d}/{f}") if l.strip()]
mt = rows[0]
print(f"\n{rows[0]['device']}, batch {mt['batch']} x {mt['seq']} tokens, bf16")
print(f"{'':16s}{'step ms':>10s}{'tokens/s':>12s}{'MFU':>8s}{'peak GiB':>10s}{'meshtrain x':>13s}")
for r in rows:
    name = "meshtrain" if r is mt else r["peer"]
    ratio = mt["tokens_per_s"] / r["tokens_per_s"]
    print(f"{name:16s}{r['step_ms']:10.1f}{r['tokens_per_s']:12.0f}{r['mfu']*100:7.1f}%{r['peak_bytes']/2**30:10.2f}{ratio:13.2f}")
PY
