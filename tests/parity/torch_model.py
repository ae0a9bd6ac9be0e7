"""Plain PyTorch reference for meshtrain's two model families (GPT-2 and Llama).

Parameter names and layouts are exactly Hugging Face's, so a state dict of this model is
what `meshtrain export` writes and what `--model.init_from` reads. Also holds the
reference training loop (data order, gradient accumulation, AdamW, clipping) that the
parity test compares meshtrain against.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import lamb_lars  # the callers put this folder on sys.path


# ----------------------------------------------------------------------------- config

def normalize_config(cfg):
    """Fill in the defaults meshtrain uses; returns a new dict."""
    c = dict(cfg)
    fam = c["family"]
    if fam not in ("gpt2", "llama"):
        raise ValueError(f"family must be gpt2 or llama, got {fam!r}")
    C = c["d_model"]
    c.setdefault("n_kv_head", c["n_head"])
    if fam == "gpt2":
        c["n_kv_head"] = c["n_head"]
        c.setdefault("d_ff", 4 * C)
        c.setdefault("tie_embeddings", True)
    else:
        c.setdefault("d_ff", 32 * math.ceil((8 * C / 3) / 32))
        c.setdefault("tie_embeddings", False)
    c.setdefault("norm_eps", 1e-5)
    c.setdefault("rope_theta", 10000.0)
    if C % c["n_head"] or c["n_head"] % c["n_kv_head"]:
        raise ValueError("d_model must divide by n_head, n_head by n_kv_head")
    return c


def expected_shapes(cfg):
    """{Hugging Face parameter name: shape} for a config, in model order."""
    c = normalize_config(cfg)
    L, C, F_, V, T = c["n_layer"], c["d_model"], c["d_ff"], c["vocab_size"], c["seq_len"]
    s = {}
    if c["family"] == "gpt2":
        s["transformer.wte.weight"] = (V, C)
        s["transformer.wpe.weight"] = (T, C)
        for i in range(L):
            p = f"transformer.h.{i}."
            s[p + "ln_1.weight"] = (C,); s[p + "ln_1.bias"] = (C,)
            s[p + "attn.c_attn.weight"] = (C, 3 * C); s[p + "attn.c_attn.bias"] = (3 * C,)
            s[p + "attn.c_proj.weight"] = (C, C); s[p + "attn.c_proj.bias"] = (C,)
            s[p + "ln_2.weight"] = (C,); s[p + "ln_2.bias"] = (C,)
            s[p + "mlp.c_fc.weight"] = (C, F_); s[p + "mlp.c_fc.bias"] = (F_,)
            s[p + "mlp.c_proj.weight"] = (F_, C); s[p + "mlp.c_proj.bias"] = (C,)
        s["transformer.ln_f.weight"] = (C,); s["transformer.ln_f.bias"] = (C,)
    else:
        D = C // c["n_head"]
        KV = c["n_kv_head"] * D
        s["model.embed_tokens.weight"] = (V, C)
        for i in range(L):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = (C,)
            s[p + "self_attn.q_proj.weight"] = (C, C)
            s[p + "self_attn.k_proj.weight"] = (KV, C)
            s[p + "self_attn.v_proj.weight"] = (KV, C)
            s[p + "self_attn.o_proj.weight"] = (C, C)
            s[p + "post_attention_layernorm.weight"] = (C,)
            s[p + "mlp.gate_proj.weight"] = (F_, C)
            s[p + "mlp.up_proj.weight"] = (F_, C)
            s[p + "mlp.down_proj.weight"] = (C, F_)
        s["model.norm.weight"] = (C,)
    if not c["tie_embeddings"]:
        s["lm_head.weight"] = (V, C)
    return s


def init_params(cfg, seed, matrix_std=0.02):
    """Random float32 initial weights {name: numpy array}: N(0, matrix_std) matrices, norm
    weights 1 +- 0.1, small nonzero biases (so every parameter is exercised)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) >= 2:
            t = torch.randn(shape, generator=g) * matrix_std
        elif "ln" in name or "norm" in name:   # LayerNorm / RMSNorm: weight ~1, bias ~0
            base = 1.0 if name.endswith("weight") else 0.0
            t = base + (torch.rand(shape, generator=g) * 2 - 1) * 0.1
        else:                                  # linear biases
            t = torch.randn(shape, generator=g) * 0.02
        out[name] = t.float().numpy()
    return out


