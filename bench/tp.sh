#!/usr/bin/env bash
# The tensor-parallel benchmark: the core benchmark's GPT-2 and global batch (8 x 256 tokens)
# at tp 1, tp 2 and tp 2 with sequence parallelism, one thread per rank: step time, bytes
# each tp rank sends per step against the predicted figure (tp_bytes_per_micro_batch: per
# block two reductions of B x T x C forward, two backward), model-state memory per rank
# against the formula (16 bytes per parameter held: the split layers divided by tp, norms
# and row-parallel biases whole), and the activation peak against activation_bytes.
# Debian's PyTorch 1.13 has no tensor-parallel API to compare with, so there is no peer
# column here; tp 1 is the reference.
#
#   bash bench/tp.sh [--steps K]
source "$(dirname "$0")/dp_common.sh"
# dp_opts has 4 sequences per rank (dp 2); at tp the whole batch of 8 runs on every tp rank.
./build/meshtrain train "${dp_opts[@]}" --training.micro_batch=8 --logging.metrics="$work/tp1.jsonl" > /dev/null
./build/meshtrain launch -n 2 train "${dp_opts[@]}" --training.micro_batch=8 --parallel.tp=2 \
  --logging.metrics="$work/tp2.jsonl" > "$work/tp2.out" 2>&1
./build/meshtrain launch -n 2 train "${dp_opts[@]}" --training.micro_batch=8 --parallel.tp=2 \
  --parallel.sequence_parallel=true --logging.metrics="$work/tp2sp.jsonl" > /dev/null 2>&1
echo "tensor parallelism, GPT-2 6 x 384 (13.9M parameters), global batch 8 x 256 tokens, 1 thread per rank"
blas_info
grep '^tp:' "$work/tp2.out" || true
/usr/bin/python3 - "$work" <<'PY'
import json, statistics, sys
rows = []
for tp, name in ((1, "tp1"), (2, "tp2"), ("2 sp", "tp2sp")):
    lines = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}.jsonl")]
    steps = [l for l in lines if "event" not in l][2:]
    summary = [l for l in lines if l.get("event") == "summary"][0]
    rows.append((tp, statistics.median(s["step_ms"] for s in steps),
                 statistics.median(s.get("comm_bytes_tp", 0) for s in steps), steps[0].get("comm_bytes_tp_predicted", 0),
                 summary["mem_model_state"], summary["mem_model_state_predicted"], summary["mem_activations"],
                 summary["mem_activations_predicted"]))
print(f"{'tp':>5} {'step ms':>9} {'vs tp 1':>8} {'tp MB/step':>11} {'predicted':>10} {'model state MB':>15} "
      f"{'formula MB':>11} {'activations MB':>15} {'formula MB':>11}")
for tp, ms, b, pred, mem, formula, act, act_formula in rows:
    print(f"{tp:>5} {ms:>9.1f} {ms / rows[0][1]:>8.2f} {b / 1e6:>11.1f} {pred / 1e6:>10.1f} {mem / 2**20:>15.1f} "
          f"{formula / 2**20:>11.1f} {act / 2**20:>15.1f} {act_formula / 2**20:>11.1f}")
print("PyTorch: no tensor-parallel API in Debian's PyTorch 1.13 to compare with.")
PY
