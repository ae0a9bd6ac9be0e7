#!/usr/bin/python3
"""PyTorch side of meshtrain's core speed benchmark: one full training step on CPU.

The step is forward, cross-entropy loss, backward, AdamW step, zero_grad (set_to_none) of
the benchmark model: n_layer 6, d_model 384, n_head 6, seq_len 256, vocab 8192, 8
sequences per step (no gradient accumulation), float32, eager mode. GPT-2 (tied head) by
default; `--model llama` runs the same sizes with Llama numerics (RMSNorm, RoPE, SwiGLU
with the default d_ff = 1024, untied head). The model is tests/parity/torch_model.py, the
same one the parity test checks meshtrain against.

    /usr/bin/python3 bench/torch_step.py --threads 2 [--steps 5] [--model gpt2|llama] [--autocast]

--autocast runs the forward under torch.autocast("cpu", bfloat16) (fp32 parameters and
AdamW, the loss and backward outside it), for bench/bf16.sh.

Prints one JSON line: impl, model, threads, step_ms_median, step_ms_min, params (unique
parameters, the tied head counted once), flops_per_step, tokens_per_step, blas (the
OpenBLAS kernel set this PyTorch's matrix products run: Debian's PyTorch calls the
system BLAS, so OPENBLAS_CORETYPE chooses for both sides of the benchmark), ...

flops_per_step (model FLOPs of a training step, forward + backward = 3x forward, the
usual 6*N*tokens rule with the attention term of the PaLM paper's appendix B):
    6 * N_nonembedding * tokens          every weight matrix, norm and bias of the blocks
  + 6 * vocab * d_model * tokens         the output head matmul (tied or not)
  + 12 * n_layer * d_model * seq_len * tokens   attention scores q k^T and weights x v
                                                (full T x T, causal mask not subtracted)
with tokens = sequences * seq_len; N_nonembedding excludes the token (and GPT-2's
position) embeddings and an untied lm_head, whose lookups are not matmuls.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import torch_model as tm  # noqa: E402

SIZES = dict(n_layer=6, d_model=384, n_head=6, seq_len=256, vocab_size=8192)
SEQUENCES = 8


def flops_per_step(model):
    c = model.cfg
    L, C, T, V = c["n_layer"], c["d_model"], c["seq_len"], c["vocab_size"]
    tokens = SEQUENCES * T
    embedding = {"transformer.wte.weight", "transformer.wpe.weight", "model.embed_tokens.weight",
                 "lm_head.weight"}
    n_nonemb = sum(p.numel() for n, p in model.named_parameters() if n not in embedding)
    return 6 * n_nonemb * tokens + 6 * V * C * tokens + 12 * L * C * T * tokens, n_nonemb


def blas_kernels():
    """The kernel set of the OpenBLAS that PyTorch loaded ("?" if it is another BLAS)."""
    import ctypes
    try:
        lib = ctypes.CDLL("libblas.so.3")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return "OpenBLAS " + lib.openblas_get_corename().decode()
    except (OSError, AttributeError):
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--autocast", action="store_true", help="forward under CPU autocast, bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    cfg = dict(SIZES, family=a.model)   # GPT-2 ties the head by default, Llama does not
    model = tm.Model(cfg)
    model.load_numpy(tm.init_params(cfg, seed=0))
    opt = tm.make_optimizer(model, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    T, V = cfg["seq_len"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(1)
    warmup = 2
    batches = [torch.randint(0, V, (SEQUENCES, T + 1), generator=g) for _ in range(warmup + a.steps)]

    times = []
    for i, batch in enumerate(batches):
        x, y = batch[:, :-1], batch[:, 1:]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt * 1e3)

    flops, n_nonemb = flops_per_step(model)
    med = statistics.median(times)
    print(json.dumps({
        "impl": "pytorch", "model": a.model, "threads": a.threads, "autocast": a.autocast,
        "step_ms_median": round(med, 2), "step_ms_min": round(min(times), 2),
        "params": sum(p.numel() for p in model.parameters()), "params_nonembedding": n_nonemb,
        "flops_per_step": flops, "tokens_per_step": SEQUENCES * T,
        "gflops_per_s": round(flops / (med * 1e-3) / 1e9, 2), "steps": a.steps,
        "loss_last": round(loss.item(), 4), "torch": torch.__version__, "blas": blas_kernels(),
    }))


if __name__ == "__main__":
    main()
