#!/usr/bin/env bash
# The pipeline benchmark: GPT-2 (d_model 384) at pp 2, one thread per rank, micro-batches
# of one sequence of 256 tokens, m = 2, 4, 8 and 16 per step, every schedule. For each: the
# step time, the pipeline's measured time per step (first action to last, from
# logging.trace) against the simulator fed with the action costs measured in the same run
# (goal: within 5%), and the measured bubble; then zb-h1's bubble against 1f1b's (goal: at
# most 0.4x). The bubble compared is the one the zero-bubble schedules are defined by: per
# step, the step's span less the busiest rank's compute, i.e. cost - m (T_F + T_B + T_W) with
# the slowest stage's costs, the idle time of the stage that sets the pace (1f1b:
# (P-1)(F+B+W), zb-h1: (P-1)(F+B-W), a third when the three cost alike). A faster stage also
# waits m times per step for the slower one; that wait is the layout's imbalance, the same
# under every schedule, not the schedule's bubble, and is printed beside it (idle averaged
# over the ranks). The ratio of bubble fractions is printed too (it also counts zb-h1's
# shorter step, so it cannot reach a third: (m+P-1)/(3m+P-1)). Idle times are read from the
# trace and, like the step time, are the median over the steps after the first two (the
# first step's allocations and page faults double its idle). Debian's PyTorch 1.13 has no
# pipeline schedules to compare with (torch.distributed.pipelining came later), so there is
# no peer column; pp 1 (plain accumulation) is the reference.
#
#   bash bench/pp.sh [--steps K]
source "$(dirname "$0")/dp_common.sh"
# The model: GPT-2 with 10 blocks of width 768 (12 heads) over 128-token sequences, so that
# the matrix products dominate each block as they do in the models pipelines are used for
# (attention, GELU and the norms, all of them in the input half of backward, cost about 8%
# of the products here; at width 384 over 256 tokens they cost 17%, and zb-h1's bubble,
# F + BI - BW, grows with them). The vocabulary is widened to 18432 = 24 x 768 (the data's
# ids stay below 8192) so that by parallel.pp_layers=auto's FLOP count the head and loss
# cost two blocks and every placement splits evenly: 6 + 4 blocks at v = 1, 3, 3, 3, 1 at
# v = 2. What is left of stage imbalance is the cost model's error.
opts=("${dp_opts[@]}" --training.micro_batch=1 --model.n_layer=10 --model.d_model=768 --model.n_head=12
      --model.seq_len=128 --model.vocab_size=18432)
echo "pipeline parallelism, GPT-2 10 x 768 (vocabulary 18432), micro-batches of 1 x 128 tokens, pp 2, 1 thread per rank"
blas_info
for m in 2 4 8 16; do
  ./build/meshtrain train "${opts[@]}" --training.global_batch=$m --logging.metrics="$work/pp1_m$m.jsonl" > /dev/null
  for s in gpipe 1f1b interleaved zb-h1 zbv; do
    ./build/meshtrain launch -n 2 train "${opts[@]}" --training.global_batch=$m --parallel.pp=2 \
      --parallel.pp_schedule=$s --logging.trace="$work/${s}_m$m.trace" --logging.metrics="$work/${s}_m$m.jsonl" \
      > "$work/${s}_m$m.out" 2>&1 || { cat "$work/${s}_m$m.out"; exit 1; }
  done
done
grep -h '^pipeline:' "$work"/*_m8.out | head -1 || true
/usr/bin/python3 - "$work" <<'PY'
import collections, json, statistics, sys
work = sys.argv[1]
def idle_ms(name):  # per step from the trace: (the busiest rank's idle, idle averaged over ranks), medians
    events = [e for e in json.load(open(f"{work}/{name}.trace"))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") == "compute"]
    steps = collections.defaultdict(list)
    for e in events:
        steps[e["args"]["step"]].append(e)
    pace, mean = [], []
    for step, es in sorted(steps.items())[2:]:
        span = max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)
        busy = collections.Counter()
        for e in es:
            busy[e["pid"]] += e["dur"]
        pace.append((span - max(busy.values())) / 1e3)
        mean.append((span - sum(busy.values()) / len(busy)) / 1e3)
    return statistics.median(pace), statistics.median(mean)
def load(name):
    lines = [json.loads(l) for l in open(f"{work}/{name}.jsonl")]
    steps = [l for l in lines if "event" not in l][2:]
    return statistics.median(s["step_ms"] for s in steps), [l for l in lines if l.get("event") == "summary"][0]
print(f"{'schedule':>12} {'m':>3} {'step ms':>8} {'vs pp 1':>8} {'pipeline ms':>12} {'simulated ms':>13} "
      f"{'sim/meas':>9} {'bubble':>7} {'activations MB':>15}")
bubbles, worst = {}, 0.0
for m in (2, 4, 8, 16):
    ref, _ = load(f"pp1_m{m}")
    print(f"{'pp 1':>12} {m:>3} {ref:>8.1f} {1:>8.2f}")
    for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv"):
        ms, summ = load(f"{s}_m{m}")
        meas, sim = summ["pp_step_ms"], summ["pp_simulated_ms"]
        bubbles[(s, m)] = summ["pp_bubble"], idle_ms(f"{s}_m{m}")
        worst = max(worst, abs(sim / meas - 1))
        print(f"{s:>12} {m:>3} {ms:>8.1f} {ms / ref:>8.2f} {meas:>12.1f} {sim:>13.1f} {sim / meas:>9.3f} "
              f"{summ['pp_bubble']:>7.3f} {summ['mem_activations'] / 2**20:>15.1f}")
print(f"simulator against measurement: largest difference {100 * worst:.1f}% (goal: within 5%)")
for m in (2, 4, 8, 16):
    (zb, (zb_pace, zb_mean)), (ob, (ob_pace, ob_mean)) = bubbles[("zb-h1", m)], bubbles[("1f1b", m)]
    print(f"m {m:>2}: bubble (the pacing stage's idle per step): zb-h1 {zb_pace:.1f} ms, 1f1b {ob_pace:.1f} ms, "
          f"ratio {zb_pace / ob_pace:.2f} (goal: at most 0.4); idle averaged over ranks {zb_mean:.1f} / "
          f"{ob_mean:.1f} ms ({zb_mean / ob_mean:.2f}); ratio of bubble fractions {zb / ob:.2f}")
print("PyTorch: no pipeline schedules in Debian's PyTorch 1.13 to compare with.")
PY
