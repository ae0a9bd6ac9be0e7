#!/usr/bin/python3
"""Mixed-precision parity: meshtrain's bf16 training against PyTorch's, and against fp32.

For a small GPT-2 and a small Llama that learn within a few dozen steps, from the same
initial weights and tokens (tests/parity's safetensors and token files):
  (a) ref fp32     the PyTorch reference (torch_model.py) in fp32
  (b) autocast     the same under torch.autocast("cpu", bfloat16): fp32 parameters and
                   AdamW, the forward under autocast, the loss and backward outside it
  (c) mt fp32      meshtrain --training.precision=fp32
  (d) mt bf16      meshtrain --training.precision=bf16
and in PyTorch meshtrain's stated bf16 semantics written out ("spec") and deliberately
wrong bf16 implementations (VARIANTS). A probe, one SGD step from the initial weights in
meshtrain fp32 and bf16, yields meshtrain's first gradient element by element.

Checks (tolerances and the measurements behind them: see "tolerances" below):
  - (c) matches (a) as tightly as run_parity.py demands, and so do their probe gradients;
  - (d) is within AMP_LOSS_RTOL of (b) in per-step loss, AMP_PARAM_RL2 in final parameters;
  - (d) tracks (c) within TRACK_LOSS_RTOL, yet differs from it by ROUNDS_MIN_RL2 or more in
    the final parameters (the run really rounds);
  - (d) is closer to (b) than the wrong variant WRONG_RUN_VARIANT is (mean loss difference);
  - (d)'s probe gradient is within PROBE_TOL of the spec's (the sharp check: run-level
    numbers cannot tell most wrong implementations from right ones, the probe can);
  - the loss falls (both meshtrain runs).

    /usr/bin/python3 tests/parity/run_amp.py --meshtrain build/meshtrain [--workdir DIR]
        [--only NAME] [--fp32-only]
    /usr/bin/python3 tests/parity/run_amp.py --self-test     # PyTorch only, no meshtrain

--fp32-only runs (a) and (c) alone, without passing training.precision (for an engine
that does not know the key yet). --under-test fp32|fp16 runs meshtrain at that precision
where bf16 belongs, to watch the checks fail on a real run that is not bf16 (both do).
Exit status 1 if any check fails.
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_parity as rp  # noqa: E402
import st  # noqa: E402
import torch_model as tm  # noqa: E402

# ----------------------------------------------------------------------------- cases

# Small enough that a run takes about a second, large enough to learn: the tokens come from
# a sparse random Markov chain (each token has 3 possible successors, ~0.8 nat of entropy
# per token against ln 128 = 4.85 for a guess), so the loss falls by ~3 nats in 40 steps.
_TRAIN = dict(steps=40, global_batch=8, micro_batch=4, lr=3e-3, weight_decay=0.1, beta1=0.9,
              beta2=0.95, eps=1e-6, grad_clip=1.0)
CASES = [
    dict(name="gpt2_amp",
         model=dict(family="gpt2", n_layer=2, n_head=4, d_model=64, vocab_size=128, seq_len=32,
                    norm_eps=1e-5),
         omit=(), token_version=1, train=dict(_TRAIN)),
    dict(name="llama_amp",
         model=dict(family="llama", n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160,
                    vocab_size=128, seq_len=32, tie_embeddings=False, norm_eps=1e-5,
                    rope_theta=10000.0),
         omit=(), token_version=1, train=dict(_TRAIN)),
]


SEED_OFFSET = 0  # --seed-offset: other draws, to see how far the measured distances move


def case_inputs(case):
    """Initial weights (as run_parity.py draws them) and Markov-chain tokens, seeded by the
    case's position in CASES. Exactly as many tokens as the run reads (no wrap-around)."""
    m, t = case["model"], case["train"]
    seed = 2000 + [c["name"] for c in CASES].index(case["name"]) + SEED_OFFSET
    init = tm.init_params(m, seed, rp.init_std(m))
    rng = np.random.default_rng(seed)
    V = m["vocab_size"]
    succ = np.stack([rng.choice(V, size=3, replace=False) for _ in range(V)])   # [V, 3]
    prob = rng.dirichlet(np.ones(3), size=V)                                     # [V, 3]
    n = t["steps"] * t["global_batch"] * m["seq_len"] + 1
    toks = np.empty(n, dtype=np.int64)
    toks[0] = rng.integers(V)
    u = rng.random(n)
    for i in range(1, n):
        p = prob[toks[i - 1]]
        toks[i] = succ[toks[i - 1], min(int(np.searchsorted(np.cumsum(p), u[i])), 2)]
    return init, toks


# ----------------------------------------------------------------------------- PyTorch runs

def round_bf16(t):
    """Round to the nearest bfloat16 (ties to even), kept as float32."""
    return t.to(torch.bfloat16).float()


def trunc_bf16(t):
    """Round toward zero to bfloat16 (drop the low 16 bits): a classic conversion bug."""
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def round_fp16(t):
    """Round to the nearest float16, kept as float32."""
    return t.to(torch.float16).float()


