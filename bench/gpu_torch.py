"""The PyTorch peer of bench_gpu_step: the same GPT-2 model,
batch and step on one GPU, in bf16 autocast with fused AdamW and flash attention
(scaled_dot_product_attention), eager and under torch.compile.

    python3 bench/gpu_torch.py [--layers 12] [--d-model 768] [--heads 12] [--seq 1024]
                               [--vocab 50304] [--batch 8] [--steps 20] [--warmup 5] [--modes eager,compile]

Prints one JSON line per mode: median step ms, tokens/s, MFU (the formula of
bench_gpu_step: 6 N + 6 L T C FLOPs per token over --peak-tflops) and peak memory.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.NH = NH

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, C, NH, T, V):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        # meshtrain's initialisation (GPT-2's): weights N(0, 0.02), the two residual
        # projections N(0, 0.02 / sqrt(2 L)), positions N(0, 0.01), biases 0, norm weights 1.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                proj = name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight")
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * L) if proj else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.wpe.weight, std=0.01)  # learned positions: N(0, 0.01)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def run(mode, a):
    torch.manual_seed(0)
    model = GPT(a.layers, a.d_model, a.heads, a.seq, a.vocab).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_model = torch.compile(model) if mode == "compile" else model
    g = torch.Generator().manual_seed(42)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).cuda()
    tgt = torch.roll(idx.view(-1), -1).view(a.batch, a.seq)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for s in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step = sorted(times)[len(times) // 2]
    tokens_s = a.batch * a.seq / step
    flops = 6.0 * n_params + 6.0 * a.layers * a.seq * a.d_model
    return {"peer": "torch " + mode, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
            "params": n_params, "batch": a.batch, "seq": a.seq, "step_ms": round(step * 1e3, 3),
            "tokens_per_s": round(tokens_s), "mfu": round(flops * tokens_s / (a.peak_tflops * 1e12), 4),
            "peak_bytes": torch.cuda.max_memory_allocated(), "first_loss": round(losses[0], 4),
            "last_loss": round(losses[-1], 4)}


def main():
    p = argparse.ArgumentParser()
    for k, d in [("layers", 12), ("d-model", 768), ("heads", 12), ("seq", 1024), ("vocab", 50304), ("batch", 8),
                 ("steps", 20), ("warmup", 5)]:
        p.add_argument("--" + k, type=int, default=d)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--modes", default="eager,compile")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for mode in a.modes.split(","):
        print(json.dumps(run(mode, a)), flush=True)


if __name__ == "__main__":
    main()
