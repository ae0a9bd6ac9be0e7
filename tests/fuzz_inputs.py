#!/usr/bin/env python3
"""Mutation fuzzing of what users hand meshtrain, through its command line.

Makes valid inputs first (a text, a token file, a checkpoint, its safetensors export, a
schedule file, a hardware profile, a configuration, a SentencePiece model), then, case by
case, mutates one of them (or a command's numbers) and runs the command that reads it. A
case fails when the command:
  - crashes (a signal, an abort) or trips a sanitizer (an ASan/UBSan build, see README);
  - exits with a status other than 0, 1 (an error, named) or 75 (stopped, resumable);
  - hangs (FUZZ_TIMEOUT_S, default 60);
  - stops with "internal error" (an exception meshtrain did not turn into a message that
    names the input) or a library's bare text ("basic_string", "stoll", ...).
An error message naming the problem is the right answer; so is running. Each failing case
is kept in KEEP_DIR with the command (CMD) and its output (OUTPUT).

    tests/fuzz_inputs.py MESHTRAIN [--cases 300] [--seed 1] [--only config,tokens,...] [--keep KEEP_DIR]

Exit status 1 if any case failed. The same seed and binary give the same cases.
"""
import argparse
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=16", "--model.vocab_size=257",
        "--training.global_batch=2", "--training.val_every=0", "--logging.progress=off"]
INTS = [0, -1, 1, 2, 3, 7, 255, 256, 257, 65535, 65536, 2**31 - 1, 2**31, -2**31, 2**32, 2**53, 2**63 - 1, -2**63,
        10**12]
FLOATS = [0.0, -0.0, -1.0, 1e-45, 1e-300, 1e300, 1e308, float("inf"), float("-inf"), float("nan"), 0.5]
CONFIG_VALUES = ["0", "-1", "1", "2", "3", "7", "257", "65536", "100000", "2147483647", "2147483648",
                 "9223372036854775807", "-9223372036854775808", "1e308", "1e-45", "0.5", "nan", "inf", "-inf", '""',
                 '"x"', "true", "[]", "[1, 2]", "{}", "[[1]]", "[1.5]", '["a", 1]', "[-1, 3]", '["optim.lr"]']
FAILURES = [(r"AddressSanitizer|LeakSanitizer|runtime error:", "sanitizer"),
            (r"terminate called", "uncaught exception"),
            (r"internal error", "internal error"),
            (r"basic_string|vector::|std::bad_alloc|std::length_error|\bstoi\b|\bstoll\b|\bstod\b", "library text")]

# A configuration of every kind of key, small enough to train in a moment.
TINY_TOML = """[model]
family = "gpt2"
n_layer = 1
n_head = 2
n_kv_head = 0
d_model = 32
d_ff = 0
vocab_size = 257
seq_len = 16
norm_eps = 1e-5
rope_theta = 10000.0
tie_embeddings = true

[data]
path = "tokens.bin"
val_fraction = 0.1

[training]
steps = 2
global_batch = 4
micro_batch = 2
seed = 1
val_every = 1
val_batches = 1
threads = 1
recompute = false
recompute_blocks = 0

[optim]
lr = 0.003
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
grad_clip = 1.0
warmup_steps = 1
min_lr_ratio = 0.1
step_size = 1
step_gamma = 0.5
momentum = 0.9
trust_coef = 0.001
lr_base_batch = 0
loss_scale = 65536.0
loss_scale_window = 1000

[parallel]
bucket_mb = 25.0
powersgd_rank = 4
pp_layers = "auto"

[checkpoint]
allow_change = ""

[logging]
progress = "off"
every = 1
"""


def number(r):
    return r.choice(INTS) if r.random() < 0.6 else r.choice(FLOATS)


