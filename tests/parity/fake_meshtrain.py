"""A stand-in for the `meshtrain` binary, used only by `run_parity.py --self-test`.

It speaks the command-line contract run_parity.py relies on (`train --section.key=value
...`, `export --checkpoint DIR --out FILE`), but trains with the PyTorch reference, so the
driver can be tested end to end before (and independently of) the C++ engine.

MESHTRAIN_FAKE_BUG=<name> injects a deliberate formula error, to check that the parity
comparison catches it: gelu_erf (exact GELU instead of tanh), rope_interleaved (RoPE on
adjacent pairs), decay_all (weight decay on 1-D parameters too), micro_mean (loss
averaged per micro-batch instead of over the global batch), lamb_no_trust (LAMB's trust
ratio left out), lars_adapt_all (LARS's local learning rate on 1-D parameters too).
"""
import json
import os
import shutil
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import torch_model as tm  # noqa: E402


def inject_bug(name):
    if name == "gelu_erf":
        gelu = F.gelu
        F.gelu = lambda x, approximate="none": gelu(x)
    elif name == "rope_interleaved":
        def rotate_pairs(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        tm.rotate_half = rotate_pairs
    elif name == "decay_all":
        make = tm.make_optimizer
        def decay_all(model, lr, b1, b2, eps, wd, **kw):
            opt = make(model, lr, b1, b2, eps, wd, **kw)
            for g in opt.param_groups:
                g["weight_decay"] = wd
            return opt
        tm.make_optimizer = decay_all
    elif name == "lamb_no_trust":
        tm.lamb_lars.Lamb.trust_ratio = staticmethod(lambda w_norm, u_norm: 1.0)
    elif name == "lars_adapt_all":
        make = tm.make_optimizer
        def adapt_all(*a, **kw):
            opt = make(*a, **kw)
            for g in opt.param_groups:
                g["adapt"] = True
            return opt
        tm.make_optimizer = adapt_all
    elif name:
        sys.exit(f"fake meshtrain: unknown MESHTRAIN_FAKE_BUG {name!r}")


def parse_keys(argv):
    keys = {}
    for a in argv:
        if not a.startswith("--") or "=" not in a:
            sys.exit(f"fake meshtrain: expected --section.key=value, got {a!r}")
        k, v = a[2:].split("=", 1)
        keys[k] = v
    return keys


def train(argv):
    bug = os.environ.get("MESHTRAIN_FAKE_BUG", "")
    if bug != "micro_mean":
        inject_bug(bug)
    k = parse_keys(argv)
    torch.set_num_threads(1)
    ints = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "seq_len")
    cfg = {"family": k.pop("model.family")}
    for name in ints + ("norm_eps", "rope_theta", "tie_embeddings"):
        v = k.pop("model." + name, None)
        if v is not None:
            cfg[name] = int(v) if name in ints else (v == "true" if name == "tie_embeddings" else float(v))
    init = st.load_safetensors(k.pop("model.init_from"))
    tokens = st.read_tokens(k.pop("data.path"))
    assert k.pop("data.shuffle") == "false"
    optim = {"optim": k.pop("optim.name")}
    optim.update({n: float(k.pop("optim." + n)) for n in ("momentum", "trust_coef") if "optim." + n in k})
    G, M = int(k.pop("training.global_batch")), int(k.pop("training.micro_batch"))
    model = tm.Model(cfg).load_numpy(init)
    if bug == "micro_mean":   # gradients G/M times too large; the reported loss stays right
        for p in model.parameters():
            p.register_hook(lambda g: g * (G / M))
    lr = float(k.pop("optim.lr"))
    opt = tm.make_optimizer(model, lr, float(k.pop("optim.beta1")), float(k.pop("optim.beta2")),
                            float(k.pop("optim.eps")), float(k.pop("optim.weight_decay")), **optim)
    clip = float(k.pop("optim.grad_clip"))
    with open(k.pop("logging.metrics"), "w") as f:
        f.write(json.dumps({"event": "start", "step": 0, "loss": 0.0}) + "\n")  # must be ignored
        for s in range(int(k.pop("training.steps"))):
            loss, norm = tm.train_step(model, opt, tokens, s, G, M, clip)
            f.write(json.dumps({"step": s, "loss": loss, "grad_norm": norm, "lr": lr,
                                "tokens_per_s": 0.0, "step_ms": 0.0}) + "\n")
    ckpt = k.pop("checkpoint.dir")
    os.makedirs(ckpt, exist_ok=True)
    st.save_safetensors(os.path.join(ckpt, "fake.safetensors"), model.to_numpy())


def export(argv):
    args = dict(zip(argv[0::2], argv[1::2]))
    shutil.copyfile(os.path.join(args["--checkpoint"], "fake.safetensors"), args["--out"])


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("train", "export"):
        sys.exit("usage: fake_meshtrain.py train|export ...")
    (train if sys.argv[1] == "train" else export)(sys.argv[2:])
