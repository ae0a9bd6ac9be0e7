#!/usr/bin/env bash
# On the GPU machine, in one call of the device tool: build (scripts/gpu_build.sh), then the
# phases named, each under what is left of a time budget, then the logs packed into $OUT.
#
#   bash scripts/gpu_check.sh [PHASE ...]      # default: tests bench hf train, in that order
#
#   tests     every CUDA test program, four at a time; a failing program's failed tests (all
#             of them if it crashed before naming one) rerun with the mma.sync attention
#             kernels, then the GELU fusions, switched off; the GPU collectives at 2 and 4 ranks
#   bench     bench/gpu.sh (GPT-2 124M beside PyTorch eager and torch.compile), attention
#             beside PyTorch's flash attention, the step per op, the switches' A/B
#   hf        bf16 training against Hugging Face transformers (tests/parity/run_hf_gpu.py)
#   train     30 steps of the built-in tasks on the GPU and on the CPU: the same losses
#   ncu       Nsight Compute: every kernel's time over three steps, the attention kernels' counters
#   sanitize  compute-sanitizer: memcheck over the op tests, racecheck and synccheck over
#             the mma.sync attention kernels
#
# GPU_CHECK_BUDGET_S (default 540) is the whole call's time, the build included: a phase
# starts only while its minimum is left, runs at most its share, and is stopped when the
# budget runs out, and what it finished is still reported. So the call ends inside the
# device tool's 10 minutes per command (give it timeout_s 600) and leaves a 15-minute lease
# time for a second, shorter call on the warm machine (ncu, say). The summary is printed
# and written to $OUT/summary.txt; every log goes to $OUT/logs.tar.gz (the tool brings
# back at most 8 files) and stays in gpu-check/<time>/. $PYTHON (default python3) must
# have torch and transformers.
set -uo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.." || exit 1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # the device machine runs commands as root
py=${PYTHON:-python3}

# Each phase: its minimum and its share of the budget, in seconds.
declare -A min_s=([tests]=90 [bench]=120 [hf]=90 [train]=40 [ncu]=120 [sanitize]=180)
declare -A share_s=([tests]=220 [bench]=200 [hf]=150 [train]=60 [ncu]=300 [sanitize]=420)

failed_tests() {  # the failed tests' names in a gtest log, joined by ':'
  grep -oE '^\[  FAILED  \] [A-Za-z0-9_/.]+\.[A-Za-z0-9_/]+' "$1" | awk '{print $4}' | sort -u | paste -sd:
}

# NAME COMMAND...: one test program under the phase's time less 20 s (a hung one keeps its
# slot, not the phase), its log and exit status; a failing gtest program's failed tests (all
# of them if it crashed before naming one) rerun with each switch.
run_program() {
  local name=$1 failed switch rc
  shift
  timeout -k 5 $((phase_left - 20)) "$@" > "$logs/$name.log" 2>&1
  rc=$?
  echo $rc > "$logs/$name.rc"
  [[ $rc == 0 || $rc == 124 || $rc == 137 || $name == mpi_* ]] && return  # passed, stopped, or no gtest filter
  failed=$(failed_tests "$logs/$name.log")
  for switch in MESHTRAIN_ATTENTION_KERNEL=wmma MESHTRAIN_FUSED_GELU=off; do
    env "$switch" "$@" --gtest_filter="${failed:-*}" > "$logs/$name.${switch%%=*}.log" 2>&1
    echo $? > "$logs/$name.${switch%%=*}.rc"
  done
}

phase_tests() {
  # Four programs at a time (each takes a little of the GPU); the communicator's collectives
  # on GPU tensors at 2 and 4 ranks: ranks sharing the GPU, and NCCL where the machine has a
  # GPU per rank.
  local t n
  for t in build-gpu/tests/test_cuda_* build-gpu/tests/mpi_test_cuda_*; do
    [[ -f $t && -x $t ]] || continue
    for n in $([[ $t == */mpi_* ]] && echo 2 4 || echo 1); do
      while (($(jobs -rp | wc -l) >= 4)); do wait -n; done
      if ((n == 1)); then
        run_program "$(basename "$t")" "$t" --gtest_brief=1 &
      else
        # each mpirun its own session directory: mpiruns started at once race on a shared one
        run_program "$(basename "$t")_n$n" env OMPI_MCA_orte_tmpdir_base="${TMPDIR:-/tmp}/gpu-check-mpirun/$(basename "$t")_n$n" \
          mpirun --oversubscribe -n $n "$t" &
      fi
    done
  done
  wait
}

