#!/usr/bin/env bash
# The planner against this machine: `meshtrain bench profile` measures it, then the core
# benchmark's GPT-2 (global batch 8 x 256 tokens, one thread per rank) trains at every
# 2-rank layout meshtrain has (dp with ZeRO 0-3, tp with and without sequence parallelism,
# pp with each schedule and with the blocks split 2,4 (parallel.pp_layers; auto gives 4,2),
# cp, recompute of every block and of each stage's first 2) and at one rank. For each: the
# planner's memory per tag against the measured peak (goal: within 5%) and its step time,
# with the measured profile, against the measured step (goal: within 25%). Then
# `meshtrain plan` picks a layout for 2 ranks, and the pick is run: the goal is that it is
# the fastest measured, or within 10% of it.
#
# A shared machine's neighbours slow a measurement down, never speed it up, and a profile
# measured while they were busy misplaces every row. So everything is measured in rounds
# (ROUNDS, default 2): the profile kept is the one whose matrix rate (flops_fp32 x
# efficiency, what the step's compute time follows) is highest, and each layout's step is
# the fastest of its rounds (a round runs every layout once, so a busy spell falls on
# other layouts in another round).
#
#   bash bench/plan.sh [--steps K]        ROUNDS=1 bash bench/plan.sh: one of each, faster
source "$(dirname "$0")/dp_common.sh"
rounds=${ROUNDS:-2}
for r in $(seq 1 "$rounds"); do
  ./build/meshtrain launch -n 2 bench profile --out "$work/hw$r.toml" > "$work/profile$r.out" 2>&1 ||
    { cat "$work/profile$r.out"; exit 1; }
done
/usr/bin/python3 - "$work" "$rounds" <<'PY'
import shutil, sys, tomllib
work, rounds = sys.argv[1], int(sys.argv[2])
def rate(r):
    hw = tomllib.load(open(f"{work}/hw{r}.toml", "rb"))["hardware"]
    return hw["flops_fp32"] * hw["efficiency"]
rates = {r: rate(r) for r in range(1, rounds + 1)}
best = max(rates, key=rates.get)
shutil.copy(f"{work}/hw{best}.toml", f"{work}/hw.toml")
print("profile rounds, flops_fp32 x efficiency: " +
      ", ".join(f"{v / 1e9:.1f} GFLOP/s" + (" (kept)" if r == best else "") for r, v in rates.items()))
PY
echo "planner against measurement: GPT-2 6 x 384, global batch 8 x 256 tokens, 1 thread per rank"
blas_info
grep -v '^[#[]' "$work/hw.toml" | sed 's/ *#.*//; s/ = /=/' | tr '\n' ' '; echo
opts=("${dp_opts[@]}" --training.micro_batch=0 --logging.hardware="$work/hw.toml")
layouts=(
  "1|"
  "2|--parallel.dp=2"
  "2|--parallel.dp=2 --parallel.zero=1"
  "2|--parallel.dp=2 --parallel.zero=2"
  "2|--parallel.dp=2 --parallel.zero=3"
  "2|--parallel.dp=2 --training.recompute=true"
  "2|--parallel.tp=2"
  "2|--parallel.tp=2 --parallel.sequence_parallel=true"
  "2|--parallel.pp=2 --parallel.pp_schedule=1f1b"
  "2|--parallel.pp=2 --parallel.pp_schedule=1f1b --training.recompute=true --training.recompute_blocks=2"
  "2|--parallel.pp=2 --parallel.pp_schedule=1f1b --parallel.pp_layers=2,4"
  "2|--parallel.pp=2 --parallel.pp_schedule=gpipe"
  "2|--parallel.pp=2 --parallel.pp_schedule=interleaved"
  "2|--parallel.pp=2 --parallel.pp_schedule=zb-h1"
  "2|--parallel.pp=2 --parallel.pp_schedule=zbv"
  "2|--parallel.cp=2"
)
# The planner's pick for 2 ranks, trained as it says.
./build/meshtrain plan --config configs/gpt2_bench.toml --gpus 2 --gpus-per-node 2 --hardware "$work/hw.toml" \
  --global-batch 8 --json > "$work/plan.json"
