#!/usr/bin/env bash
# On the GPU machine: build (scripts/gpu_build.sh), run every CUDA test program, bf16
# training against Hugging Face transformers (tests/parity/run_hf_gpu.py), then the GPT-2
# benchmark beside PyTorch (bench/gpu.sh) and meshtrain's step per op. Logs go to $OUT (or
# ./gpu-check) so that they survive the machine. $PYTHON (default python3 on the PATH) must
# have torch and transformers.
#
#   bash scripts/gpu_check.sh [tests|train|hf|bench|all]     # default all (these four)
#   bash scripts/gpu_check.sh sanitize   # compute-sanitizer over the op tests
#   bash scripts/gpu_check.sh ncu        # Nsight Compute: the step per kernel, attention's counters
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${OUT:-gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
start=$(date +%s)
targets="meshtrain bench_gpu_step bench_gpu_attention $(cd tests && ls test_cuda_*.cpp mpi_test_cuda_*.cpp | sed 's/\.cpp$//' | tr '\n' ' ')"
if ! GPU_BUILD_TARGETS="$targets" bash scripts/gpu_build.sh build-gpu > "$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
status=0
if [[ $what == tests || $what == all ]]; then
  # The test programs run four at a time (each takes a little of the GPU); their results
  # print in order once all are done. A program that fails reruns its failed tests (all of
  # them if it crashed before naming any) with the mma.sync attention kernels, then the GELU
  # fusions, switched off: one run says whether either of those broke them.
  progs=()
  for t in build-gpu/tests/test_cuda_*; do [[ -f $t && -x $t && $t != *.cmake ]] && progs+=("$t"); done
  for t in "${progs[@]}"; do
    while (($(jobs -rp | wc -l) >= 4)); do wait -n; done
    name=$(basename "$t")
    ( "$t" --gtest_brief=1 > "$out/$name.log" 2>&1; echo $? > "$out/$name.rc" ) &
  done
  wait
  for t in "${progs[@]}"; do
    name=$(basename "$t")
    if [[ $(cat "$out/$name.rc") == 0 ]]; then
      echo "$name: $(grep -E '^\[  PASSED  \]' "$out/$name.log")"
      continue
    fi
    status=1
    echo "$name: FAILED"
    grep -E "Failure|error|Expected|Which is|actual|got|FAILED|mt::Error|what\(\)" "$out/$name.log" | head -40
    failed=$(grep -oE '^\[  FAILED  \] [A-Za-z0-9_/.]+\.[A-Za-z0-9_/]+' "$out/$name.log" | awk '{print $4}' | sort -u | paste -sd:)
    for switch in MESHTRAIN_ATTENTION_KERNEL=wmma MESHTRAIN_FUSED_GELU=off; do
      if env "$switch" "$t" --gtest_brief=1 --gtest_filter="${failed:-*}" > "$out/$name.${switch%%=*}.log" 2>&1; then
        echo "  with $switch: the failed tests pass"
      else
        echo "  with $switch: still failing: $(grep -oE '^\[  FAILED  \] [A-Za-z0-9_/.]+\.[A-Za-z0-9_/]+' \
          "$out/$name.${switch%%=*}.log" | awk '{print $4}' | sort -u | paste -sd' ')"
      fi
    done
  done
  # The communicator's collectives on GPU tensors: ranks sharing the GPU, and NCCL where the
  # machine has a GPU per rank (as root there: OMPI_ALLOW_RUN_AS_ROOT=1
  # OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1).
  for t in build-gpu/tests/mpi_test_cuda_*; do
    [[ -f $t && -x $t ]] || continue
    for n in 2 4; do
      name=$(basename "$t")_n$n
      if mpirun --oversubscribe -n $n "$t" > "$out/$name.log" 2>&1; then
        # NCCL's tests need a GPU per rank: say when they skipped, and why
        echo "$name: passed$(grep -A1 -m1 ': Skipped' "$out/$name.log" | tail -1 | sed 's/^./ (skipped: &/; s/$/)/')"
      else
        status=1
        echo "$name: FAILED"
        grep -E "Failure|error|Expected|Which is|FAILED|mt::Error" "$out/$name.log" | head -20
      fi
    done
  done
fi
if [[ $what == train || $what == all ]]; then
  # The built-in tasks on the GPU and on the CPU: the same losses step by step (fp32).
  for dev in cuda cpu; do
    build-gpu/meshtrain train --training.device=$dev --training.steps=30 --logging.progress=off \
      --logging.metrics="$out/train_$dev.jsonl" > "$out/train_$dev.log" 2>&1 || { status=1; tail -5 "$out/train_$dev.log"; }
  done
  python3 - "$out" <<'PY' || status=1
import json, sys
d = sys.argv[1]
rows = {dev: [json.loads(l) for l in open(f"{d}/train_{dev}.jsonl") if '"loss"' in l and '"event"' not in l] for dev in ("cuda", "cpu")}
diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rows["cuda"], rows["cpu"]))
print(f"train: {len(rows['cuda'])} steps, loss {rows['cuda'][0]['loss']:.4f} -> {rows['cuda'][-1]['loss']:.4f} on the GPU, "
      f"largest relative difference from the CPU run {diff:.2e}; step {rows['cuda'][-1]['step_ms']:.1f} ms (GPU) "
      f"vs {rows['cpu'][-1]['step_ms']:.1f} ms (CPU)")