# What the tests phase finished, read from its files (also after the budget stopped it).
report_tests() {
  local log name rc switch status=0
  for log in "$logs"/test_cuda_*.log "$logs"/mpi_test_cuda_*.log; do
    name=$(basename "$log" .log)
    [[ -f $log && $name != *.MESHTRAIN_* ]] || continue
    rc=$(cat "$logs/$name.rc" 2> /dev/null)
    if [[ -z $rc || $rc == 124 || $rc == 137 ]]; then
      status=1
      echo "$name: did not finish${rc:+ in its $((phase_left - 20)) s} (tests with a result: $(grep -cE '^\[  (FAILED|     OK) ' "$log"); its last line: $(tail -1 "$log" | cut -c1-120))"
      continue
    fi
    if [[ $rc == 0 ]]; then
      if [[ $name == mpi_* ]]; then  # NCCL's tests need a GPU per rank: say when they skipped, and why
        echo "$name: passed$(grep -A1 -m1 ': Skipped' "$log" | tail -1 | sed 's/^./ (skipped: &/; s/$/)/')"
      else
        echo "$name: $(grep -E '^\[  PASSED  \]' "$log")$(grep -m1 -E '^\[  SKIPPED \] [0-9]' "$log" | sed 's/^/, /')"
      fi
      continue
    fi
    status=1
    echo "$name: FAILED (exit $rc)"
    grep -E "Failure|error|Expected|Which is|actual|got|FAILED|mt::Error|what\(\)" "$log" | head -40
    for switch in MESHTRAIN_ATTENTION_KERNEL=wmma MESHTRAIN_FUSED_GELU=off; do
      [[ -f $logs/$name.${switch%%=*}.rc ]] || continue
      if [[ $(cat "$logs/$name.${switch%%=*}.rc") == 0 ]]; then
        echo "  with $switch: the failed tests pass"
      else
        echo "  with $switch: still failing: $(failed_tests "$logs/$name.${switch%%=*}.log" | tr : ' ')"
      fi
    done
  done
  return $status
}

phase_train() {
  # The built-in tasks on the GPU and on the CPU: the same losses step by step (fp32).
  local dev
  for dev in cuda cpu; do
    build-gpu/meshtrain train --training.device=$dev --training.steps=30 --logging.progress=off \
      --logging.metrics="$logs/train_$dev.jsonl" > "$logs/train_$dev.log" 2>&1 || { tail -5 "$logs/train_$dev.log"; return 1; }
  done
  python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
rows = {dev: [json.loads(l) for l in open(f"{d}/train_{dev}.jsonl") if '"loss"' in l and '"event"' not in l] for dev in ("cuda", "cpu")}
diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rows["cuda"], rows["cpu"]))
print(f"train: {len(rows['cuda'])} steps, loss {rows['cuda'][0]['loss']:.4f} -> {rows['cuda'][-1]['loss']:.4f} on the GPU, "
      f"largest relative difference from the CPU run {diff:.2e}; step {rows['cuda'][-1]['step_ms']:.1f} ms (GPU) "
      f"vs {rows['cpu'][-1]['step_ms']:.1f} ms (CPU)")
sys.exit(0 if diff < 1e-3 else 1)
PY
}

phase_hf() {
  # GPT-2 and Llama in bf16 on the GPU: meshtrain against transformers' models (and the
  # reference model) under torch.autocast, per-step losses and final parameters.
  "$py" tests/parity/run_hf_gpu.py --meshtrain build-gpu/meshtrain --device cuda --impl both > "$logs/hf.log" 2>&1
  local rc=$?
  grep -E "^(transformers|torch) |^===|fp32 on the CPU, first|loss max|  (mt|hf|torch) .* vs |last/first|: (PASS|FAIL)" "$logs/hf.log"
  if [[ $rc != 0 ]]; then echo "hf: FAILED (exit $rc), the log's end:"; tail -25 "$logs/hf.log"; return 1; fi
}

