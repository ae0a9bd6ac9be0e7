# The options of the one-step benchmarks (bench/core.sh, bench/bf16.sh), sourced from the
# repository root with the script's arguments: --threads N (default: every core), --steps K
# (timed steps, default 5), --model gpt2|llama (default gpt2). Then builds what is missing
# and sets OMP_NUM_THREADS.
threads=$(nproc) steps=5 model=gpt2
while (($#)); do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
bash scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/same_kernels.sh"
export OMP_NUM_THREADS=$threads
