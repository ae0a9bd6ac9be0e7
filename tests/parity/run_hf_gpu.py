#!/usr/bin/env python3
"""bf16 training: meshtrain against Hugging Face transformers, on the GPU (or the CPU).

For a small GPT-2 and a small Llama (run_amp.py's cases) and a GPT-2 with head dim 64 and
T = 128 (the GPU's tensor-core attention at its production head size, over several
32-row tiles), from the same initial weights and tokens:
  mt bf16     meshtrain --training.device=DEVICE --training.precision=bf16
  hf bf16     transformers' GPT2LMHeadModel / LlamaForCausalLM on DEVICE: fp32 parameters
              and AdamW, the forward under torch.autocast(DEVICE, bfloat16), the loss
              (fp32, over all targets) and backward outside it; attention "sdpa"
  ref bf16    the same with torch_model.py's reference model instead (--impl reference:
              needs no transformers, so everything but the HF model runs anywhere)
  torch fp32  the same model in fp32 (the yardstick: how far bf16 lies from fp32)
with AdamW as meshtrain defines it (decay on 2-D parameters only, clip_grad_norm_, constant
learning rate: run_parity.py's arguments), the same sequences in the same order.

The initial weights are run_amp.py's (run_parity.py's draw) loaded into the HF model, which
then writes init.safetensors from its own state dict under the names meshtrain reads; so
the HF and reference runs start from identical weights, and --impl reference on the CPU
measures the very runs the tolerances below rest on. Before training, an HF model must
equal the reference in fp32 (logits and gradients of one micro-batch, on the CPU): its
config (GELU, eps, RoPE theta, tying, biases) matches meshtrain's model keys, or this fails
first.

Checks, per case and per torch model (tolerances: see below):
  - per-step loss of mt bf16 within AMP_LOSS_RTOL of the torch bf16 run, final parameters
    within AMP_PARAM_RL2 (relative L2 over all parameters);
  - mt bf16 differs from torch fp32 by ROUNDS_MIN_RL2 or more (it really rounds);
  - the loss falls (last 5 steps <= LEARN_FRACTION of the first).

    python3 tests/parity/run_hf_gpu.py --meshtrain build-gpu/meshtrain [--device cuda]
        [--impl hf|reference|both] [--attn sdpa|eager] [--only NAME] [--workdir DIR]
    /usr/bin/python3 tests/parity/run_hf_gpu.py --meshtrain build/meshtrain --device cpu \\
        --impl reference            # without a GPU or transformers

Exit status 1 if any check fails.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_amp as ra  # noqa: E402
import run_parity as rp  # noqa: E402
import st  # noqa: E402
import torch_model as tm  # noqa: E402

# The cases: run_amp.py's two, with their inputs (seed_of: whose seed draws the weights and
# tokens), and gpt2_tc: d_model 128 in 2 heads of 64, T 128.
CASES = [dict(c, seed_of=c["name"]) for c in ra.CASES] + [
    dict(name="gpt2_tc",
         model=dict(family="gpt2", n_layer=2, n_head=2, d_model=128, vocab_size=128, seq_len=128,
                    norm_eps=1e-5),
         omit=(), token_version=1, train=dict(ra.CASES[0]["train"]), seed_of="gpt2_amp"),
]

# ----------------------------------------------------------------------------- tolerances
#
# bf16 against bf16: two implementations that round at different points drift apart by
# ~1e-3 in loss and ~5e-3 in the parameters over 40 steps (run_amp.py's "tolerances":
# rounding to 8 mantissa bits costs up to 2^-9 per rounding, training amplifies it).
# Measured on the CPU (--device cpu --impl reference), meshtrain bf16 against the reference
# under CPU autocast (loss max / parameters rel L2): gpt2_amp 7.4e-4 / 4.6e-3, llama_amp
# 7.7e-4 / 8.0e-3, gpt2_tc 5.2e-4 / 5.6e-3; torch fp32 against autocast is as far
# (4.5e-4..1.9e-3 / 4.5e-3..7.1e-3).
# On the GPU both sides round more alike than on the CPU (meshtrain's attention there takes
# 16-bit operands, as sdpa under autocast does: README "GPUs (CUDA)"), and sum in other
# orders (cuBLASLt, flash kernels), which is the same kind of noise. Measured on an H100
# (transformers 5.17), meshtrain bf16 against the HF model under autocast: gpt2_amp
# 7.8e-4 / 4.6e-3, llama_amp 6.5e-4 / 7.6e-3, gpt2_tc 3.3e-3 / 8.2e-3, where PyTorch's fp32
# run lies 3.0e-3 / 7.6e-3 from the HF bf16 run (gpt2_tc): meshtrain is as far from it as
# fp32 is. The bounds are run_amp.py's.
AMP_LOSS_RTOL = ra.AMP_LOSS_RTOL      # 5e-3, per-step loss, relative
AMP_PARAM_RL2 = ra.AMP_PARAM_RL2      # 4e-2, final parameters, ||a - b|| / ||b||
# meshtrain bf16 must differ from torch fp32: measured 4.0e-3..6.9e-3 on the CPU; meshtrain
# run at training.precision=fp32 in its place measures 8.2e-7 (gpt2_amp) and fails.
ROUNDS_MIN_RL2 = ra.ROUNDS_MIN_RL2    # 1e-4
LEARN_FRACTION = ra.LEARN_FRACTION    # 0.6 (measured 0.37, 0.33, 0.21)
# The HF model against the reference, both fp32, one micro-batch at the initial weights:
# max|logits diff| / max|logits| and the gradients' rel L2. Two fp32 implementations differ
# by summation order: the reference in fp32 against float64 measures <= 6.2e-7 / 4.8e-7 on
# these cases. Configs that are not meshtrain's model move far more: exact-erf GELU
# 2.3e-4 / 2.2e-4 (the smallest seen), norm eps 1e-6 for 1e-5 6.8e-4 / 4.8e-4, RoPE theta
# 5e5 for 1e4 0.23 / 0.16. 2e-5 sits 30x above the noise and 10x below those.
FP32_MATCH_TOL = 2e-5


# ----------------------------------------------------------------------------- models

def import_transformers():
    try:
        import transformers
    except ImportError as e:
        sys.exit(f"run_hf_gpu.py --impl hf needs Hugging Face transformers, which does not import "
                 f"here ({e}); install it, or run --impl reference (torch_model.py's model).")
    return transformers


def hf_model(cfg, attn):
    """An fp32 transformers model with meshtrain's numerics for a model config (seeded
    Hugging Face initialization; the caller loads the case's weights)."""
    tr = import_transformers()
    c = tm.normalize_config(cfg)
    if c["family"] == "gpt2":
        from transformers.activations import ACT2FN
        # meshtrain's GPT-2 uses the tanh GELU: "gelu_pytorch_tanh" is F.gelu(approximate=
        # "tanh"), one kernel; "gelu_new" the same formula in elementwise steps (under
        # autocast each step rounds to bf16), the fallback for transformers without it.
        act = "gelu_pytorch_tanh" if "gelu_pytorch_tanh" in ACT2FN else "gelu_new"
        conf = tr.GPT2Config(vocab_size=c["vocab_size"], n_positions=c["seq_len"], n_embd=c["d_model"],
                             n_layer=c["n_layer"], n_head=c["n_head"], n_inner=c["d_ff"],
                             activation_function=act, layer_norm_epsilon=c["norm_eps"],
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             tie_word_embeddings=c["tie_embeddings"])
    else:
        # transformers 5 folds RoPE's settings into rope_parameters (its configs have no
        # rope_theta attribute); 4.x takes rope_theta.
        theta = float(c["rope_theta"])
        if hasattr(tr.LlamaConfig(), "rope_parameters"):
            rope = dict(rope_parameters={"rope_type": "default", "rope_theta": theta})
        else:
            rope = dict(rope_theta=theta)
        conf = tr.LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["d_model"],
                              intermediate_size=c["d_ff"], num_hidden_layers=c["n_layer"],
                              num_attention_heads=c["n_head"], num_key_value_heads=c["n_kv_head"],
                              hidden_act="silu", max_position_embeddings=c["seq_len"],
                              rms_norm_eps=c["norm_eps"], tie_word_embeddings=c["tie_embeddings"],
                              attention_bias=False, mlp_bias=False, attention_dropout=0.0, **rope)
        got = (getattr(conf, "rope_parameters", None) or {}).get("rope_theta", getattr(conf, "rope_theta", None))
        if got != theta:
            sys.exit(f"LlamaConfig holds RoPE theta {got!r}, not {theta} ({rope})")
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(conf, attn_implementation=attn).float()
    got = getattr(model.config, "_attn_implementation", attn)
    if got != attn:
        sys.exit(f"transformers built attention {got!r}, not {attn!r}")
    return model


