"""Where a GPU step's time goes, per kernel: reads the CSV that
`ncu --csv --metrics gpu__time_duration.sum` printed for some steps of bench_gpu_step
(scripts/gpu_check.sh ncu) and prints each kernel's GPU time per step, largest first, with
its launches per step and share, then the time per group of kernels and their sum.

    python3 bench/ncu_kernels.py NCU_CSV --steps N [--top 30] [--step-ms MS]

--steps: how many steps the CSV covers (the profiler range of bench_gpu_step: its timed
steps). --step-ms: the step as measured without the profiler (bench_gpu_step's step_ms):
the table then says how much of it the GPU spent in kernels and how much it sat idle
(waiting for the host: launches, synchronisations).
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

# GPU time unit -> milliseconds
UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}

# Groups, first match wins: (name, pattern on the kernel's function name)
GROUPS = [
    ("products (cuBLASLt)", r"gemm|xmma|nvjet|cutlass|cublas"),
    ("attention backward", r"attention.*(dkv|dq|delta|backward)"),
    ("attention forward", r"attention"),
    ("norms", r"norm"),
    ("loss", r"cross_entropy|loss"),
    ("optimizer", r"adamw|sgd|lamb|lars|sumsq|sum_parts|clip"),
    ("bias column sums", r"column_sum"),
    ("embedding", r"embedding"),
    ("GELU / SwiGLU / RoPE", r"gelu|swiglu|rope"),
    ("conversion and rounding", r"convert|round|widen|narrow|cast|store"),
    ("copies and fills", r"copy|fill|memset|zero|scale|add"),
]


def function_name(kernel):
    """The kernel's function name: no return type, template arguments or parameters."""
    name = kernel.replace("(anonymous namespace)", "").split("(")[0]
    depth, base = 0, ""
    for ch in name:  # drop template arguments, nested or not
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            base += ch
    return base.split()[-1].split("::")[-1] if base.split() else kernel


def read_rows(path):
    """The CSV rows of gpu__time_duration: (kernel, milliseconds). Lines before ncu's header
    (the program's own output, ncu's ==PROF== lines) are skipped."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"ncu_kernels: no ncu CSV header (\"ID\",...) in {path}")
    rows = []
    for r in csv.DictReader(l for l in lines[start:] if l.startswith('"')):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNITS.get(r.get("Metric Unit", "nsecond"))
        if unit is None:
            sys.exit(f"ncu_kernels: unknown time unit {r.get('Metric Unit')!r}")
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * unit))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--step-ms", type=float, default=0.0)
    a = ap.parse_args()
    rows = read_rows(a.csv)
    if not rows:
        sys.exit("ncu_kernels: no kernel in the profile (was the profiler range reached?)")
    per_kernel = defaultdict(lambda: [0, 0.0])  # function name -> [launches, ms]
    for kernel, ms in rows:
        k = per_kernel[function_name(kernel)]
        k[0] += 1
        k[1] += ms
    total = sum(ms for _, ms in rows) / a.steps
    print(f"{len(rows) / a.steps:.0f} kernels per step, {total:.3f} ms of GPU time per step")
    print(f"{'kernel':58s}{'launches':>10s}{'ms/step':>10s}{'share':>8s}")
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
    for name, (n, ms) in ranked[: a.top]:
        print(f"{name[:57]:58s}{n / a.steps:10.1f}{ms / a.steps:10.3f}{100 * ms / a.steps / total:7.1f}%")
    rest = ranked[a.top :]
    if rest:
        ms = sum(v[1] for _, v in rest) / a.steps
        print(f"{f'({len(rest)} other kernels)':58s}{'':10s}{ms:10.3f}{100 * ms / total:7.1f}%")
    groups = defaultdict(float)
    for name, (_, ms) in per_kernel.items():
        g = next((g for g, pat in GROUPS if re.search(pat, name, re.IGNORECASE)), "other")
        groups[g] += ms / a.steps
    print(f"\n{'group':58s}{'':10s}{'ms/step':>10s}{'share':>8s}")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{g:58s}{'':10s}{ms:10.3f}{100 * ms / total:7.1f}%")
    if a.step_ms > 0:
        idle = a.step_ms - total
        print(f"\nstep {a.step_ms:.3f} ms measured without the profiler: kernels {total:.3f} ms "
              f"({100 * total / a.step_ms:.1f}%), the GPU idle {idle:.3f} ms ({100 * idle / a.step_ms:.1f}%)")


if __name__ == "__main__":
    main()