def json_value(r, v):
    """A replacement for a JSON value: a number, a string or container of another kind, or v changed."""
    c = r.random()
    if c < 0.45:
        return number(r)
    if c < 0.55:
        return r.choice(["", "x", "F32", "BF16", "I64", "../x", "a" * 300])
    if c < 0.65:
        return r.choice([None, True, False, [], {}, [1, 2, 3], [-1], [2**40, 2**40]])
    if isinstance(v, list) and v:
        v = list(v)
        i = r.randrange(len(v))
        if r.random() < 0.5:
            del v[i]
        else:
            v[i] = json_value(r, v[i])
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return v + r.choice([-1, 1, -2**16, 2**16])
    return number(r)


def json_mutate(r, doc):
    """Changes or deletes 1 to 3 nodes of a JSON document, in place."""
    def paths(j, path=()):
        yield path
        items = j.items() if isinstance(j, dict) else enumerate(j) if isinstance(j, list) else []
        for k, v in items:
            yield from paths(v, path + (k,))
    for _ in range(r.randint(1, 3)):
        p = r.choice([p for p in paths(doc) if p])
        parent = doc
        for k in p[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and r.random() < 0.15:
            del parent[p[-1]]
        else:
            parent[p[-1]] = json_value(r, parent[p[-1]])
    return doc


def bytes_mutate(r, data, header=0):
    """1 to 4 byte-level changes, most of them within the first `header` bytes when given."""
    data = bytearray(data)
    for _ in range(r.randint(1, 4)):
        if not data:
            break
        hi = min(len(data), header) if header and r.random() > 0.3 else len(data)
        c, i = r.random(), r.randrange(max(1, hi - 8))
        if c < 0.4:
            data[i] = r.randrange(256)
        elif c < 0.55:
            del data[r.randrange(len(data)):]
        elif c < 0.7:
            data[i:i + 4] = struct.pack("<i", r.choice([x for x in INTS if -2**31 <= x < 2**31]))
        elif c < 0.8:
            data[i:i + 8] = struct.pack("<Q", r.choice([0, 1, 2**63, 2**64 - 1, len(data), len(data) + 1, 2**32]))
        elif c < 0.9:
            data[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 16)))
        else:
            j = r.randrange(i, min(len(data), i + 64))
            data[j:j] = data[i:j]
    return bytes(data)


def pb_parse(data):
    """A protocol buffer message as [field, wire type, value], or None when data is not one. Length-delimited
    values that parse as messages are parsed too (a string may pass for one: either way it is bytes to mutate)."""
    def varint(i):
        v, shift = 0, 0
        while True:
            if i >= len(data) or shift > 63:
                raise ValueError
            v |= (data[i] & 0x7F) << shift
            shift += 7
            i += 1
            if data[i - 1] < 0x80:
                return v, i
    fields, i = [], 0
    try:
        while i < len(data):
            key, i = varint(i)
            field, wire = key >> 3, key & 7
            if field == 0 or wire not in (0, 1, 2, 5):
                return None
            if wire == 0:
                v, i = varint(i)
            elif wire in (1, 5):
                n = 8 if wire == 1 else 4
                v, i = data[i:i + n], i + n
                if i > len(data):
                    return None
            else:
                n, i = varint(i)
                v, i = data[i:i + n], i + n
                if i > len(data):
                    return None
                v = (pb_parse(v) if v else None) or v
            fields.append([field, wire, v])
    except ValueError:
        return None
    return fields


def pb_write(fields):
    def varint(v):
        out = bytearray()
        v &= 2**64 - 1
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)
    out = bytearray()
    for field, wire, v in fields:
        out += varint(field << 3 | wire)
        if wire == 0:
            out += varint(v)
        elif wire == 2:
            v = pb_write(v) if isinstance(v, list) else v
            out += varint(len(v)) + v
        else:
            out += v
    return bytes(out)