def load_weights(model, cfg, init):
    """Copy {HF name: array} into a model (HF or reference); its parameters must be exactly
    init's names (a tied head shares the embedding's storage)."""
    want = tm.expected_shapes(cfg)
    names = {n for n, _ in model.named_parameters()}
    if names != set(want):
        raise ValueError(f"the model's parameters are not meshtrain's: missing {sorted(set(want) - names)}, "
                         f"unexpected {sorted(names - set(want))}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, shape in want.items():
            if tuple(params[n].shape) != shape:
                raise ValueError(f"{n}: shape {tuple(params[n].shape)} in the model, {shape} in meshtrain")
            params[n].copy_(torch.from_numpy(np.asarray(init[n])))
    if cfg["tie_embeddings"] and hasattr(model, "get_output_embeddings"):
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise ValueError("tie_embeddings: the HF model's lm_head is not its input embedding")
    return model


def export(model, cfg):
    """The model's state dict under the names meshtrain reads ({name: float32 array}): a
    tied head is the embedding, written once; GPT-2's Conv1D weights are [in, out] on both
    sides (hf.cpp transposes them into meshtrain's [out, in])."""
    sd = model.state_dict()
    return {n: sd[n].detach().float().cpu().numpy().copy() for n in tm.expected_shapes(cfg)}


def build(impl, cfg, init, device, attn):
    c = tm.normalize_config(cfg)
    model = hf_model(c, attn) if impl == "hf" else tm.Model(c)
    return load_weights(model, c, init).to(device).train()


def logits_fn(model, impl):
    if impl == "hf":
        return lambda x: model(input_ids=x, use_cache=False).logits
    return model


def fp32_match(case, init, tokens, device, attn):
    """The HF model against the reference, fp32, one micro-batch: (logits max diff / max,
    gradients rel L2)."""
    cfg, M, T = case["model"], case["train"]["micro_batch"], case["model"]["seq_len"]
    x, y = (t.to(device) for t in tm.sequences(tokens, 0, M, T))
    out = {}
    for impl in ("hf", "reference"):
        model = build(impl, cfg, init, device, attn)
        logits = logits_fn(model, impl)(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        out[impl] = (logits.detach().double().cpu(),
                     {n: p.grad.detach().double().cpu().numpy() for n, p in model.named_parameters()})
    (lh, gh), (lr, gr) = out["hf"], out["reference"]
    return (float((lh - lr).abs().max() / lr.abs().max()),
            ra.rl2(gh, gr, tm.normalize_config(cfg)))


def from_pretrained_match(case, path, params, tokens, attn):
    """transformers' from_pretrained of an export directory (config.json and model.safetensors)
    against the HF model built from meshtrain's config and loaded with params, on the CPU in
    fp32, first micro-batch: logits max diff / max."""
    M, T = case["train"]["micro_batch"], case["model"]["seq_len"]
    x, _ = tm.sequences(tokens, 0, M, T)
    loaded = import_transformers().AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).float().eval()
    built = build("hf", case["model"], params, "cpu", attn).eval()
    with torch.no_grad():
        a, b = (logits_fn(model, "hf")(x).double() for model in (loaded, built))
    return float((a - b).abs().max() / b.abs().max())


def train_torch(case, init, tokens, impl, device, bf16, attn):
    """AdamW training as meshtrain does it; returns dict(log=[(loss, grad_norm)], params)."""
    cfg, t = case["model"], case["train"]
    G, M, T = t["global_batch"], t["micro_batch"], cfg["seq_len"]
    model = build(impl, cfg, init, device, attn)
    fwd = logits_fn(model, impl)
    opt = tm.make_optimizer(model, t["lr"], t["beta1"], t["beta2"], t["eps"], t["weight_decay"])
    params = list(model.parameters())
    log = []
    for s in range(t["steps"]):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for m in range(G // M):
            x, y = (a.to(device) for a in tm.sequences(tokens, s * G + m * M, M, T))
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                logits = fwd(x)
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                       reduction="sum")
            (loss_sum / (G * T)).backward()
            total += loss_sum.detach().double()
        norm = torch.nn.utils.clip_grad_norm_(params, t["grad_clip"] if t["grad_clip"] > 0 else float("inf"))
        opt.step()
        log.append((float(total) / (G * T), float(norm)))
    return dict(log=log, params=export(model, tm.normalize_config(cfg)))


# ----------------------------------------------------------------------------- meshtrain

def meshtrain_run(case, binary, d, device, env):
    """meshtrain bf16 on `device` from d/init.safetensors and d/tokens.bin, then export.
    Returns (dict(log, params) or None, errors)."""
    p = {k: os.path.join(d, f"mt_{k}") for k in ("metrics.jsonl", "ckpt", "final.safetensors")}
    args = rp.meshtrain_train_args(case, os.path.join(d, "init.safetensors"), os.path.join(d, "tokens.bin"),
                                   p["metrics.jsonl"], p["ckpt"])
    args += [f"--training.device={device}", "--training.precision=bf16", "--logging.progress=off"]
    log_path = os.path.join(d, "meshtrain.log")
    ok, msg = rp.run_command([binary] + args, log_path, env)
    if ok:
        ok, msg = rp.run_command([binary, "export", "--checkpoint", p["ckpt"], "--out", p["final.safetensors"]],
                                 log_path, env)
    if ok:  # the same as a directory with config.json, for from_pretrained
        ok, msg = rp.run_command([binary, "export", "--checkpoint", p["ckpt"], "--out", os.path.join(d, "mt_hf") + "/"],
                                 log_path, env)
    if not ok:
        return None, [f"meshtrain: {msg}"]
    metrics = rp.read_metrics(p["metrics.jsonl"])
    steps = case["train"]["steps"]
    log = [(float(metrics[s]["loss"]), float(metrics[s]["grad_norm"])) for s in range(steps) if s in metrics]
    if len(log) != steps:
        return None, [f"meshtrain: metrics hold {len(log)} of {steps} steps"]
    return dict(log=log, params=st.load_safetensors(p["final.safetensors"])), []


# ----------------------------------------------------------------------------- a case

def run_case(case, binary, workdir, device, impls, attn):
    t0 = time.time()
    cfg = tm.normalize_config(case["model"])
    d = os.path.join(workdir, case["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    init, tokens = ra.case_inputs(dict(case, name=case["seed_of"]))
    print(f"\n=== {case['name']}: {cfg}")
    errors, m = [], {}
    if "hf" in impls:
        # On the CPU: a check of the config, away from the GPU kernels' own fp32 paths.
        m["fp32_logits"], m["fp32_grads"] = fp32_match(case, init, tokens, "cpu", attn)
        print(f"  HF vs reference, fp32 on the CPU, first micro-batch: logits {m['fp32_logits']:.1e}, gradients "
              f"{m['fp32_grads']:.1e} (tol {FP32_MATCH_TOL:g})")
        if not max(m["fp32_logits"], m["fp32_grads"]) <= FP32_MATCH_TOL:
            errors.append("the HF model does not compute the reference's fp32 function: check its config")
        # meshtrain starts from the HF model's own state dict.
        init_file = export(build("hf", cfg, init, "cpu", attn), cfg)
        if any(not np.array_equal(init_file[n], init[n]) for n in init):
            errors.append("the HF model's state dict does not hold the weights loaded into it")
    else:
        init_file = init
    st.save_safetensors(os.path.join(d, "init.safetensors"), init_file)
    st.write_tokens(os.path.join(d, "tokens.bin"), tokens, version=case["token_version"])

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    t1 = time.time()
    mt, e = meshtrain_run(case, binary, d, device, env)
    errors += e
    t_mt = time.time() - t1
    t1 = time.time()
    runs = {"fp32": train_torch(case, init, tokens, impls[0], device, False, attn)}
    for impl in impls:
        runs[impl] = train_torch(case, init, tokens, impl, device, True, attn)
    t_torch = time.time() - t1
    if mt is None:
        for e in errors:
            print("    " + e.replace("\n", "\n    "))
        print(f"{case['name']}: FAIL")
        return False, m

    cols = [("torch fp32", runs["fp32"])] + [(f"{i} bf16", runs[i]) for i in impls]
    print(f"  {'step':>4} " + " ".join(f"{n:>11}" for n, _ in cols) + f" {'mt bf16':>11} "
          + " ".join(f"{'mt-' + i:>12}" for i in impls) + f" {'fp32-' + impls[0]:>12}")
    ref0 = runs[impls[0]]["log"]
    for s, (loss, _) in enumerate(mt["log"]):
        if s < 5 or s % 5 == 4 or s == len(mt["log"]) - 1:
            print(f"  {s:>4} " + " ".join(f"{r['log'][s][0]:11.6f}" for _, r in cols) + f" {loss:11.6f} "
                  + " ".join(f"{rp.rel(loss, runs[i]['log'][s][0]):12.1e}" for i in impls)
                  + f" {rp.rel(runs['fp32']['log'][s][0], ref0[s][0]):12.1e}")
    print(f"  {'':30} {'loss max':>9} {'loss mean':>10} {'grad_norm max':>14} {'params rl2':>11}")
    rows = [(f"mt bf16 vs {i} bf16", mt, runs[i]) for i in impls]
    rows += [("mt bf16 vs torch fp32", mt, runs["fp32"]), (f"torch fp32 vs {impls[0]} bf16", runs["fp32"], runs[impls[0]])]
    if len(impls) > 1:
        rows.append(("hf bf16 vs reference bf16", runs["hf"], runs["reference"]))
    for label, a, b in rows:
        lmax, lmean = ra.loss_dist(a["log"], b["log"])
        m[label] = dict(loss=lmax, param=ra.rl2(a["params"], b["params"], cfg))
        print(f"  {label:30} {lmax:9.1e} {lmean:10.1e} {ra.gnorm_max(a['log'], b['log']):14.1e} "
              f"{m[label]['param']:11.1e}")
    for i in impls:
        r = m[f"mt bf16 vs {i} bf16"]
        if not r["loss"] <= AMP_LOSS_RTOL:
            errors.append(f"mt bf16 vs {i} bf16: loss rel diff up to {r['loss']:.2e} (tol {AMP_LOSS_RTOL:g})")
        if not r["param"] <= AMP_PARAM_RL2:
            errors.append(f"mt bf16 vs {i} bf16: parameters rel L2 {r['param']:.2e} (tol {AMP_PARAM_RL2:g})")
    r = m["mt bf16 vs torch fp32"]
    if not r["param"] >= ROUNDS_MIN_RL2:
        errors.append(f"mt bf16 vs torch fp32: parameters differ by only {r['param']:.1e} (min "
                      f"{ROUNDS_MIN_RL2:g}): does meshtrain round at all?")
    if "hf" in impls:
        m["from_pretrained"] = from_pretrained_match(case, os.path.join(d, "mt_hf"), mt["params"], tokens, attn)
        print(f"  transformers' from_pretrained of meshtrain's export directory against the HF model built here "
              f"with its parameters, fp32 logits: {m['from_pretrained']:.1e} (tol {FP32_MATCH_TOL:g})")
        if not m["from_pretrained"] <= FP32_MATCH_TOL:
            errors.append("from_pretrained of meshtrain's export (config.json) computes another function")
    m["learn"] = ra.learned(mt["log"])
    print(f"  meshtrain last/first loss {m['learn']:.2f} (max {LEARN_FRACTION})")
    if not m["learn"] <= LEARN_FRACTION:
        errors.append(f"meshtrain bf16 does not learn: last/first loss {m['learn']:.2f}")
    for e in errors:
        print("    " + e)
    print(f"{case['name']}: {'PASS' if not errors else 'FAIL'}  ({time.time() - t0:.1f}s: meshtrain "
          f"{t_mt:.1f}s, torch {t_torch:.1f}s)")
    return not errors, m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshtrain", required=True, help="path to the meshtrain binary")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--impl", default="hf", choices=("hf", "reference", "both"),
                    help="the torch model: transformers' (hf), torch_model.py's (reference), or both")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="the HF attention")
    ap.add_argument("--only", help="run only the case with this name")
    ap.add_argument("--workdir", help="where to write case files (default: a temporary folder)")
    a = ap.parse_args()
    impls = ("hf", "reference") if a.impl == "both" else (a.impl,)
    if "hf" in impls:
        tr = import_transformers()
        print(f"transformers {tr.__version__}")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no GPU here (run --device cpu)")
        torch.backends.cuda.matmul.allow_tf32 = False   # torch fp32 is fp32, as meshtrain's
        torch.backends.cudnn.allow_tf32 = False
        print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    else:
        torch.set_num_threads(min(4, os.cpu_count() or 1))
        print(f"torch {torch.__version__} on the CPU")
    cases = [c for c in CASES if a.only in (None, c["name"])]
    if not cases:
        ap.error(f"--only: no case {a.only!r}; cases: {', '.join(c['name'] for c in CASES)}")
    workdir = a.workdir or tempfile.mkdtemp(prefix="meshtrain-hf-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    results = [(c["name"], run_case(c, os.path.abspath(a.meshtrain), workdir, a.device, impls, a.attn)[0])
               for c in cases]
    return rp.report(results, workdir, a.workdir, f"summary, {a.device}, {'+'.join(impls)} "
                                                  f"({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    sys.exit(main())
