"""The PyTorch peer of bench_gpu_attention: causal scaled_dot_product_attention in bf16 with
the flash backend, forward and backward, at the same shapes (B 8, 12 heads, T 1024, D 64
and B 2, 16 heads, T 2048, D 128), on q, k, v laid out as meshtrain's model lays them
([B, T, heads, D] views of one q|k|v row, as GPT-2's c_attn output transposed).

    python3 bench/gpu_attention_torch.py [--reps 20] [--warmup 3]

Prints one JSON line per shape and pass in bench_gpu_attention's format ("kernels":
"torch_sdpa_flash"): the median of --reps calls timed with CUDA events, TFLOP/s with the
same causal FLOP count (forward 4 B NH T^2 D / 2, backward 2.5x that). The backward is
torch.autograd.grad of the output against q, k, v (flash attention's backward kernels).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(1234)
    dev = torch.device("cuda")
    for B, NH, T, D in ((8, 12, 1024, 64), (2, 16, 2048, 128)):
        # one [B, T, 3 NH D] row per token, split and transposed to [B, NH, T, D] views
        qkv = torch.empty(B, T, 3 * NH * D, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
        q, k, v = (t.view(B, T, NH, D).transpose(1, 2).requires_grad_() for t in qkv.split(NH * D, dim=2))
        dout = torch.empty(B, NH, T, D, device=dev, dtype=torch.bfloat16).uniform_(-1, 1)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), a.reps, a.warmup)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), a.reps, a.warmup)
        fwd_flops = 4.0 * B * NH * T * T * D / 2
        for name, ms, flops in (("forward", fwd, fwd_flops), ("backward", bwd, 2.5 * fwd_flops)):
            print(json.dumps({"bench": "gpu_attention", "device": torch.cuda.get_device_name(), "kernels":
                              "torch_sdpa_flash", "pass": name, "B": B, "NH": NH, "NKV": NH, "T": T, "D": D,
                              "ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 2)}), flush=True)


if __name__ == "__main__":
    main()