pick=$(/usr/bin/python3 -c "
import json, sys
l = json.load(open(sys.argv[1]))['layouts'][0]['layout']
flags = [f'--parallel.{k}={l[k]}' for k in ('dp', 'tp', 'pp', 'cp', 'zero', 'pp_schedule', 'pp_chunks')]
flags += [f'--parallel.sequence_parallel={str(l[\"sequence_parallel\"]).lower()}',
          f'--training.recompute={str(l[\"recompute\"] not in (\"none\", \"selective\")).lower()}',
          f'--training.micro_batch={l[\"micro_batch\"]}']
if l['recompute'].isdigit():
    flags.append(f'--training.recompute_blocks={l[\"recompute\"]}')
print(' '.join(flags))" "$work/plan.json")
layouts+=("2|$pick")
# Run k of every round: $work/l<k>_r<round>.jsonl; the last is the pick.
for r in $(seq 1 "$rounds"); do
  i=0
  for entry in "${layouts[@]}"; do
    n=${entry%%|*}; flags=${entry#*|}
    # shellcheck disable=SC2086
    ./build/meshtrain launch -n "$n" train "${opts[@]}" $flags --logging.metrics="$work/l${i}_r$r.jsonl" \
      > "$work/l$i.out" 2>&1 || { cat "$work/l$i.out"; exit 1; }
    echo "$n ranks ${flags:-(one rank)}" > "$work/l$i.name"
    i=$((i + 1))
  done
done
echo "planner's pick: $pick" > "$work/l$((i - 1)).name"
/usr/bin/python3 - "$work" "$i" "$rounds" <<'PY'
import json, statistics, sys
work, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tags = ("params", "grads", "optim", "activations", "comm")
def load(k):  # the median step of run k's fastest round, and that round's summary
    runs = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/l{k}_r{r}.jsonl")]
        steps = [l for l in lines if "event" not in l][2:]
        runs.append((statistics.median(s["step_ms"] for s in steps),
                     [l for l in lines if l.get("event") == "summary"][0]))
    return min(runs, key=lambda run: run[0]), [run[0] for run in runs]
print(f"{'layout':<62} " + " ".join(f"{t[:6]:>13}" for t in tags) + f" {'step ms':>8} {'plan ms':>8} {'ratio':>6}"
      + (f"  {'rounds ms':>8}" if rounds > 1 else ""))
worst_mem, worst_time, best = 0.0, 0.0, None
for k in range(n):
    (ms, s), each = load(k)
    cells = []
    label = open(f"{work}/l{k}.name").read().strip()
    for t in tags:
        pred, meas = s[f"plan_mem_{t}"], s[f"mem_steps_{t}"]
        if meas > 2**20:  # below a MiB: not a tag worth a percentage
            worst_mem = max(worst_mem, abs(pred / meas - 1))
        cells.append(f"{pred / 2**20:5.1f}/{meas / 2**20:5.1f}{'' if meas > 2**20 else ' -':>2}")
    plan_ms = 1e3 * s["plan_step_s"]
    worst_time = max(worst_time, abs(plan_ms / ms - 1))
    if k < n - 1 and label.startswith("2 ranks") and (best is None or ms < best[1]):
        best = (label, ms)
    print(f"{label[:62]:<62} " + " ".join(f"{c:>13}" for c in cells) + f" {ms:>8.1f} {plan_ms:>8.1f} {plan_ms / ms:>6.2f}"
          + ("  " + " ".join(f"{m:.0f}" for m in each) if rounds > 1 else ""))
pick_ms = load(n - 1)[0][0]
print("memory cells: predicted / measured MiB ('-': under a MiB, not counted)")
if rounds > 1:
    print(f"step ms: the fastest of {rounds} rounds' medians (each round's beside the ratio)")
print(f"memory per tag: largest difference {100 * worst_mem:.1f}% (goal: within 5%)")
print(f"step time: largest difference {100 * worst_time:.1f}% (goal: within 25%)")
print(f"fastest measured at 2 ranks: {best[0]} ({best[1]:.1f} ms); the planner's pick: {pick_ms:.1f} ms, "
      f"{100 * (pick_ms / best[1] - 1):+.1f}% (goal: within 10%)")
print("PyTorch: no planner to compare with; the reference is this machine's measured runs.")
PY