def pb_mutate(r, data):
    """1 to 3 changes to a protocol buffer's fields at any depth: a number, a float, a string replaced, a field
    deleted or repeated. The result still parses, so the reader's own checks meet it."""
    doc = pb_parse(data)
    def leaves(fields):
        for f in fields:
            yield fields, f
            if isinstance(f[2], list):
                yield from leaves(f[2])
    for _ in range(r.randint(1, 3)):
        parent, f = r.choice(list(leaves(doc)))
        c = r.random()
        if c < 0.1:
            parent.remove(f)
        elif c < 0.2 or isinstance(f[2], list):
            parent.insert(r.randrange(len(parent) + 1), [f[0], f[1], f[2]])
        elif f[1] == 0:
            f[2] = r.choice([0, 1, 2, 3, 4, 5, 6, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**64 - 1, f[2] + 1])
        elif f[1] == 5:
            f[2] = struct.pack("<f", r.choice([0.0, -0.0, -1.0, 0.5, 1e-45, -1e30, 3.4e38, float("inf"), float("-inf"), float("nan")]))
        elif f[1] == 1:
            f[2] = struct.pack("<d", r.choice(FLOATS))
        else:
            f[2] = r.choice([b"", b"a", b"<0x41>", b"<0xZZ>", b"\xff\xfe", "\u2581".encode(), b"a" * 300, b"<unk>",
                             b"<s>", b"\x00"])
    return pb_write(doc)


def text_mutate(r, text):
    """1 to 3 line-level changes: a number replaced, a line deleted, repeated, cut or extended."""
    lines = text.split("\n")
    for _ in range(r.randint(1, 3)):
        c, i = r.random(), r.randrange(len(lines))
        nums = list(re.finditer(r"-?\d+(\.\d+)?(e[+-]?\d+)?", lines[i]))
        if c < 0.5 and nums:
            m = r.choice(nums)
            v = number(r)
            s = r.choice([repr(v), "nan", "inf", "-inf", "1e999"]) if isinstance(v, float) else repr(v)
            lines[i] = lines[i][:m.start()] + s + lines[i][m.end():]
        elif c < 0.65:
            del lines[i]
        elif c < 0.8:
            lines.insert(i, lines[r.randrange(len(lines))])
        elif c < 0.9 and "," in lines[i]:
            parts = lines[i].split(",")
            del parts[r.randrange(len(parts))]
            lines[i] = ",".join(parts)
        else:
            lines[i] += r.choice([",", ",,", " x", "\x00", "=", '"', "[", "]"])
    return "\n".join(lines)


