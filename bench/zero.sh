#!/usr/bin/env bash
# The ZeRO benchmark: the core benchmark's GPT-2 and global batch (8 x 256 tokens) at dp 2,
# one thread per rank, with parallel.zero = 0, 1, 2, 3: step time against stage 0,
# communication bytes per step against theory (stages 1-2 move what DDP moves,
# 2(N-1)/N x 4Ψ; stage 3 moves 1.5x that), and model-state memory against the formulas.
#
#   bash bench/zero.sh [--steps K]
source "$(dirname "$0")/dp_common.sh"
for z in 0 1 2 3; do
  ./build/meshtrain launch -n 2 train "${dp_opts[@]}" --parallel.zero=$z --logging.metrics="$work/z$z.jsonl" > /dev/null 2>&1
done
/usr/bin/python3 - "$work" <<'PY'
import json, statistics, sys
rows = []
for z in range(4):
    lines = [json.loads(l) for l in open(f"{sys.argv[1]}/z{z}.jsonl")]
    steps = [l for l in lines if "event" not in l][2:]
    summary = [l for l in lines if l.get("event") == "summary"][0]
    rows.append((z, statistics.median(s["step_ms"] for s in steps), statistics.median(s["comm_bytes"] for s in steps),
                 summary["mem_model_state"], summary["mem_model_state_predicted"], summary["mem_comm"]))
psi = 13891584  # parameters of the benchmark GPT-2
ddp_bytes = 2 * (2 - 1) / 2 * 4 * psi
print("ZeRO at dp 2, GPT-2 6 x 384 (13.9M parameters), global batch 8 x 256 tokens, 1 thread per rank")
print(f"{'stage':>5} {'step ms':>9} {'vs 0':>6} {'comm MB/step':>13} {'vs theory':>10} {'model state MB':>15} {'formula MB':>11} {'comm bufs MB':>13}")
for z, ms, b, mem, pred, comm in rows:
    theory = ddp_bytes * (1.5 if z == 3 else 1.0)
    print(f"{z:>5} {ms:>9.1f} {ms / rows[0][1]:>6.2f} {b / 1e6:>13.1f} {b / theory:>10.3f} {mem / 2**20:>15.1f} "
          f"{pred / 2**20:>11.1f} {comm / 2**20:>13.1f}")
PY