phase_bench() {
  local k fused
  bash bench/gpu.sh build-gpu 2>&1 | tee "$logs/bench.log" | tail -6
  build-gpu/bench/bench_gpu_attention 2>&1 | tee "$logs/attention.log"
  "$py" bench/gpu_attention_torch.py 2>&1 | tee -a "$logs/attention.log"  # the peer, same shapes
  # Where meshtrain's step goes, per op: each launch waits for its kernel, so the times are
  # GPU times (the step itself is slower so).
  CUDA_LAUNCH_BLOCKING=1 build-gpu/bench/bench_gpu_step --profile 1 --steps 5 2>&1 >/dev/null |
    tee "$logs/profile.txt" | head -25
  # The same without waiting: each op's time is then the host's cost of queueing it (and the
  # waits for results), its step time the real one; a step near the sum of these host times
  # is bound by the host, not the GPU.
  build-gpu/bench/bench_gpu_step --profile 1 --steps 5 2>&1 >/dev/null | tee "$logs/profile_host.txt" | head -12
  # The attention kernels' share: the step with the WMMA kernels, then with the mma.sync ones;
  # the GELU fusions' share: the step with them off, then on.
  for k in wmma ""; do
    echo "MESHTRAIN_ATTENTION_KERNEL=${k:-(unset)}: $(MESHTRAIN_ATTENTION_KERNEL=$k build-gpu/bench/bench_gpu_step \
      --precision bf16 --steps 10 2>/dev/null)"
  done | tee "$logs/attention_ab.txt"
  for fused in off on; do
    echo "MESHTRAIN_FUSED_GELU=$fused: $(MESHTRAIN_FUSED_GELU=$fused build-gpu/bench/bench_gpu_step --precision bf16 \
      --steps 10 2>/dev/null)"
  done | tee "$logs/fusion_ab.txt"
}

phase_sanitize() {
  # compute-sanitizer over the op tests, all at once (each under the phase's time, as the
  # tools slow kernels down many times): memcheck (out-of-bounds and misaligned accesses,
  # errors of the API) over every op's tests; racecheck (shared-memory hazards) and
  # synccheck (barriers) over the attention kernels, whose tiles are shared. A tool that
  # reports errors prints its first ones; "stopped" means no error was seen in the part it ran.
  local cs r tool prog filter log status=0 runs=()
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [[ -x $cs ]] || { echo "sanitize: compute-sanitizer not found"; return 1; }
  for p in runtime linear pointwise loss_optim attention attention_tc block model; do runs+=("memcheck test_cuda_$p *"); done
  for tool in racecheck synccheck; do runs+=("$tool test_cuda_attention_tc CudaAttentionTc.Mma*:CudaAttentionTc.SixteenBit*"); done
  for r in "${runs[@]}"; do
    read -r tool prog filter <<< "$r"
    ( timeout $((phase_left - 10)) "$cs" --tool "$tool" --error-exitcode 97 --print-limit 10 \
        "build-gpu/tests/$prog" --gtest_filter="$filter" > "$logs/sanitize_${tool}_$prog.log" 2>&1
      echo $? > "$logs/sanitize_${tool}_$prog.rc" ) &
  done
  wait
  for r in "${runs[@]}"; do
    read -r tool prog filter <<< "$r"
    log=$logs/sanitize_${tool}_$prog.log
    case $(cat "$logs/sanitize_${tool}_$prog.rc") in
      0) echo "$tool $prog: clean ($(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log"))" ;;
      124) echo "$tool $prog: stopped after $((phase_left - 10)) s, no error before ($(grep -c '^\[       OK' "$log") tests done)" ;;
      97) status=1; echo "$tool $prog: ERRORS"; grep -E -m 12 "^========= (Invalid|Error|Race|Barrier|Program hit|    at|Address)" "$log" ;;
      *) status=1; echo "$tool $prog: the tests failed under the tool"; grep -E -m 8 "FAILED|Failure|mt::Error" "$log" ;;
    esac
  done
  return $status
}

phase_ncu() {
  # Nsight Compute (--clock-control none: the clocks as the benchmark runs them).
  local ncu step_ms status=0
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [[ -x $ncu ]] || { echo "ncu: Nsight Compute not found"; return 1; }
  # 1. The bf16 step per kernel: GPU time of every kernel of 3 timed steps (bench_gpu_step's
  #    profiler range), beside the step measured without the profiler; what the kernels do
  #    not fill is time the GPU waits for the host.
  step_ms=$(build-gpu/bench/bench_gpu_step --precision bf16 --steps 10 2>/dev/null |
    python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["step_ms"])')
  "$ncu" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    build-gpu/bench/bench_gpu_step --precision bf16 --steps 3 --warmup 2 > "$logs/ncu_step.csv" 2> "$logs/ncu_step.log" ||
    { status=1; echo "ncu step: failed"; tail -5 "$logs/ncu_step.log"; }
  python3 bench/ncu_kernels.py "$logs/ncu_step.csv" --steps 3 --step-ms "$step_ms" | tee "$logs/ncu_step.txt" || status=1
  # 2. The mma.sync attention kernels (forward, dK/dV, dQ at D 64 then 128, one call each),
  #    every section: throughputs, occupancy, stall reasons, shared-memory bank conflicts and
  #    the source lines that stall; then their one-line digest.
  "$ncu" --clock-control none --set full -k regex:attention_mma --launch-count 6 \
    build-gpu/bench/bench_gpu_attention --reps 1 --warmup 0 > "$logs/ncu_attention.txt" 2>&1 ||
    { status=1; echo "ncu attention: failed"; tail -5 "$logs/ncu_attention.txt"; }
  grep -E "attention_mma_[a-z]+_kernel|^ +(Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Issue Slots Busy|L1/TEX Hit Rate) " \
    "$logs/ncu_attention.txt" | sed -E 's/>\(.*/>/' | tee "$logs/ncu_attention_digest.txt"
  return $status
}

