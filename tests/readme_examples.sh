#!/usr/bin/env bash
# Runs every command of README.md's ```sh blocks, in README order, in a temporary directory
# where ./build/meshtrain and configs/ are the ones under test. Training commands get a few
# steps (overrides appended to the README's command: the last value of a key wins) and a
# small generated corpus; commands that need other machines or Slurm are skipped with the
# reason. The test fails on a README command this script does not list, and on a listed
# command the README no longer has, so the two stay in step.
#
#   bash tests/readme_examples.sh BUILD_DIR/meshtrain SOURCE_DIR
set -euo pipefail
bin=$(realpath "$1")
src=$(realpath "$2")
work=$(mktemp -d /tmp/meshtrain-readme-XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
mkdir build
ln -s "$bin" build/meshtrain
ln -s "$src/configs" configs
# mpirun started directly runs as root only with these (meshtrain launch passes
# --allow-run-as-root itself), and puts 4 ranks on fewer cores only when allowed to. Its
# session directory is this script's own, as launch gives each of its mpiruns one: mpiruns
# of other tests sharing /tmp/ompi.<host>.<uid> can race there (cli/launch.cpp).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_orte_tmpdir_base="$work/mpirun"

fail() {
  echo "readme_examples: FAILED: $*" >&2
  exit 1
}

# One command per line: continuation lines joined, comments and blank lines dropped.
mapfile -t commands < <(awk '
  /^```sh$/ { inside = 1; next }
  /^```/ { inside = 0; next }
  inside {
    line = $0
    sub(/[ \t]+#.*$/, "", line)
    if (line ~ /^[ \t]*(#.*)?$/) next
    if (sub(/[ \t]*\\$/, " ", line)) { pending = pending line; next }
    line = pending line
    pending = ""
    gsub(/[ \t]+/, " ", line)
    sub(/^ /, "", line)
    sub(/ $/, "", line)
    print line
  }' "$src/README.md")
((${#commands[@]} > 0)) || fail "found no commands in $src/README.md"

n=0
run() {  # runs a command line (README quoting kept) and fails with its output if it fails
  n=$((n + 1))
  echo "+ $1"
  eval "$1" > "log.$n" 2>&1 || { cat "log.$n"; fail "$1"; }
}
skip() { echo "- skipped: $cmd ($1)"; }
# A GPU command: runs small where a GPU is, else must stop with the message that says why.
gpu_or_clear_error() {
  n=$((n + 1))
  echo "+ $cmd"
  eval "$cmd $few" > "log.$n" 2>&1 && return
  grep -q -e "no GPU is visible" -e "built without CUDA" "log.$n" || { cat "log.$n"; fail "$cmd"; }
  echo "  (no GPU here: $(tail -1 "log.$n"))"
}

# A text of made-up words, enough for `prepare` to train an 8192-piece SentencePiece model.
corpus() {
  /usr/bin/python3 -c '
import random
r = random.Random(1)
syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "st"]
words = ["".join(r.choice(syllables) for _ in range(r.randint(1, 4))) for _ in range(20000)]
for _ in range(6000):
    print(" ".join(r.choice(words) for _ in range(r.randint(5, 15))) + ".")'
}

# The preemption example: the run in the background is signalled once it has logged a step.
started() {
  echo "+ $cmd"
  eval "$cmd" > background.log 2>&1
  for _ in $(seq 600); do
    grep -q "^step 1/" background.log && return
    sleep 0.2
  done
  cat background.log
  fail "no step logged within 2 minutes: $cmd"
}
stopped() {
  echo "+ $cmd"
  eval "$cmd"
  local status=0
  wait "$pid" || status=$?
  grep -q -- "--checkpoint.resume=true" background.log || { cat background.log; fail "no resume hint after $cmd"; }
  [ "$status" = 75 ] || { cat background.log; fail "exit status $status, not 75, after $cmd"; }
}

few="--training.steps=2 --training.val_batches=1"
# configs/gpt2_bench.toml's model, smaller (same vocabulary): a step in milliseconds.
small="--model.n_layer=1 --model.d_model=64 --model.n_head=2 --model.seq_len=32 --training.global_batch=4"
small+=" --training.micro_batch=4 --training.val_batches=1"
declare -A how=(
  ["bash scripts/train.sh"]='skip "setup.sh installs packages and rebuilds build/, the tree under test"
                             run "./build/meshtrain train $few"  # what train.sh runs then'
  ["bash scripts/test.sh"]='skip "it runs the whole suite, this test included"'
  ["./build/meshtrain train --config configs/llama_tasks.toml --training.steps=200"]='run "$cmd $few"'
  ["./build/meshtrain prepare --input corpus.txt --out train.bin --val-fraction 0.05 --val-out val.bin --train-tokenizer 8192 --tokenizer-prefix spm"]='corpus > corpus.txt
    run "$cmd"'
  ["./build/meshtrain train --config configs/gpt2_bench.toml --data.path=train.bin --data.val_path=val.bin --data.tokenizer=spm.model"]='run "$cmd $small --training.steps=2"'
  ["./build/meshtrain train --config configs/gpt2_bench.toml --data.path=train.bin --checkpoint.resume=true --data.tokenizer=spm.model"]='run "$cmd $small --training.steps=3"'
  ["./build/meshtrain export --checkpoint runs/gpt2_bench --out model.safetensors"]='run "$cmd"'
  ["./build/meshtrain export --checkpoint runs/gpt2_bench --out gpt2_hf/"]='run "$cmd"
    [ -s gpt2_hf/config.json ] && [ -s gpt2_hf/model.safetensors ] || fail "no config.json and model.safetensors from: $cmd"'
  ["./build/meshtrain checkpoint info runs/gpt2_bench"]='run "$cmd"'
  ['./build/meshtrain sample --checkpoint runs/gpt2_bench --prompt "Once upon" --tokens 100']='run "$cmd"'
  ["./build/meshtrain train --help"]='run "$cmd"'
  ["./build/meshtrain launch -n 2 train --training.global_batch=32"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 8 --hostfile hosts train --config run.toml"]='skip "needs the other machines of a hostfile"'
  ["mpirun -n 4 ./build/meshtrain train --parallel.dp=4"]='run "$cmd $few"'
  ["srun -N 2 --ntasks-per-node=4 ./build/meshtrain train --config run.toml"]='skip "needs Slurm"'
  ["./build/meshtrain launch -n 2 bench comm"]='run "$cmd --max-bytes 64K --iters 2"'
  ["./build/meshtrain launch -n 4 train --parallel.hierarchical=true --parallel.ranks_per_node=2"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 2 train --parallel.grad_compression=int8"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 2 train --parallel.grad_compression=powersgd --parallel.powersgd_rank=4"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 4 train --parallel.hierarchical=true --parallel.ranks_per_node=2 --parallel.grad_compression=int8"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 4 train --parallel.sharding=HYBRID_SHARD --parallel.shard_group=2 --parallel.grad_compression=powersgd"]='run "$cmd $few"'
  ['./build/meshtrain train --config configs/llama_tasks.toml --checkpoint.dir=runs/llama & pid=$!']='started'
  ['kill -TERM $pid']='stopped'
  ["./build/meshtrain train --config configs/llama_tasks.toml --checkpoint.dir=runs/llama --checkpoint.resume=true"]='run "$cmd --training.steps=3 --training.val_batches=1"'
  ["./build/meshtrain checkpoint info runs/llama"]='run "$cmd"'
  ["./build/meshtrain launch -n 4 train --config configs/llama_tasks.toml --checkpoint.dir=runs/llama --checkpoint.resume=true"]='run "$cmd --training.steps=8 --training.val_batches=1"
    grep -q "training.micro_batch = 16 does not fit this layout" "log.$n" || { cat "log.$n"; fail "no micro-batch note from: $cmd"; }'
  ["srun ./build/meshtrain train --config run.toml --checkpoint.resume=true"]='skip "needs Slurm"'
  ['status=$?']='skip "needs Slurm (the batch script above)"'
  ['[ $status -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"']='skip "needs Slurm"'
  ['exit $status']='skip "needs Slurm (the batch script above)"'
  ["./build/meshtrain launch -n 4 train --parallel.zero=3"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 4 train --parallel.sharding=HYBRID_SHARD --parallel.shard_group=2"]='run "$cmd $few"'
  ["./build/meshtrain train --training.precision=bf16"]='run "$cmd $few"'
  ["./build/meshtrain train --training.device=cuda --training.precision=bf16"]='gpu_or_clear_error'
  ["bash scripts/gpu_deps.sh"]='skip "downloads packages for a GPU machine"'
  ["bash scripts/gpu_build.sh"]='skip "builds a second tree for a GPU machine (the CUDA code is built in build/ already)"'
  ["bash scripts/gpu_check.sh"]='skip "needs a GPU"'
  ["bash bench/gpu.sh"]='skip "needs a GPU and PyTorch with CUDA"'
  ["./build/meshtrain launch -n 2 train --training.precision=fp16 --parallel.zero=2"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 2 train --training.precision=bf16 --training.grad_dtype=bf16 --parallel.zero=1"]='run "$cmd $few"'
  ["./build/meshtrain train --training.skip_spikes=6 --training.max_skips=5"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 2 train --parallel.tp=2"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 4 train --parallel.tp=2 --parallel.zero=1 --parallel.sequence_parallel=true"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 4 train --parallel.pp=4 --parallel.pp_schedule=zb-h1 --logging.trace=pp.json"]='run "$cmd $few"
    [ -s pp.json ] && [ -s pp.json.svg ] || fail "no trace from: $cmd"'
  ["./build/meshtrain launch -n 4 train --parallel.pp=2 --parallel.zero=1 --parallel.pp_schedule=interleaved"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 2 train --logging.profile=true --logging.trace=profile.json"]='run "$cmd $few"
    grep -q "other (unprofiled)" "log.$n" && [ -s profile.json ] || { cat "log.$n"; fail "no profile from: $cmd"; }'
  ["./build/meshtrain launch -n 2 train --parallel.cp=2"]='run "$cmd $few"'
  ["./build/meshtrain launch -n 8 train --parallel.tp=2 --parallel.cp=2 --parallel.pp=2 --training.micro_batch=1"]='run "$cmd $few"'
  ["./build/meshtrain schedule --pp 4 --microbatches 8 --schedule zb-h1"]='run "$cmd"'
  ["./build/meshtrain plan --config configs/gpt2_124m.toml --gpus 64 --hardware h100 --global-batch 512"]='run "$cmd"'
  ["./build/meshtrain plan --config configs/gpt2_124m.toml --gpus 64 --hardware h100 --layout tp=2,pp=4 --svg plan.svg"]='run "$cmd"
    [ -s plan.svg ] || fail "no picture from: $cmd"'
  ["./build/meshtrain launch -n 2 bench profile --out hardware_profile.toml"]='run "$cmd --seconds 2"'
  ["./build/meshtrain train --logging.hardware=hardware_profile.toml"]='run "$cmd $few"
    grep -q "planner, step time" "log.$n" || fail "no step-time prediction from: $cmd"'
  ["./build/meshtrain schedule --pp 4 --microbatches 8 --compare --svg schedules.svg"]='run "$cmd"
    [ -s schedules.svg ] || fail "no picture from: $cmd"'
  ["./build/meshtrain schedule --pp 4 --microbatches 8 --schedule 1f1b --csv my.csv"]='run "$cmd"'
  ["./build/meshtrain schedule --schedule file:my.csv --json"]='run "$cmd"'
  ["./build/meshtrain launch -n 2 train --optim.name=lamb --optim.lr=0.01 --parallel.zero=3"]='run "$cmd $few"'
  ["./build/meshtrain train --optim.name=lars --optim.lr=1 --optim.trust_coef=0.01 --optim.lr_base_batch=8"]='run "$cmd $few"
    grep -q "optim: lars, lr 2 (optim.lr 1 x global batch 16 / optim.lr_base_batch 8, linear scaling rule)" "log.$n" ||
      { cat "log.$n"; fail "no scaled learning rate from: $cmd"; }'
)

for cmd in "${commands[@]}"; do
  [ -n "${how[$cmd]+set}" ] || fail "README.md has a command this script does not know:
  $cmd
add it to the list in tests/readme_examples.sh: how to run it small, or why it is skipped"
done
for cmd in "${!how[@]}"; do
  printf '%s\n' "${commands[@]}" | grep -xF -- "$cmd" > /dev/null ||  # not -q: an early exit would end printf with SIGPIPE under pipefail
    fail "tests/readme_examples.sh lists a command README.md no longer has: $cmd"
done
for cmd in "${commands[@]}"; do eval "${how[$cmd]}"; done
echo "readme_examples: all ${#commands[@]} README commands run or skipped with a reason"