class _Product(torch.autograd.Function):
    """y = x @ w^T (+ b): x, and in backward the upstream gradient, rounded by `rnd` before
    each product (w is a working copy, rounded already); the products of two 16-bit values
    are exact in fp32, which accumulates them. The output is rounded too when round_out.
    The bias's gradient is the sum of the unrounded upstream gradient. acc64 accumulates in
    float64 instead (then fp32): another summation order, i.e. a second implementation of
    the same semantics, for the self-test."""

    @staticmethod
    def forward(ctx, x, w, b, rnd, round_out, acc64):
        xr = rnd(x)
        mm = (lambda a, c: (a.double() @ c.double()).float()) if acc64 else (lambda a, c: a @ c)
        y = mm(xr, w.t())
        if b is not None:
            y = y + b
        ctx.save_for_backward(xr, w)
        ctx.rnd, ctx.has_b, ctx.mm = rnd, b is not None, mm
        return rnd(y) if round_out else y

    @staticmethod
    def backward(ctx, g):
        xr, w = ctx.saved_tensors
        gr = ctx.rnd(g)
        gx = ctx.mm(gr, w)
        gw = ctx.mm(gr.reshape(-1, gr.shape[-1]).t(), xr.reshape(-1, xr.shape[-1]))
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_b else None
        return gx, gw, gb, None, None, None