class Fuzzer:
    def __init__(self, meshtrain, keep, seed, timeout):
        self.mt, self.keep, self.timeout = meshtrain, keep, timeout
        self.r = random.Random(seed)
        self.tmp = tempfile.mkdtemp(prefix="meshtrain-fuzz-")
        self.seeds = os.path.join(self.tmp, "seeds")
        self.failures = {}  # (target, kind, signature) -> count
        self.runs = 0

    def make_seeds(self):
        """The valid inputs every case starts from."""
        os.makedirs(self.seeds)
        text = "".join(f"{i} + {i * 7 % 13} = {i + i * 7 % 13}\nthe quick brown fox {i}\n" for i in range(600))
        with open(os.path.join(self.seeds, "text.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(self.seeds, "tiny.toml"), "w") as f:
            f.write(TINY_TOML)
        shutil.copy(os.path.join(HERE, "..", "configs", "hardware_example.toml"), os.path.join(self.seeds, "hw.toml"))
        for args in (["prepare", "--input", "text.txt", "--out", "tokens.bin"],
                     ["train", "--data.path=tokens.bin", "--training.steps=2", "--checkpoint.dir=ckpt"] + TINY,
                     ["export", "--checkpoint", "ckpt", "--out", "model.safetensors"],
                     ["prepare", "--input", "text.txt", "--out", "spm_tokens.bin", "--train-tokenizer", "300",
                      "--tokenizer-prefix", "spm"],
                     ["schedule", "--pp", "2", "--microbatches", "4", "--csv", "sched.txt"]):
            p = subprocess.run([self.mt] + args, cwd=self.seeds, capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"fuzz_inputs: making the seed inputs failed: {' '.join(args)}\n{p.stdout}{p.stderr}")

    def seed(self, name):
        with open(os.path.join(self.seeds, name), "rb") as f:
            return f.read()

    def run(self, target, args, files):
        """Runs meshtrain with args in a fresh directory holding files (name -> bytes or text)."""
        work = os.path.join(self.tmp, "work")
        shutil.rmtree(work, ignore_errors=True)
        for name, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(work, name)), exist_ok=True)
            with open(os.path.join(work, name), "wb") as f:
                f.write(data if isinstance(data, bytes) else data.encode())
        os.makedirs(work, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
        self.runs += 1
        try:
            p = subprocess.run([self.mt] + args, cwd=work, env=env, capture_output=True, timeout=self.timeout)
            out, rc = (p.stdout + p.stderr).decode(errors="replace"), p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace"), None
        kind = "hang" if rc is None else f"signal or abort (exit {rc})" if rc < 0 or rc >= 128 else None
        kind = kind or (f"exit status {rc}, not 0, 1 or 75" if rc not in (0, 1, 75) else None)
        kind = kind or next((k for pat, k in FAILURES if re.search(pat, out)), None)
        if not kind:
            return
        key = (target, kind, signature(out))
        self.failures[key] = self.failures.get(key, 0) + 1
        if self.failures[key] > 1:
            return
        print(f"case {self.runs}: {target}: {kind}: {key[2]}\n  {' '.join(args)}", flush=True)
        if self.keep:
            d = os.path.join(self.keep, f"{len(self.failures):03d}_{target.replace(':', '_')}")
            shutil.copytree(work, d)
            with open(os.path.join(d, "CMD"), "w") as f:
                f.write(" ".join([self.mt] + args) + f"\n# {kind}\n")
            with open(os.path.join(d, "OUTPUT"), "w") as f:
                f.write(out)

    # ---- Targets: each mutates one input and runs one command that reads it ----

    def t_config(self):
        lines = self.seed("tiny.toml").decode().split("\n")
        keyed = [i for i, l in enumerate(lines) if "=" in l and not l.startswith("steps")]  # a long run is no failure
        for _ in range(self.r.randint(1, 2)):
            i = self.r.choice(keyed)
            lines[i] = lines[i].split("=")[0].strip() + " = " + self.r.choice(CONFIG_VALUES)
        text = "\n".join(lines)
        if self.r.random() < 0.3:  # the file's syntax too: lines cut, repeated, extended
            text = text_mutate(self.r, text)
        self.run("config", ["train", "--config", "c.toml"], {"c.toml": text, "tokens.bin": self.seed("tokens.bin")})

    def t_tokens(self):
        data = bytes_mutate(self.r, self.seed("tokens.bin"), header=1024)
        if self.r.random() < 0.5:
            self.run("tokens", ["train", "--data.path=t.bin", "--training.steps=1"] + TINY, {"t.bin": data})
        else:
            self.run("tokens", ["train", "--data.path=tokens.bin", "--data.val_path=t.bin", "--training.steps=1",
                                "--training.val_batches=2"] + TINY, {"t.bin": data, "tokens.bin": self.seed("tokens.bin")})

    def checkpoint_files(self):
        """The seed checkpoint, unchanged, as ck/ (files for run)."""
        return {f"ck/step_00000002/{n}": self.seed(f"ckpt/step_00000002/{n}") for n in ("meta.json", "shard_00000.safetensors")}

    def checkpoint_commands(self, target, meta, shard):
        d = "ck/step_00000002/"
        files = {d + "meta.json": meta, d + "shard_00000.safetensors": shard, "tokens.bin": self.seed("tokens.bin")}
        cmd = self.r.choice([["checkpoint", "info", "ck", "--json"],
                             ["train", "--data.path=tokens.bin", "--checkpoint.dir=ck", "--checkpoint.resume=true",
                              "--training.steps=3"] + TINY,
                             ["export", "--checkpoint", "ck", "--out", "o.safetensors"],
                             ["sample", "--checkpoint", "ck", "--prompt", "ab", "--tokens", "3"]])
        self.run(f"{target}:{cmd[0]}", cmd, files)

    def t_meta(self):
        meta = json.loads(self.seed("ckpt/step_00000002/meta.json"))
        meta.pop("meta_crc32", None)  # read as an older checkpoint's (no CRC of its own): the fields themselves
        json_mutate(self.r, meta)
        self.checkpoint_commands("meta", json.dumps(meta, indent=1), self.seed("ckpt/step_00000002/shard_00000.safetensors"))

    def t_shard(self):
        shard = bytes_mutate(self.r, self.seed("ckpt/step_00000002/shard_00000.safetensors"), header=2048)
        meta = json.loads(self.seed("ckpt/step_00000002/meta.json"))
        meta.pop("meta_crc32", None)
        for s in meta["shards"]:  # recorded as written: the reader meets the damage itself
            s["crc32"], s["bytes"] = zlib.crc32(shard) & 0xFFFFFFFF, len(shard)
        self.checkpoint_commands("shard", json.dumps(meta, indent=1), shard)

    def t_safetensors(self):
        raw = self.seed("model.safetensors")
        if self.r.random() < 0.5:
            (n,) = struct.unpack("<Q", raw[:8])
            header = json.dumps(json_mutate(self.r, json.loads(raw[8:8 + n]))).encode()
            data = struct.pack("<Q", len(header)) + header + raw[8 + n:]
        else:
            data = bytes_mutate(self.r, raw, header=4096)
        self.run("safetensors", ["train", "--data.path=tokens.bin", "--model.init_from=m.safetensors",
                                 "--training.steps=1"] + TINY, {"m.safetensors": data, "tokens.bin": self.seed("tokens.bin")})

    def t_schedule(self):
        self.run("schedule", ["schedule", "--schedule", "file:s.txt", "--pp", "2", "--microbatches", "4", "--json"],
                 {"s.txt": text_mutate(self.r, self.seed("sched.txt").decode())})

    def t_hardware(self):
        self.run("hardware", ["plan", "--hardware", "h.toml", "--gpus", "8", "--top", "2"],
                 {"h.toml": text_mutate(self.r, self.seed("hw.toml").decode())})

    def t_plan(self):
        r = self.r
        # 100000, not a million: the pipeline simulator steps every micro-batch of each layout it weighs
        # (a million take 3 s, much longer under the sanitizers: slow, not wrong)
        size = lambda: r.choice(["0", "1", "2", "3", "4", "8", "-1", "2147483648", "100000", "x", ""])
        layout = ",".join(f"{k}={size()}" for k in r.sample(["dp", "tp", "pp", "cp", "v", "zero", "shard_group", "mb", "gb"],
                                                            r.randint(1, 4)))
        self.run("plan", ["plan", "--gpus", r.choice(["1", "2", "8", "64", "1000000", "2147483647"]), "--layout", layout,
                          "--top", "1"], {})

    def t_schedule_sizes(self):
        r = self.r
        n = lambda: r.choice(["0", "1", "2", "3", "4", "7", "16", "64", "1000", "100000", "2147483647", "-1"])
        self.run("schedule_sizes", ["schedule", "--schedule", r.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]),
                                    "--pp", n(), "--chunks", n(), "--microbatches", n(), "--json"], {})

    def t_prepare(self):
        r = self.r
        text = bytes_mutate(r, self.seed("text.txt"), header=256) if r.random() < 0.7 else r.choice(
            [b"", b"\n", b"\xff\xfe\x00", bytes(range(256)), "\u00e9\u4e2d\U0001f600\n".encode() * 50])
        args = ["prepare", "--input", "in.txt", "--out", "o.bin"]
        if r.random() < 0.4:
            args += ["--val-fraction", r.choice(["0", "0.05", "0.5", "0.999999", "1", "-0.1", "2", "nan", "inf", "1e-300"]),
                     "--val-out", "v.bin"]
        c = r.random()
        if c < 0.3:
            args += ["--tokenizer", "spm.model"]
        elif c < 0.55:
            args += ["--train-tokenizer", r.choice(["0", "1", "2", "3", "256", "300", "5000", "-1", "2147483647"]),
                     "--tokenizer-prefix", r.choice(["t", "sub/t", ""])]
        self.run("prepare", args, {"in.txt": text, "spm.model": self.seed("spm.model")})

    def t_spm_model(self):
        raw = self.seed("spm.model")
        model = pb_mutate(self.r, raw) if self.r.random() < 0.8 else bytes_mutate(self.r, raw)
        files = {"m.model": model, "text.txt": self.seed("text.txt"), "tokens.bin": self.seed("spm_tokens.bin"),
                 **self.checkpoint_files()}
        cmd = self.r.choice([["prepare", "--input", "text.txt", "--out", "o.bin", "--tokenizer", "m.model"],
                             ["train", "--data.path=tokens.bin", "--data.tokenizer=m.model", "--training.steps=1"] + TINY
                             + ["--model.vocab_size=512"],
                             ["sample", "--checkpoint", "ck", "--tokenizer", "m.model", "--prompt", "the", "--tokens", "3"]])
        self.run(f"spm_model:{cmd[0]}", cmd, files)

    def t_sample(self):
        r = self.r
        n = lambda: r.choice(["0", "1", "-1", "3", "2147483647", "2147483648", "-2147483648", "1e9", "x", ""])
        f = lambda: r.choice(["0", "-0", "-1", "1e-45", "1e-300", "1e300", "nan", "inf", "-inf", "0.8", ""])
        prompt = r.choice(["", "the", "\xff\xfe", "\u00e9\u4e2d", "a" * 5000, "\x00x"])
        args = ["sample", "--checkpoint", "ck", "--prompt", prompt.replace("\x00", ""), "--tokens",
                r.choice(["0", "1", "3", "20", "1000", "-1", "x"])]
        for flag, v in (("--temperature", f), ("--top-k", n), ("--top-p", f), ("--seed", n),
                        ("--samples", lambda: r.choice(["1", "2", "5", "0", "1025", "-1", "x"]))):
            if r.random() < 0.5:
                args += [flag, v()]
        if r.random() < 0.2:
            args += ["--tokenizer", r.choice(["byte", "spm.model", "missing.model", "", "ck"])]
        self.run("sample", args, {"spm.model": self.seed("spm.model"), **self.checkpoint_files()})

    def fuzz(self, cases, only):
        targets = sorted(t for t in dir(self) if t.startswith("t_") and (not only or t[2:] in only))
        for _ in range(cases):
            getattr(self, self.r.choice(targets))()


