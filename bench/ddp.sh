#!/usr/bin/env bash
# The DDP benchmark: the core benchmark's GPT-2 and global batch (8 x 256 tokens) at dp 2,
# one thread per rank, meshtrain (`meshtrain launch -n 2 train`) beside PyTorch DDP (gloo),
# in one invocation. Also measures how much of the gradient reduction the overlap hides:
#   exposed communication = step time - step time of one rank's compute alone (no reduction),
#   with the overlap on and off; hidden = 1 - exposed(on) / exposed(off).
#
#   bash bench/ddp.sh [--steps K]
# Target: meshtrain's step at most 0.6x PyTorch DDP's.
source "$(dirname "$0")/dp_common.sh"
median_step() {  # median step_ms of a metrics file, skipping two warm-up steps
  /usr/bin/python3 -c "import json,sys,statistics; s=[json.loads(l) for l in open(sys.argv[1])];
s=[x['step_ms'] for x in s if 'event' not in x][2:]; print(statistics.median(s))" "$1"
}
./build/meshtrain launch -n 2 train "${dp_opts[@]}" --logging.metrics="$work/on.jsonl" > /dev/null 2>&1
./build/meshtrain launch -n 2 train "${dp_opts[@]}" --parallel.overlap=false --logging.metrics="$work/off.jsonl" > /dev/null 2>&1
./build/meshtrain train "${dp_opts[@]}" --training.global_batch=4 --logging.metrics="$work/alone.jsonl" > /dev/null
pt=$(/usr/bin/python3 bench/torch_ddp_step.py --ranks 2 --steps "$steps")
/usr/bin/python3 - "$(median_step "$work/on.jsonl")" "$(median_step "$work/off.jsonl")" \
                   "$(median_step "$work/alone.jsonl")" "$pt" <<'PY'
import json, sys
on, off, alone, pt = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
print("DDP step, GPT-2 6 x 384, global batch 8 x 256 tokens, dp 2, 1 thread per rank")
print(f"  meshtrain dp 2 (overlap)     {on:9.1f} ms")
print(f"  meshtrain dp 2 (no overlap)  {off:9.1f} ms")
print(f"  one rank's compute alone     {alone:9.1f} ms   (4 sequences, no reduction)")
print(f"  pytorch DDP gloo dp 2        {pt['step_ms_median']:9.1f} ms")
ratio = on / pt["step_ms_median"]
print(f"ratio meshtrain / pytorch = {ratio:.2f}  (target <= 0.60: {'met' if ratio <= 0.6 else 'NOT met'})")
exp_on, exp_off = max(on - alone, 0.0), max(off - alone, 1e-9)
print(f"exposed reduction: {exp_off:.1f} ms without overlap, {exp_on:.1f} ms with it: "
      f"the overlap hides {100 * (1 - exp_on / exp_off):.0f}%")
PY