sys.exit(0 if diff < 1e-3 else 1)
PY
fi
if [[ $what == hf || $what == all ]]; then
  # GPT-2 and Llama in bf16 on the GPU: meshtrain against transformers' models (and the
  # reference model) under torch.autocast, per-step losses and final parameters.
  "${PYTHON:-python3}" tests/parity/run_hf_gpu.py --meshtrain build-gpu/meshtrain --device cuda --impl both \
    > "$out/hf.log" 2>&1
  rc=$?
  grep -E "^(transformers|torch) |^===|fp32 on the CPU, first|loss max|  (mt|hf|torch) .* vs |last/first|: (PASS|FAIL)" "$out/hf.log"
  if [[ $rc != 0 ]]; then status=1; echo "hf: FAILED (exit $rc), the log's end:"; tail -25 "$out/hf.log"; fi
fi
if [[ $what == bench || $what == all ]]; then
  build-gpu/bench/bench_gpu_attention 2>&1 | tee "$out/attention.log"
  python3 bench/gpu_attention_torch.py 2>&1 | tee -a "$out/attention.log"  # the peer, same shapes
  bash bench/gpu.sh build-gpu 2>&1 | tee "$out/bench.log" | tail -8
  # Where meshtrain's step goes, per op: each launch waits for its kernel, so the times are
  # GPU times (the step itself is slower so).
  CUDA_LAUNCH_BLOCKING=1 build-gpu/bench/bench_gpu_step --profile 1 --steps 5 2>&1 >/dev/null |
    tee "$out/profile.txt" | head -25
  # The same without waiting: each op's time is then the host's cost of queueing it (and the
  # waits for results), its step time the real one; a step near the sum of these host times
  # is bound by the host, not the GPU.
  build-gpu/bench/bench_gpu_step --profile 1 --steps 5 2>&1 >/dev/null | tee "$out/profile_host.txt" | head -12
  # The attention kernels' share: the step with the WMMA kernels, then with the mma.sync ones.
  for k in wmma ""; do
    echo "MESHTRAIN_ATTENTION_KERNEL=${k:-(unset)}: $(MESHTRAIN_ATTENTION_KERNEL=$k build-gpu/bench/bench_gpu_step \
      --precision bf16 --steps 10 2>/dev/null)"
  done | tee "$out/attention_ab.txt"
  # The GELU fusions' share: the same step with them off (MESHTRAIN_FUSED_GELU=off), then on.
  for fused in off on; do
    echo "MESHTRAIN_FUSED_GELU=$fused: $(MESHTRAIN_FUSED_GELU=$fused build-gpu/bench/bench_gpu_step --precision bf16 \
      --steps 10 2>/dev/null)"
  done | tee "$out/fusion_ab.txt"
