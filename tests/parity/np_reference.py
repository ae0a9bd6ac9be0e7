"""An independent, deliberately naive float64 NumPy forward pass of both families.

Used only by `run_parity.py --self-test` to check torch_model.py: it shares no code with
it and writes each formula differently (attention as explicit loops over heads and
positions, RoPE as explicit rotations of (i, i + D/2) pairs, GELU/SiLU spelled out).
"""
import math

import numpy as np


def _layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rmsnorm(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _attend(q, k, v, n_head, n_kv_head, D):
    """q [T, H*D], k/v [T, KV*D] -> [T, H*D]; loops over heads and query positions."""
    T = q.shape[0]
    out = np.zeros_like(q)
    group = n_head // n_kv_head
    for h in range(n_head):
        kv = h // group                      # kv head serving query head h
        qs, ks = slice(h * D, (h + 1) * D), slice(kv * D, (kv + 1) * D)
        for t in range(T):
            scores = np.array([q[t, qs] @ k[s, ks] for s in range(t + 1)]) / math.sqrt(D)
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[t, qs] = sum(p[s] * v[s, ks] for s in range(t + 1))
    return out


def _rope(x, n, D, theta):
    """Rotate each head's pairs (i, i + D/2) at position t by angle t * theta^(-2i/D)."""
    y = x.copy()
    for t in range(x.shape[0]):
        for h in range(n):
            for i in range(D // 2):
                ang = t * theta ** (-2.0 * i / D)
                a, b = x[t, h * D + i], x[t, h * D + i + D // 2]
                y[t, h * D + i] = a * math.cos(ang) - b * math.sin(ang)
                y[t, h * D + i + D // 2] = b * math.cos(ang) + a * math.sin(ang)
    return y


def forward(cfg, params, idx):
    """cfg: a normalized config; params: {HF name: array}; idx [T] -> logits [T, V] float64."""
    P = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    H, C, eps = cfg["n_head"], cfg["d_model"], cfg["norm_eps"]
    D = C // H
    T = len(idx)
    if cfg["family"] == "gpt2":
        emb = P["transformer.wte.weight"]
        x = emb[idx] + P["transformer.wpe.weight"][:T]
        for i in range(cfg["n_layer"]):
            p = f"transformer.h.{i}."
            h = _layernorm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"], eps)
            qkv = h @ P[p + "attn.c_attn.weight"] + P[p + "attn.c_attn.bias"]
            a = _attend(qkv[:, :C], qkv[:, C:2 * C], qkv[:, 2 * C:], H, H, D)
            x = x + a @ P[p + "attn.c_proj.weight"] + P[p + "attn.c_proj.bias"]
            h = _layernorm(x, P[p + "ln_2.weight"], P[p + "ln_2.bias"], eps)
            h = _gelu_tanh(h @ P[p + "mlp.c_fc.weight"] + P[p + "mlp.c_fc.bias"])
            x = x + h @ P[p + "mlp.c_proj.weight"] + P[p + "mlp.c_proj.bias"]
        x = _layernorm(x, P["transformer.ln_f.weight"], P["transformer.ln_f.bias"], eps)
    else:
        KV, theta = cfg["n_kv_head"], cfg["rope_theta"]
        emb = P["model.embed_tokens.weight"]
        x = emb[idx]
        for i in range(cfg["n_layer"]):
            p = f"model.layers.{i}."
            h = _rmsnorm(x, P[p + "input_layernorm.weight"], eps)
            q = _rope(h @ P[p + "self_attn.q_proj.weight"].T, H, D, theta)
            k = _rope(h @ P[p + "self_attn.k_proj.weight"].T, KV, D, theta)
            v = h @ P[p + "self_attn.v_proj.weight"].T
            x = x + _attend(q, k, v, H, KV, D) @ P[p + "self_attn.o_proj.weight"].T
            h = _rmsnorm(x, P[p + "post_attention_layernorm.weight"], eps)
            g = h @ P[p + "mlp.gate_proj.weight"].T
            u = h @ P[p + "mlp.up_proj.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ P[p + "mlp.down_proj.weight"].T
        x = _rmsnorm(x, P["model.norm.weight"], eps)
    head = emb if cfg["tie_embeddings"] else P["lm_head.weight"]
    return x @ head.T


def cross_entropy_mean(logits, targets):
    """Mean over rows of logsumexp(logits) - logits[target]."""
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return float(np.mean(lse - logits[np.arange(len(targets)), targets]))