class _Round(torch.autograd.Function):
    """rnd(x) in forward, the gradient passed through unrounded: an activation stored in 16
    bits, whose gradient stays fp32."""

    @staticmethod
    def forward(ctx, x, rnd):
        return rnd(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _KeptAttention(torch.autograd.Function):
    """Causal attention (tm.causal_attention) whose output is rounded by `rnd` and whose
    backward reads that rounded output, as a fused (flash) backward does: it recomputes the
    probabilities P and takes dS = P * (dO V^T - D) with D = rowsum(dO * O) from the kept O.
    q [B,H,T,D], k/v [B,H,T,D] (grouped heads expanded by the caller)."""

    @staticmethod
    def forward(ctx, q, k, v, rnd):
        o = rnd(tm.causal_attention(q, k, v))
        ctx.save_for_backward(q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        T, D = q.shape[-2], q.shape[-1]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        p = ((q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(mask, float("-inf")).softmax(dim=-1)
        dv = p.transpose(-2, -1) @ do
        ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True)) / math.sqrt(D)
        return ds @ k, ds.transpose(-2, -1) @ q, dv, None


# The layers whose outputs a block keeps for attention and the MLP's activation (q|k|v and
# Llama's gate|up): meshtrain rounds them to the working precision where they are produced,
# as 16-bit ops return them (src/nn/block.h, BlockActs). GPT-2's pre-activation is kept
# rounded too, but GELU reads the product's fp32 result, as a fused epilogue does
# (_GeluOfProduct).
KEPT_OUTPUTS = ("c_attn", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class _GeluOfProduct(torch.autograd.Function):
    """The tanh GELU of a product's unrounded output y, as a fused epilogue computes it;
    its backward reads y rounded by `rnd`, the pre-activation the block keeps in 16 bits."""

    @staticmethod
    def forward(ctx, y, rnd):
        ctx.save_for_backward(rnd(y))
        return F.gelu(y, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        (yr,) = ctx.saved_tensors
        with torch.enable_grad():
            t = yr.detach().requires_grad_()
            (dy,) = torch.autograd.grad(F.gelu(t, approximate="tanh"), t, g)
        return dy, None


class SpecModel(tm.Model):
    """The reference model computing as meshtrain specifies 16-bit training: its parameters
    hold the 16-bit working copies (train_torch sets them), every linear layer and the head
    multiply operands rounded by `rnd` with fp32 accumulation (_Product); the outputs of
    KEPT_OUTPUTS and attention's inputs (q and k again after rope) are rounded (_Round), and
    its output, which its backward reads (_KeptAttention); GPT-2's GELU reads its product's
    fp32 result, its backward the rounded one (_GeluOfProduct); norms, softmax, attention's
    products and the loss stay fp32. round_acts=False rounds no activation (the weights-only
    variant)."""

    def __init__(self, cfg, rnd, round_out, round_acts=True, acc64=False):
        super().__init__(cfg)
        self.prod = dict(rnd=rnd if round_acts else (lambda t: t), round_out=round_out, acc64=acc64)
        for name, mod in self.named_modules():
            if isinstance(mod, (tm.Conv1D, nn.Linear)):
                mod.forward = self._linear(mod, round_out or (round_acts and name.endswith(KEPT_OUTPUTS)))
            if round_acts and isinstance(mod, (tm.GPT2Attention, tm.LlamaAttention)):
                mod.attend = self._attention
            if round_acts and isinstance(mod, tm.GPT2MLP):
                mod.forward = lambda x, m=mod: m.c_proj(_GeluOfProduct.apply(m.c_fc(x), rnd))

    def product(self, x, w, b, round_out=None):
        p = self.prod
        return _Product.apply(x, w, b, p["rnd"], p["round_out"] if round_out is None else round_out, p["acc64"])

    def _linear(self, mod, round_out):
        conv = isinstance(mod, tm.Conv1D)   # Hugging Face Conv1D: weight [in, out]
        return lambda x: self.product(x, mod.weight.t() if conv else mod.weight, mod.bias, round_out)

    def _attention(self, q, k, v):
        rnd = self.prod["rnd"]
        r = lambda t: _Round.apply(t, rnd)
        return _KeptAttention.apply(r(q), r(k), r(v), rnd)

    def forward(self, idx):   # tm.Model.forward, with the head as a linear layer
        head = self.embedding() if self.cfg["tie_embeddings"] else self.lm_head.weight
        return self.product(self.hidden(idx), head, None)


# Whether the output of a linear layer outside KEPT_OUTPUTS (the attention and MLP output
# projections, the head) is rounded to the working precision (True) or is the fp32
# accumulator (False). meshtrain documents an fp32 result (src/ops/autocast.h, README's
# "Mixed precision"), and the probe confirms it. "spec" follows this flag; "spec_alt" rounds
# every linear layer's output.
SPEC_ROUND_OUT = False

# The PyTorch runs: name -> (kind, options). "spec" is meshtrain's stated bf16 semantics;
# "spec_acc64" the same semantics summed in another order (a second correct implementation,
# standing in for meshtrain in --self-test); "fp64" stands in for meshtrain's fp32 there.
# The rest are deliberately wrong bf16 implementations: "fp32" (precision ignored),
# "weights_only" (working copies rounded, activations never), "truncate" (fp32 -> bf16 by
# dropping the low 16 bits instead of rounding to nearest: a classic conversion bug),
# "fp16" (the other 16-bit format), "spec_alt" (the other choice of output rounding),
# "bf16_masters" (the optimizer's result rounded to bf16: no fp32 masters).
VARIANTS = {
    "fp32": ("torch", dict(dtype=torch.float32)),
    "fp64": ("torch", dict(dtype=torch.float64)),
    "autocast": ("autocast", {}),
    "spec": ("spec", dict(rnd=round_bf16, round_out=SPEC_ROUND_OUT)),
    "spec_acc64": ("spec", dict(rnd=round_bf16, round_out=SPEC_ROUND_OUT, acc64=True)),
    "spec_alt": ("spec", dict(rnd=round_bf16, round_out=not SPEC_ROUND_OUT)),
    "weights_only": ("spec", dict(rnd=round_bf16, round_out=False, round_acts=False)),
    "truncate": ("spec", dict(rnd=trunc_bf16, round_out=SPEC_ROUND_OUT)),
    "fp16": ("spec", dict(rnd=round_fp16, round_out=SPEC_ROUND_OUT)),
    "bf16_masters": ("spec", dict(rnd=round_bf16, round_out=SPEC_ROUND_OUT, bf16_masters=True)),
}
WRONG_VARIANTS = ("fp32", "weights_only", "truncate", "fp16", "spec_alt", "bf16_masters")


def _accumulate(model, tokens, step, G, M, fwd):
    """Gradients of global batch `step` into the .grad of model's parameters, accumulated
    over G/M micro-batches exactly as tm.train_step does; fwd(x) gives the logits, which the
    loss takes in fp32. Returns the mean loss."""
    T = model.cfg["seq_len"]
    total = 0.0
    for m in range(G // M):
        x, y = tm.sequences(tokens, step * G + m * M, M, T)
        logits = fwd(x).float()
        loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum")
        (loss_sum / (G * T)).backward()
        total += loss_sum.item()
    return total / (G * T)


def _stepper(case, init, tokens, variant):
    """(master model, grad(step)): grad puts the gradient of a step's batch into the master
    parameters' .grad (set to None before) and returns the step's loss."""
    kind, o = VARIANTS[variant]
    cfg, t = case["model"], case["train"]
    G, M = t["global_batch"], t["micro_batch"]
    master = tm.Model(cfg).to(o.get("dtype", torch.float32)).load_numpy(init)
    params = list(master.parameters())
    if kind in ("torch", "autocast"):
        def fwd(x):
            if kind == "torch":
                return master(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return master(x)
        return master, lambda s: _accumulate(master, tokens, s, G, M, fwd)
    # spec: fp32 masters; a working model holds their 16-bit copies (as fp32 numbers), and
    # its fp32 gradients are the masters' gradients.
    work = SpecModel(cfg, o["rnd"], o["round_out"], o.get("round_acts", True), o.get("acc64", False))
    wparams = list(work.parameters())

    def grad(s):
        with torch.no_grad():
            for w, p in zip(wparams, params):
                w.copy_(o["rnd"](p))
                w.grad = None
        loss = _accumulate(work, tokens, s, G, M, work)
        for w, p in zip(wparams, params):
            p.grad = w.grad.clone()
        return loss
    return master, grad


def _numpy32(model):
    return {n: a.astype(np.float32) for n, a in model.to_numpy().items()}


def train_torch(case, init, tokens, variant):
    """Train a case in PyTorch with AdamW; returns dict(log=[(loss, grad_norm)] per step,
    params=final parameters as float32)."""
    t = case["train"]
    master, grad = _stepper(case, init, tokens, variant)
    opt = tm.make_optimizer(master, t["lr"], t["beta1"], t["beta2"], t["eps"], t["weight_decay"])
    params = list(master.parameters())
    log = []
    for s in range(t["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = grad(s)
        if t["grad_clip"] > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, t["grad_clip"])
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        opt.step()
        if VARIANTS[variant][1].get("bf16_masters"):
            with torch.no_grad():
                for p in params:
                    p.copy_(round_bf16(p))
        log.append((float(loss), float(norm)))
    return dict(log=log, params=_numpy32(master))


def first_gradient(case, init, tokens, variant):
    """The gradient of the first batch at the initial weights, {name: float64 array}."""
    master, grad = _stepper(case, init, tokens, variant)
    grad(0)
    return {n: p.grad.detach().double().numpy().copy() for n, p in master.named_parameters()}


# ----------------------------------------------------------------------------- tolerances
#
# The numbers are measured on these cases (gpt2_amp / llama_amp): --self-test prints the
# PyTorch ones, a run against meshtrain its own; "other seeds" are 4 more draws of the
# cases' weights and tokens, to see how much the numbers move.
#
# fp32 (meshtrain fp32 vs the PyTorch fp32 reference): run_parity.py's tolerances, 1e-4 in
# per-step loss and grad_norm; the final parameters' per-tensor max|diff|/max|ref| within
# FP32_PARAM_TOL. Adam eps is 1e-6 in the cases: with 1e-8, elements whose gradient is ~eps
# turn fp32 rounding noise into lr-sized updates (GPT-2's wpe: 1.7e-3 between fp32 and
# fp64 after 40 steps); with 1e-6 fp32 vs fp64 stays at <= 2e-7 in loss, 5e-7 in grad_norm,
# and meshtrain fp32 vs PyTorch fp32 measures 1.5e-7, 1e-6 and 1.6e-5 in the parameters.
# The parameters' distance is heavy-tailed over draws even so (--seed-offset 0, 10, .., 60):
# PyTorch fp32 vs fp64 sits at 9e-6..4e-5 but reaches 3.3e-4 (llama_amp, offset 20: the
# embedding); meshtrain fp32 vs fp64 1e-5..1e-4, 5.0e-4 there; meshtrain vs PyTorch fp32
# 1e-5..6e-5, 1.4e-4 / 1.7e-4 at offset 20. So two correct fp32 engines can sit 3e-4 apart
# after 40 steps, and 1e-4 (run_parity's, for 6 steps) failed on correct runs; 1e-3 is 3x
# the widest. Formula errors are run_parity's (1e-4 at 6 steps) and the fp32 probe's to
# catch (FP32_PROBE_TOL), with loss and grad_norm at every step.
FP32_PARAM_TOL = 1e-3
#
# bf16: rounding to 8 mantissa bits costs up to 2^-9 ~ 2e-3 relative per rounding. Its
# effect on the loss at one step is a zero-mean sum of many such errors (~1e-5 relative at
# step 0), and training amplifies it: over 40 steps any two bf16 implementations that round
# at different points -- and bf16 against fp32 -- drift apart by ~1e-3 in loss (max over
# steps) and ~5e-3 in the parameters (relative L2). Both round q|k|v, the attention output
# and the MLP's pre-activation; autocast rounds more (attention's probabilities, GELU/SiLU
# and rope outputs, the output projections' results), meshtrain rounds the parameters that
# autocast leaves fp32 (embeddings, norm weights, biases: all working copies are bf16).
# Measured:
#   meshtrain bf16 vs autocast: loss max 6.5e-4 / 8.8e-4, parameters 5.1e-3 / 7.9e-3
#   meshtrain bf16 vs fp32:     loss max 7.9e-4 / 9.1e-4, parameters 4.4e-3 / 7.0e-3
#   PyTorch fp32 vs autocast:   loss max 5.7e-4 / 6.0e-4, parameters 4.5e-3 / 7.1e-3
#   correct bf16 (PyTorch) vs autocast or fp32, other seeds: loss max <= 1.5e-3,
#   parameters <= 8e-3; meshtrain bf16 vs autocast, 4 other seeds: loss max <= 2.0e-3,
#   parameters <= 9.5e-3.
# The run-level bounds leave >= 2.5x room over all of these:
AMP_LOSS_RTOL = 5e-3     # bf16 vs autocast, per-step loss, relative
AMP_PARAM_RL2 = 4e-2     # bf16 vs autocast, final parameters, ||a - b|| / ||b|| over all
TRACK_LOSS_RTOL = 5e-3   # bf16 vs fp32 (meshtrain's two runs), per-step loss, relative
# The bf16 run must differ from the fp32 run: fp32 implementations agree to ~1e-6 in the
# parameters (relative L2), bf16 against fp32 measures 4e-3 / 7e-3 (meshtrain's fp16,
# 9e-4 / 1.4e-3); 1e-4 sits far from both. A run that ignores the precision gives 0.
ROUNDS_MIN_RL2 = 1e-4
# The model learns: the mean loss of the last 5 steps at most this fraction of the first
# (measured 0.37 / 0.33: 5.0 -> 1.7 and 1.5 nats; the chain's entropy ~0.8 nat).
LEARN_FRACTION = 0.6
# Wrong variant, run level. A loss curve cannot tell a correct bf16 implementation from one
# that ignores the precision (fp32), rounds only the weights, or uses fp16: all lie as far
# from autocast as correct ones do (meshtrain run at fp32: loss max 5.7e-4 / 6.0e-4 from
# autocast, at bf16 5.5e-4 / 7.7e-4); rounding noise is zero-mean and which curve lands
# closer to autocast's is chance. What a curve does show is a biased rounding: truncating
# to bf16 drifts the loss one way, mean |rel diff| to autocast 9.0e-4 / 1.1e-3 against
# meshtrain bf16's 2.1e-4 / 3.1e-4 (4 other seeds: 6.7e-4..1.0e-3 against 2.0e-4..6.4e-4;
# before meshtrain rounded q|k|v, the attention output and the pre-activation, 5.1e-4..1.1e-3
# against 2.0e-4..6.0e-4).
# So the bf16 run must be closer to autocast (mean over steps of |rel loss diff|) than the
# truncating variant is.
WRONG_RUN_VARIANT = "truncate"
# The sharp check, the probe: one SGD step (lr 1, no decay, momentum or clipping) from the
# initial weights; meshtrain's exported parameters give its first gradient element by
# element (p0 - p1), compared with the "spec" reference's gradient, relative L2 over all
# parameters. Before training amplifies anything, two implementations of the same
# semantics differ only where fp32 summation order flips a bf16 rounding (whose effect then
# propagates): meshtrain 9.8e-4 / 1.1e-3 with fp32 products of the rounded operands
# (MESHTRAIN_CPU_BF16=off; 1.1e-3 / 1.1e-3 with OPENBLAS_CORETYPE Haswell or Sandybridge),
# 1.0e-3 / 1.7e-3 with its AVX512_BF16 kernel, which sums in another order than the spec's
# fp32 products (4 other seeds: 6.1e-4..1.2e-3), spec_acc64 1.2e-3 / 1.2e-3 (4 other seeds:
# up to 1.2e-3). The wrong ones:
# weights_only 4.0e-3 / 5.9e-3 and spec_alt 4.2e-3 / 5.9e-3 (other seeds: both down to
# 2.8e-3), fp32 and fp16 7.3e-3 / 1.0e-2 (meshtrain's own fp32 and fp16 runs the same),
# autocast 8.0e-3 / 1.1e-2, truncate 1.7e-2 / 2.6e-2. The spec's attention backward reads
# its rounded output (_KeptAttention) as meshtrain's fused one does: with autograd's exact
# backward instead, meshtrain measures 1.5e-3 / 1.8e-3 (its materialized path, which reads
# no output, 1.0e-3 / 1.0e-3).
PROBE_TOL = 2.5e-3
FP32_PROBE_TOL = 1e-4    # meshtrain fp32's probe gradient vs PyTorch fp32 (measured 6e-7)
# The fp32 masters: about 1/65536 of random fp32 values are bf16 values (measured 0.00%
# after 40 steps); masters kept in bf16 make it 100% ("bf16_masters", which also lands
# 4e-2 from autocast in loss and 3e-2 in the parameters: lr-sized updates are ~1 bf16 ulp
# of the weights, so many are lost). Its probe is exactly the spec's.
MASTERS_BF16_MAX = 0.05
PROBE = dict(lr=1.0, steps=1)


# ----------------------------------------------------------------------------- distances

def _flat(params, cfg):
    """All parameters as one float64 vector, without the key part of GPT-2's c_attn.bias
    (its gradient is zero in exact arithmetic, so Adam turns rounding noise into +-lr
    updates there: see run_parity.param_error)."""
    parts = []
    for n in sorted(params):
        a = np.asarray(params[n], dtype=np.float64).ravel()
        if cfg["family"] == "gpt2" and n.endswith("attn.c_attn.bias"):
            C = cfg["d_model"]
            a = np.delete(a, np.s_[C:2 * C])
        parts.append(a)
    return np.concatenate(parts)


def rl2(a, b, cfg):
    """||a - b|| / ||b|| over all parameters (dicts of arrays)."""
    fa, fb = _flat(a, cfg), _flat(b, cfg)
    return float(np.linalg.norm(fa - fb) / max(np.linalg.norm(fb), 1e-30))


def loss_dist(la, lb):
    """(max, mean) over steps of |rel diff| of the loss between two logs."""
    d = [rp.rel(a[0], b[0]) for a, b in zip(la, lb)]
    return (max(d), float(np.mean(d))) if len(la) == len(lb) and d else (float("inf"),) * 2


def gnorm_max(la, lb):
    d = [rp.rel(a[1], b[1]) for a, b in zip(la, lb)]
    return max(d) if len(la) == len(lb) and d else float("inf")


def learned(log):
    """Mean loss of the last 5 steps over the first step's loss."""
    return float(np.mean([l for l, _ in log[-5:]])) / log[0][0]


# ----------------------------------------------------------------------------- meshtrain

def meshtrain_run(case, meshtrain_cmd, d, precision, probe, env, name):
    """Train with meshtrain (AdamW run, or the one SGD step of the probe) and export.
    precision None passes no training.precision key; name names the files. Returns (result or None, errors);
    result: dict(log, params, metrics, header) or, for the probe, dict(grad)."""
    tag = ("probe_" if probe else "run_") + name
    p = {k: os.path.join(d, f"{tag}_{k}") for k in ("metrics.jsonl", "ckpt", "final.safetensors")}
    t = dict(case["train"], **(dict(PROBE, weight_decay=0.0, grad_clip=0.0) if probe else {}))
    args = rp.meshtrain_train_args(dict(case, train=t), os.path.join(d, "init.safetensors"),
                                   os.path.join(d, "tokens.bin"), p["metrics.jsonl"], p["ckpt"])
    if probe:
        args = [("--optim.name=sgd" if a == "--optim.name=adamw" else a) for a in args]
        args += ["--optim.momentum=0.0"]
    if precision:
        args += [f"--training.precision={precision}"]
    log_path = os.path.join(d, "meshtrain.log")
    ok, msg = rp.run_command(meshtrain_cmd + args, log_path, env)
    if ok:
        ok, msg = rp.run_command(meshtrain_cmd + ["export", "--checkpoint", p["ckpt"], "--out",
                                                  p["final.safetensors"]], log_path, env)
    if not ok:
        return None, [f"{tag}: {msg}"]
    try:
        got = st.load_safetensors(p["final.safetensors"])
        header = st.read_header(p["final.safetensors"])
    except (ValueError, OSError) as e:
        return None, [f"{tag}: cannot read the export: {e}"]
    want = tm.expected_shapes(case["model"])
    if {n: tuple(a.shape) for n, a in got.items()} != want:
        return None, [f"{tag}: exported names/shapes differ from {sorted(want)}"]
    if probe:
        init = st.load_safetensors(os.path.join(d, "init.safetensors"))
        return dict(grad={n: (init[n].astype(np.float64) - got[n].astype(np.float64)) / PROBE["lr"]
                          for n in want}), []
    metrics = rp.read_metrics(p["metrics.jsonl"])
    log = [(float(metrics[s]["loss"]), float(metrics[s]["grad_norm"]))
           for s in range(t["steps"]) if s in metrics]
    errors = [] if len(log) == t["steps"] else [f"{tag}: metrics hold {len(log)} of {t['steps']} steps"]
    return dict(log=log, params=got, metrics=metrics, header=header), errors


# ----------------------------------------------------------------------------- checks

def references(case, init, tokens, names, grad_names=tuple(VARIANTS)):
    """The PyTorch runs `names` (AdamW runs) and the first gradients of `grad_names`."""
    runs = {v: train_torch(case, init, tokens, v) for v in set(names) | {"fp32"}}
    grads = {v: first_gradient(case, init, tokens, v) for v in grad_names}
    return runs, grads


def bf16_fraction(params):
    """The fraction of parameter values that bf16 represents exactly: ~1/65536 for fp32
    masters (the initial weights are random fp32), 1 when the masters were kept in bf16."""
    flat = np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in params.values()])
    return float(np.mean((flat.view(np.uint32) & 0xFFFF) == 0))


def check_case(case, refs, grads, mt32, mt16, probe32, probe16, say):
    """All checks of one case. refs: PyTorch runs (fp32, autocast, WRONG_RUN_VARIANT);
    grads: first gradients of every variant; mt32 / mt16: meshtrain's runs (dict(log,
    params[, metrics, header])) at fp32 / bf16 (mt16 None: fp32 only); probe32 / probe16:
    meshtrain's probe gradients. Prints a table; returns (errors, measured numbers)."""
    cfg = tm.normalize_config(case["model"])
    errors, m = [], {}

    # (c) vs (a): as tight as run_parity.py.
    say("  meshtrain fp32 vs PyTorch fp32:")
    metrics = mt32.get("metrics") or {s: {"loss": l, "grad_norm": g, "lr": case["train"]["lr"]}
                                      for s, (l, g) in enumerate(mt32["log"])}
    errors += ["fp32: " + e for e in rp.compare(case, refs["fp32"]["log"], refs["fp32"]["params"],
                                                metrics, mt32["params"], mt32.get("header"),
                                                lambda *a: None, FP32_PARAM_TOL)]
    m["fp32_loss"] = loss_dist(mt32["log"], refs["fp32"]["log"])[0]
    m["fp32_gnorm"] = gnorm_max(mt32["log"], refs["fp32"]["log"])
    m["fp32_param"] = max(rp.param_error(n, mt32["params"][n], refs["fp32"]["params"][n], cfg)
                          for n in refs["fp32"]["params"])
    m["fp32_probe"] = rl2(probe32, grads["fp32"], cfg)
    say(f"    loss {m['fp32_loss']:.1e}, grad_norm {m['fp32_gnorm']:.1e} (tol {rp.LOSS_RTOL:g}); "
        f"parameters {m['fp32_param']:.1e} (tol {FP32_PARAM_TOL:g}); probe gradient "
        f"{m['fp32_probe']:.1e} (tol {FP32_PROBE_TOL:g})")
    if not m["fp32_probe"] <= FP32_PROBE_TOL:
        errors.append(f"fp32 probe gradient: rel L2 {m['fp32_probe']:.2e} (tol {FP32_PROBE_TOL:g})")
    m["learn_fp32"] = learned(mt32["log"])
    if not m["learn_fp32"] <= LEARN_FRACTION:
        errors.append(f"fp32 run does not learn: last/first loss {m['learn_fp32']:.2f} (max {LEARN_FRACTION})")
    if mt16 is None:
        return errors, m

    # The per-step table.
    ac, wr = refs["autocast"]["log"], refs[WRONG_RUN_VARIANT]["log"]
    say(f"    {'step':>4} {'torch fp32':>11} {'autocast':>11} {'mt fp32':>11} {'mt bf16':>11}"
        f" {'bf16-autocast':>14} {'bf16-fp32':>10} {WRONG_RUN_VARIANT + '-autocast':>18}")
    for s in range(len(ac)):
        l16 = mt16["log"][s][0] if s < len(mt16["log"]) else float("nan")
        l32 = mt32["log"][s][0] if s < len(mt32["log"]) else float("nan")
        if s < 5 or s % 5 == 4 or s == len(ac) - 1:
            say(f"    {s:>4} {refs['fp32']['log'][s][0]:11.6f} {ac[s][0]:11.6f} {l32:11.6f} {l16:11.6f}"
                f" {rp.rel(l16, ac[s][0]):14.1e} {rp.rel(l16, l32):10.1e} {rp.rel(wr[s][0], ac[s][0]):18.1e}")

    m["ac_loss"], m["ac_loss_mean"] = loss_dist(mt16["log"], ac)
    m["ac_gnorm"] = gnorm_max(mt16["log"], ac)
    m["ac_param"] = rl2(mt16["params"], refs["autocast"]["params"], cfg)
    m["tr_loss"], m["tr_loss_mean"] = loss_dist(mt16["log"], mt32["log"])
    m["tr_param"] = rl2(mt16["params"], mt32["params"], cfg)
    m["wrong_loss"], m["wrong_loss_mean"] = loss_dist(wr, ac)
    m["wrong_param"] = rl2(refs[WRONG_RUN_VARIANT]["params"], refs["autocast"]["params"], cfg)
    m["ref_loss"], m["ref_loss_mean"] = loss_dist(refs["fp32"]["log"], ac)   # torch fp32 vs autocast
    m["learn_bf16"] = learned(mt16["log"])
    say(f"  {'':34} {'loss max':>9} {'loss mean':>10} {'params rl2':>11}")
    for label, a, b, c in (("meshtrain bf16 vs autocast", m["ac_loss"], m["ac_loss_mean"], m["ac_param"]),
                           ("meshtrain bf16 vs meshtrain fp32", m["tr_loss"], m["tr_loss_mean"], m["tr_param"]),
                           (f"{WRONG_RUN_VARIANT} (wrong) vs autocast", m["wrong_loss"],
                            m["wrong_loss_mean"], m["wrong_param"]),
                           ("torch fp32 vs autocast", m["ref_loss"], m["ref_loss_mean"],
                            rl2(refs["fp32"]["params"], refs["autocast"]["params"], cfg))):
        say(f"  {label:34} {a:9.1e} {b:10.1e} {c:11.1e}")
    if not m["ac_loss"] <= AMP_LOSS_RTOL:
        errors.append(f"bf16 vs autocast: loss rel diff up to {m['ac_loss']:.2e} (tol {AMP_LOSS_RTOL:g})")
    if not m["ac_param"] <= AMP_PARAM_RL2:
        errors.append(f"bf16 vs autocast: parameters rel L2 {m['ac_param']:.2e} (tol {AMP_PARAM_RL2:g})")
    if not m["tr_loss"] <= TRACK_LOSS_RTOL:
        errors.append(f"bf16 vs fp32: loss rel diff up to {m['tr_loss']:.2e} (tol {TRACK_LOSS_RTOL:g})")
    if not m["tr_param"] >= ROUNDS_MIN_RL2:
        errors.append(f"bf16 vs fp32: parameters differ by only {m['tr_param']:.1e} rel L2 "
                      f"(min {ROUNDS_MIN_RL2:g}): does the bf16 run round at all?")
    if not m["ac_loss_mean"] < m["wrong_loss_mean"]:
        errors.append(f"bf16 is no closer to autocast (mean loss rel diff {m['ac_loss_mean']:.2e}) "
                      f"than the wrong variant {WRONG_RUN_VARIANT} ({m['wrong_loss_mean']:.2e})")
    # The export holds the fp32 masters (F32, not confined to bf16 values).
    m["bf16_fraction"] = bf16_fraction(mt16["params"])
    say(f"  last/first loss: fp32 {m['learn_fp32']:.2f}, bf16 {m['learn_bf16']:.2f} (max "
        f"{LEARN_FRACTION}); bf16 export: {m['bf16_fraction']:.2%} of its values are bf16 values "
        f"(max {MASTERS_BF16_MAX:.0%})")
    if not m["bf16_fraction"] <= MASTERS_BF16_MAX:
        errors.append(f"bf16 export: {m['bf16_fraction']:.0%} of the values are bf16 values "
                      f"(max {MASTERS_BF16_MAX:.0%}): are the masters fp32?")
    bad = sorted(n for n, h in (mt16.get("header") or {}).items()
                 if n != "__metadata__" and h["dtype"] != "F32")
    if bad:
        errors.append(f"bf16 export: not F32: {bad}")
    if not m["learn_bf16"] <= LEARN_FRACTION:
        errors.append(f"bf16 run does not learn: last/first loss {m['learn_bf16']:.2f} (max {LEARN_FRACTION})")

    # The probe: which semantics the first gradient follows.
    m["probe"] = {v: rl2(probe16, g, cfg) for v, g in grads.items() if v not in ("fp64", "spec_acc64")}
    say("  probe gradient of meshtrain bf16, rel L2 to: "
        + ", ".join(f"{v} {x:.1e}" for v, x in m["probe"].items()) + f"  (tol to spec {PROBE_TOL:g})")
    if not m["probe"]["spec"] <= PROBE_TOL:
        near = min(m["probe"], key=m["probe"].get)
        errors.append(f"probe: first gradient {m['probe']['spec']:.2e} from the spec's (tol "
                      f"{PROBE_TOL:g}); nearest variant: {near} ({m['probe'][near]:.2e})")
    return errors, m


def prepare(case, workdir):
    d = os.path.join(workdir, case["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    init, tokens = case_inputs(case)
    st.save_safetensors(os.path.join(d, "init.safetensors"), init)
    st.write_tokens(os.path.join(d, "tokens.bin"), tokens, version=case["token_version"])
    return d, init, tokens


def run_case(case, meshtrain_cmd, workdir, fp32_only, under_test="bf16"):
    t0 = time.time()
    d, init, tokens = prepare(case, workdir)
    print(f"\n=== {case['name']}: {json.dumps(tm.normalize_config(case['model']))}")
    print(f"    {json.dumps(case['train'])}")
    refs, grads = (references(case, init, tokens, (), ("fp32",)) if fp32_only else
                   references(case, init, tokens, ("autocast", WRONG_RUN_VARIANT)))
    t_torch = time.time() - t0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    errors, res = [], {}
    for key, prec in (("fp32", None),) if fp32_only else (("fp32", "fp32"), ("bf16", under_test)):
        for probe in (False, True):
            r, e = meshtrain_run(case, meshtrain_cmd, d, prec, probe, env, key)
            res[(key, probe)] = r
            errors += e
    if not errors:
        e, _ = check_case(case, refs, grads, res[("fp32", False)], res.get(("bf16", False)),
                          res[("fp32", True)]["grad"], (res.get(("bf16", True)) or {}).get("grad"), print)
        errors += e
    for e in errors[:20]:
        print("    " + e.replace("\n", "\n    "))
    print(f"{case['name']}: {'PASS' if not errors else 'FAIL'}  ({time.time() - t0:.1f}s, "
          f"PyTorch {t_torch:.1f}s; files in {d})")
    return not errors


# ----------------------------------------------------------------------------- self-test

def self_test():
    """Calibrates and checks the checks without meshtrain: a second implementation of the
    spec (spec_acc64) with the float64 reference as its fp32 run must pass; each wrong
    variant in its place must fail. Prints every distance the tolerances rest on."""
    ok = True
    for case in CASES:
        t0 = time.time()
        init, tokens = case_inputs(case)
        names = ("fp64", "autocast", "spec_acc64") + WRONG_VARIANTS
        refs, grads = references(case, init, tokens, names)
        cfg = tm.normalize_config(case["model"])
        print(f"\n=== {case['name']} ({time.time() - t0:.1f}s of PyTorch)")
        ref = {"fp32": refs["fp32"], "autocast": refs["autocast"], WRONG_RUN_VARIANT: refs[WRONG_RUN_VARIANT]}
        print("  distances of the PyTorch runs (loss max / mean over steps, final parameters rel L2, "
              "probe gradient rel L2 to spec):")
        for v in names:
            lm, lmean = loss_dist(refs[v]["log"], refs["autocast"]["log"])
            lf, _ = loss_dist(refs[v]["log"], refs["fp32"]["log"])
            pa, pf = (rl2(refs[v]["params"], refs[r]["params"], cfg) for r in ("autocast", "fp32"))
            print(f"    {v:13} vs autocast {lm:8.1e} {lmean:8.1e} {pa:8.1e}   vs fp32 {lf:8.1e} {pf:8.1e}"
                  f"   probe {rl2(grads[v], grads['spec'], cfg):8.1e}"
                  f"   last/first loss {learned(refs[v]['log']):.2f}")
        print("  stand-in for a correct engine: spec_acc64 as bf16, fp64 as fp32")
        errs, _ = check_case(case, ref, grads, refs["fp64"], refs["spec_acc64"], grads["fp64"], grads["spec_acc64"], print)
        print(f"  [{'ok' if not errs else 'FAIL'}] passes" + "".join("\n      " + e for e in errs))
        ok &= not errs
        for v in WRONG_VARIANTS:
            errs, _ = check_case(case, ref, grads, refs["fp64"], refs[v], grads["fp64"], grads[v],
                                 lambda *a: None)
            print(f"  [{'ok' if errs else 'FAIL'}] wrong variant {v} fails: "
                  + ("; ".join(e.split(":")[0] for e in errs) if errs else "it passes"))
            ok &= bool(errs)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshtrain", help="path to the meshtrain binary")
    ap.add_argument("--workdir", help="where to write case files (default: a temporary folder)")
    ap.add_argument("--only", help="run only the case with this name")
    ap.add_argument("--fp32-only", action="store_true",
                    help="meshtrain fp32 against PyTorch fp32 only, no training.precision key")
    ap.add_argument("--self-test", action="store_true", help="calibrate the checks with PyTorch alone")
    ap.add_argument("--under-test", default="bf16", choices=("bf16", "fp32", "fp16"),
                    help="the training.precision of the run checked as bf16 (fp32 or fp16: to "
                         "see the checks fail on a real engine run that is not bf16)")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="add this to each case's seed: other draws of weights and tokens, to "
                         "see how far the distances the tolerances rest on move")
    a = ap.parse_args()
    global SEED_OFFSET
    SEED_OFFSET = a.seed_offset
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.time()
    if a.self_test:
        ok = self_test()
        print(f"\nself-test: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.1f}s)")
        return 0 if ok else 1
    if not a.meshtrain:
        ap.error("--meshtrain PATH is required (or --self-test)")
    cases = [c for c in CASES if a.only in (None, c["name"])]
    if not cases:
        ap.error(f"--only: no case {a.only!r}; cases: {', '.join(c['name'] for c in CASES)}")
    workdir = a.workdir or tempfile.mkdtemp(prefix="meshtrain-amp-")
    os.makedirs(workdir, exist_ok=True)
    results = [(c["name"], run_case(c, [os.path.abspath(a.meshtrain)], workdir, a.fp32_only, a.under_test))
               for c in cases]
    return rp.report(results, workdir, a.workdir, f"summary ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    sys.exit(main())