# One phase, run by the script itself under `timeout` (which stops its whole process group).
if [[ ${1:-} == --phase ]]; then
  logs=$3 phase_left=$4
  "phase_$2"
  exit
fi

phases=("$@")
((${#phases[@]})) || phases=(tests bench hf train)
for p in "${phases[@]}"; do
  [[ -n ${min_s[$p]:-} ]] || { echo "gpu_check.sh: no phase '$p' (phases: tests bench hf train ncu sanitize)" >&2; exit 2; }
done
budget=${GPU_CHECK_BUDGET_S:-540}
logs=gpu-check/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$logs"

main() {
  local left cap p status=0
  echo "gpu_check: $(date -u +%FT%TZ), phases ${phases[*]}, budget $budget s"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  # What the build and the phases need, as this machine has it (a failed build names its cause here).
  local have=()
  for c in nvcc cmake mpicxx mpirun pkg-config ncu compute-sanitizer; do
    command -v $c > /dev/null && have+=("$c") || have+=("$c:MISSING")
  done
  for m in tomlplusplus sentencepiece; do pkg-config --exists $m 2> /dev/null && have+=("$m") || have+=("$m:from-.gpudeps"); done
  local name pattern
  for name in openblas:/usr/include/x86_64-linux-gnu/openblas*/cblas.h gtest:/usr/include/gtest/gtest.h \
              nlohmann-json:/usr/include/nlohmann/json.hpp nccl.h:/usr/local/cuda/include/nccl.h; do
    pattern=${name#*:} name=${name%%:*}
    compgen -G "$pattern" > /dev/null && have+=("$name") || have+=("$name:MISSING")
  done
  echo "machine: ${have[*]}; $("$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
  local targets="meshtrain bench_gpu_step bench_gpu_attention $(cd tests && ls test_cuda_*.cpp mpi_test_cuda_*.cpp | sed 's/\.cpp$//' | tr '\n' ' ')"
  if ! GPU_BUILD_TARGETS="$targets" timeout $((budget - 30)) bash scripts/gpu_build.sh build-gpu > "$logs/build.log" 2>&1; then
    tail -40 "$logs/build.log"
    echo "build: FAILED after $SECONDS s"
    return 1
  fi
  echo "build: $SECONDS s"
  for p in "${phases[@]}"; do
    left=$((budget - SECONDS - 10))  # 10 s to pack the logs
    if ((left < min_s[$p])); then
      echo "== $p: not started: $left s left of the budget, it needs about ${min_s[$p]}"
      status=1
      continue
    fi
    cap=$((left < share_s[$p] ? left : share_s[$p]))
    echo "== $p (at most $cap s)"
    local t0=$SECONDS
    timeout -k 5 $cap bash "$self" --phase "$p" "$logs" "$cap"
    local rc=$?
    if [[ $p == tests ]]; then
      phase_left=$cap report_tests || ((rc == 124 || rc == 137)) || rc=1
    fi
    if ((rc == 124 || rc == 137)); then
      echo "== $p: STOPPED after $((SECONDS - t0)) s (its share); what it finished is above"
    else
      echo "== $p: $( ((rc == 0)) && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
    fi
    ((rc == 0)) || status=1
  done
  echo "gpu_check: $SECONDS s in all; logs in $logs${OUT:+ and $OUT/logs.tar.gz}"
  return $status
}

main 2>&1 | tee "$logs/summary.txt"
status=${PIPESTATUS[0]}
if [[ -n ${OUT:-} ]]; then
  cp "$logs/summary.txt" "$OUT/"
  tar czf "$OUT/logs.tar.gz" -C "$logs" .
fi
exit "$status"
