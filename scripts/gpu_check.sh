#!/usr/bin/env bash
# On the GPU machine: build (scripts/gpu_build.sh), run every CUDA test program, bf16
# training against Hugging Face transformers (tests/parity/run_hf_gpu.py), then the GPT-2
# benchmark beside PyTorch (bench/gpu.sh) and meshtrain's step per op. Logs go to $OUT (or ./gpu-check) so that they
# survive the machine. $PYTHON (default python3 on the PATH) must have torch and transformers.
#
#   bash scripts/gpu_check.sh [tests|train|hf|bench|all]     # default all
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
exit $status