def signature(out):
    """The line that names a failure, with its numbers and addresses left out."""
    for pat in (r"ERROR: AddressSanitizer: [\w-]+", r"runtime error: [^\n]{0,80}", r"what\(\): [^\n]{0,100}",
                r"internal error: [^\n]{0,100}", r"error: [^\n]{0,100}"):
        m = re.search(pat, out)
        if m:
            return re.sub(r"0x[0-9a-f]+|\d+", "N", m.group(0))
    return out.strip().split("\n")[-1][:100] if out.strip() else "(no output)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("meshtrain")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", help="targets, comma-separated: config, tokens, meta, shard, safetensors, schedule, "
                                   "hardware, plan, schedule_sizes, prepare, spm_model, sample")
    ap.add_argument("--keep", help="a directory to keep each failing case in")
    a = ap.parse_args()
    f = Fuzzer(os.path.abspath(a.meshtrain), a.keep, a.seed, float(os.environ.get("FUZZ_TIMEOUT_S", 60)))
    t0 = time.time()
    try:
        f.make_seeds()
        f.fuzz(a.cases, a.only.split(",") if a.only else None)
    finally:
        shutil.rmtree(f.tmp, ignore_errors=True)
    print(f"fuzz_inputs: {f.runs} cases in {time.time() - t0:.0f} s, {len(f.failures)} distinct failures")
    for (target, kind, sig), n in sorted(f.failures.items()):
        print(f"  {n:4d} x {target}: {kind}: {sig}")
    sys.exit(1 if f.failures else 0)


if __name__ == "__main__":
    main()