# ----------------------------------------------------------------------------- layers

def causal_attention(q, k, v):
    """q [B,H,T,D], k/v [B,H,T,D] -> [B,H,T,D]: softmax(q k^T / sqrt(D) + causal mask) v."""
    T, D = q.shape[-2], q.shape[-1]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return att @ v


class Conv1D(nn.Module):
    """Hugging Face GPT-2 Conv1D: weight [in, out], y = x @ W + b."""
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class GPT2Attention(nn.Module):
    attend = staticmethod(causal_attention)   # an instance may replace it (run_amp.py's SpecModel)

    def __init__(self, c):
        super().__init__()
        self.n_head = c["n_head"]
        self.c_attn = Conv1D(c["d_model"], 3 * c["d_model"])
        self.c_proj = Conv1D(c["d_model"], c["d_model"])

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = self.attend(heads(q), heads(k), heads(v))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT2MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = Conv1D(c["d_model"], c["d_ff"])
        self.c_proj = Conv1D(c["d_ff"], c["d_model"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, eps = c["d_model"], c["norm_eps"]
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = GPT2Attention(c)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = GPT2MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RMSNorm(nn.Module):
    """Hugging Face LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)), computed in float32."""
    def __init__(self, C, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(C))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(T, D, theta, device=None):
    """cos, sin [T, D] of the Hugging Face rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=device).float() / D))
    freqs = torch.outer(torch.arange(T, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    attend = staticmethod(causal_attention)   # an instance may replace it (run_amp.py's SpecModel)

    def __init__(self, c):
        super().__init__()
        C, H, KV = c["d_model"], c["n_head"], c["n_kv_head"]
        D = C // H
        self.H, self.KV, self.D, self.theta = H, KV, D, c["rope_theta"]
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, KV * D, bias=False)
        self.v_proj = nn.Linear(C, KV * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.KV, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.D).transpose(1, 2)
        cos, sin = rope_cos_sin(T, self.D, self.theta, x.device)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # grouped-query: kv head j serves query heads j*G .. j*G+G-1 (repeat_interleave on
        # dim 1, written as expand + reshape, whose backward is a sum instead of index_add)
        G = self.H // self.KV
        if G > 1:
            k, v = (t[:, :, None].expand(B, self.KV, G, T, self.D).reshape(B, self.H, T, self.D)
                    for t in (k, v))
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, F_ = c["d_model"], c["d_ff"]
        self.gate_proj = nn.Linear(C, F_, bias=False)
        self.up_proj = nn.Linear(C, F_, bias=False)
        self.down_proj = nn.Linear(F_, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["d_model"], c["norm_eps"])
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c["d_model"], c["norm_eps"])
        self.mlp = LlamaMLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- model

class Model(nn.Module):
    """GPT-2 or Llama; `named_parameters()` yields exactly the Hugging Face names."""

    def __init__(self, cfg):
        super().__init__()
        c = self.cfg = normalize_config(cfg)
        V, C = c["vocab_size"], c["d_model"]
        if c["family"] == "gpt2":
            self.transformer = nn.Module()
            self.transformer.wte = nn.Embedding(V, C)
            self.transformer.wpe = nn.Embedding(c["seq_len"], C)
            self.transformer.h = nn.ModuleList(GPT2Block(c) for _ in range(c["n_layer"]))
            self.transformer.ln_f = nn.LayerNorm(C, eps=c["norm_eps"])
        else:
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(V, C)
            self.model.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c["n_layer"]))
            self.model.norm = RMSNorm(C, c["norm_eps"])
        if not c["tie_embeddings"]:
            self.lm_head = nn.Linear(C, V, bias=False)

    def embedding(self):
        return (self.transformer.wte if self.cfg["family"] == "gpt2" else self.model.embed_tokens).weight

    def forward(self, idx):
        """idx [B, T] int64 -> logits [B, T, V]."""
        head = self.embedding() if self.cfg["tie_embeddings"] else self.lm_head.weight
        return self.hidden(idx) @ head.t()

    def hidden(self, idx):
        """idx [B, T] int64 -> the final norm's output [B, T, C] (what the head multiplies)."""
        T = idx.shape[1]
        if self.cfg["family"] == "gpt2":
            tr = self.transformer
            x = tr.wte(idx) + tr.wpe(torch.arange(T, device=idx.device))
            for blk in tr.h:
                x = blk(x)
            x = tr.ln_f(x)
        else:
            x = self.model.embed_tokens(idx)
            for blk in self.model.layers:
                x = blk(x)
            x = self.model.norm(x)
        return x

    def load_numpy(self, params):
        """Load {HF name: numpy array} (converted to the model's dtype); names and shapes
        must match exactly."""
        own = dict(self.named_parameters())
        if set(own) != set(params):
            raise ValueError(f"parameter names differ: missing {sorted(set(own) - set(params))}, "
                             f"unexpected {sorted(set(params) - set(own))}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(torch.from_numpy(np.asarray(params[n])).view(p.shape))
        return self

    def to_numpy(self):
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_parameters()}


# ----------------------------------------------------------------------------- training

def sequences(tokens, first, count, T):
    """Sequences first..first+count-1 as (inputs [count,T], targets [count,T]) int64 tensors;
    sequence j is tokens[(j*T + i) mod n] for i = 0..T."""
    n = len(tokens)
    j = np.arange(first, first + count)[:, None]
    idx = (j * T + np.arange(T + 1)[None, :]) % n
    seq = torch.from_numpy(np.asarray(tokens, dtype=np.int64)[idx])
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_optimizer(model, lr, beta1, beta2, eps, weight_decay, optim="adamw", momentum=0.9,
                   trust_coef=0.001):
    """AdamW (or LAMB, LARS: lamb_lars.py) with weight decay on parameters of 2+ dimensions
    only; LARS adapts only those too."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "adapt": True},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "adapt": False}]
    if optim == "lamb":
        return lamb_lars.Lamb(groups, lr=lr, betas=(beta1, beta2), eps=eps)
    if optim == "lars":
        return lamb_lars.Lars(groups, lr=lr, momentum=momentum, weight_decay=weight_decay,
                              trust_coef=trust_coef, eps=eps)
    for g in groups:
        del g["adapt"]
    return torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps)


def train_step(model, opt, tokens, step, G, M, grad_clip):
    """One optimizer step on global sequences step*G .. step*G+G-1 in G/M micro-batches.
    Returns (mean loss over all G*T targets, global grad L2 norm before clipping)."""
    if G % M:
        raise ValueError("global_batch must be a multiple of micro_batch")
    T = model.cfg["seq_len"]
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(G // M):
        x, y = sequences(tokens, step * G + m * M, M, T)
        logits = model(x)
        loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum")
        (loss_sum / (G * T)).backward()
        total += loss_sum.item()
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    opt.step()
    return total / (G * T), float(norm)


def train_reference(cfg, init, tokens, steps, global_batch, micro_batch, lr, weight_decay,
                    beta1, beta2, eps, grad_clip, dtype=torch.float32, **optim):
    """Train from `init` for `steps`; returns (per-step [(loss, grad_norm)], final params).
    dtype float64 serves to measure float32's rounding noise; `optim`: make_optimizer's
    optim, momentum, trust_coef."""
    model = Model(cfg).to(dtype).load_numpy(init)
    opt = make_optimizer(model, lr, beta1, beta2, eps, weight_decay, **optim)
    log = [train_step(model, opt, tokens, s, global_batch, micro_batch, grad_clip)
           for s in range(steps)]
    return log, model.to_numpy()
