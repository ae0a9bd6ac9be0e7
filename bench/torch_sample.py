#!/usr/bin/python3
"""PyTorch side of meshtrain's generation benchmark (bench/sample.sh): GPT-2 on CPU, eager,
float32, with a key/value cache, sampling as `meshtrain sample` does (temperature 0.8,
top-k 40).

    /usr/bin/python3 bench/torch_sample.py --threads 2 --prompt-tokens 64 --tokens 256

The model is tests/parity/torch_model.py's GPT-2 (random weights, configs/gpt2_124m.toml's
shapes by default); generation reuses its modules. The prompt's forward writes every
layer's keys and values into a cache of seq_len rows; each new token then runs one row
through the blocks, attending to the cached rows.

Also measures the machine's memory read bandwidth (the best of 5 sums of a 1 GiB float32
tensor, same threads): a new token reads every weight once (4 bytes each), so
bandwidth / (4 x parameters) bounds the tokens per second of any fp32 implementation.

Prints one JSON line: impl, threads, params, prompt_tokens, tokens, prompt_s,
tokens_per_s (the tokens after the first, which the prompt's forward gives),
read_gb_per_s, ceiling_tokens_per_s, torch, blas.
"""
import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import torch_model as tm  # noqa: E402
from torch_step import blas_kernels  # noqa: E402


def read_bandwidth():
    """Bytes per second of summing a 1 GiB float32 tensor (the best of 5)."""
    x = torch.ones(256 * 1024 * 1024)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


class Cached:
    """GPT-2 forward over new rows at positions pos .. pos + n - 1, keys and values cached."""

    def __init__(self, model):
        self.m = model
        c = model.cfg
        self.H, self.C, self.T = c["n_head"], c["d_model"], c["seq_len"]
        D = self.C // self.H
        self.k = torch.zeros(c["n_layer"], self.H, self.T, D)  # [L, H, T, D]
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def next_logits(self, idx):
        """idx [n] int64 -> the logits [V] of the token after them."""
        tr, n, p, H, C = self.m.transformer, idx.numel(), self.length, self.H, self.C
        D = C // H
        x = tr.wte(idx) + tr.wpe(torch.arange(p, p + n))  # [n, C]
        # query row i (position p + i) sees keys 0 .. p + i
        mask = torch.ones(n, p + n, dtype=torch.bool).triu(p + 1) if n > 1 else None
        for l, blk in enumerate(tr.h):
            q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(C, dim=-1)  # [n, C] each
            self.k[l, :, p:p + n] = k.view(n, H, D).transpose(0, 1)
            self.v[l, :, p:p + n] = v.view(n, H, D).transpose(0, 1)
            att = (q.view(n, H, D).transpose(0, 1) @ self.k[l, :, :p + n].transpose(1, 2)) / math.sqrt(D)
            if mask is not None:
                att = att.masked_fill(mask, float("-inf"))
            y = att.softmax(dim=-1) @ self.v[l, :, :p + n]  # [H, n, D]
            x = x + blk.attn.c_proj(y.transpose(0, 1).reshape(n, C))
            x = x + blk.mlp(blk.ln_2(x))
        self.length += n
        return tr.ln_f(x[-1]) @ tr.wte.weight.t()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="tokens to generate")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    a = ap.parse_args()
    if a.prompt_tokens + a.tokens > a.seq_len:
        sys.exit("--prompt-tokens + --tokens must fit in --seq-len (one window, no restart)")
    torch.set_num_threads(a.threads)
    cfg = dict(family="gpt2", n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head, seq_len=a.seq_len,
               vocab_size=a.vocab)
    model = tm.Model(cfg)
    model.load_numpy(tm.init_params(cfg, seed=0))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, a.vocab, (a.prompt_tokens,), generator=g)
    with torch.inference_mode():
        gen = Cached(model)
        t0 = time.perf_counter()
        logits = gen.next_logits(prompt)
        t1 = time.perf_counter()
        for _ in range(a.tokens - 1):
            top, ids = torch.topk(logits / 0.8, 40)
            nxt = ids[torch.multinomial(top.softmax(dim=-1), 1, generator=g)]
            logits = gen.next_logits(nxt)
        t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    bw = read_bandwidth()
    print(json.dumps({
        "impl": "pytorch", "threads": a.threads, "params": params, "prompt_tokens": a.prompt_tokens,
        "tokens": a.tokens, "prompt_s": round(t1 - t0, 4),
        "tokens_per_s": round((a.tokens - 1) / (t2 - t1), 2) if a.tokens > 1 else None,
        "read_gb_per_s": round(bw / 1e9, 2), "ceiling_tokens_per_s": round(bw / (4 * params), 2),
        "torch": torch.__version__, "blas": blas_kernels(),
    }))


if __name__ == "__main__":
    main()