fi
if [[ $what == sanitize ]]; then
  # compute-sanitizer over the op tests, all at once (each under a time limit, as the tools
  # slow kernels down many times): memcheck (out-of-bounds and misaligned accesses, errors
  # of the API) over every op's tests; racecheck (shared-memory hazards) and synccheck
  # (barriers) over the attention kernels, whose tiles are shared. A tool that reports
  # errors prints its first ones; "timed out" means no error was seen in the part it ran.
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [[ -x $cs ]] || { echo "sanitize: compute-sanitizer not found"; exit 1; }
  runs=()
  for p in runtime linear pointwise loss_optim attention attention_tc block model; do runs+=("memcheck test_cuda_$p *"); done
  for tool in racecheck synccheck; do runs+=("$tool test_cuda_attention_tc CudaAttentionTc.Mma*:CudaAttentionTc.SixteenBit*"); done
  for r in "${runs[@]}"; do
    read -r tool prog filter <<< "$r"
    ( timeout "${SANITIZE_LIMIT_S:-420}" "$cs" --tool "$tool" --error-exitcode 97 --print-limit 10 \
        "build-gpu/tests/$prog" --gtest_filter="$filter" > "$out/sanitize_${tool}_$prog.log" 2>&1
      echo $? > "$out/sanitize_${tool}_$prog.rc" ) &
  done
  wait
  for r in "${runs[@]}"; do
    read -r tool prog filter <<< "$r"
    log=$out/sanitize_${tool}_$prog.log
    case $(cat "$out/sanitize_${tool}_$prog.rc") in
      0) echo "$tool $prog: clean ($(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log"))" ;;
      124) echo "$tool $prog: timed out after ${SANITIZE_LIMIT_S:-420} s, no error before ($(grep -c '^\[       OK' "$log") tests done)" ;;
      97) status=1; echo "$tool $prog: ERRORS"; grep -E -m 12 "^========= (Invalid|Error|Race|Barrier|Program hit|    at|Address)" "$log" ;;
      *) status=1; echo "$tool $prog: the tests failed under the tool"; grep -E -m 8 "FAILED|Failure|mt::Error" "$log" ;;
    esac
  done
fi
if [[ $what == ncu ]]; then
  # Nsight Compute (--clock-control none: the clocks as the benchmark runs them).
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [[ -x $ncu ]] || { echo "ncu: Nsight Compute not found"; exit 1; }
  # 1. The bf16 step per kernel: GPU time of every kernel of 3 timed steps (bench_gpu_step's
  #    profiler range), beside the step measured without the profiler; what the kernels do
  #    not fill is time the GPU waits for the host.
  step_ms=$(build-gpu/bench/bench_gpu_step --precision bf16 --steps 10 2>/dev/null |
    python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["step_ms"])')
  "$ncu" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base \
    build-gpu/bench/bench_gpu_step --precision bf16 --steps 3 --warmup 2 > "$out/ncu_step.csv" 2> "$out/ncu_step.log" ||
    { status=1; echo "ncu step: failed"; tail -5 "$out/ncu_step.log"; }
  python3 bench/ncu_kernels.py "$out/ncu_step.csv" --steps 3 --step-ms "$step_ms" | tee "$out/ncu_step.txt" || status=1
  # 2. The mma.sync attention kernels (forward, dK/dV, dQ at D 64 then 128, one call each),
  #    every section: throughputs, occupancy, stall reasons, shared-memory bank conflicts and
  #    the source lines that stall; then their one-line digest.
  "$ncu" --clock-control none --set full -k regex:attention_mma --launch-count 6 \
    build-gpu/bench/bench_gpu_attention --reps 1 --warmup 0 > "$out/ncu_attention.txt" 2>&1 ||
    { status=1; echo "ncu attention: failed"; tail -5 "$out/ncu_attention.txt"; }
  grep -E "attention_mma_[a-z]+_kernel|^ +(Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per Thread|Issue Slots Busy|L1/TEX Hit Rate) " \
    "$out/ncu_attention.txt" | sed -E 's/>\(.*/>/' | tee "$out/ncu_attention_digest.txt"
fi
exit $status
