#!/usr/bin/python3
"""PyTorch side of meshtrain's DDP benchmark: one training step of the benchmark GPT-2 under
torch.nn.parallel.DistributedDataParallel (gloo backend, CPU), one thread per rank.

Same model and global batch as bench/torch_step.py (8 sequences of 256 tokens), split over
--ranks processes; forward, loss, backward (DDP's bucketed allreduce overlaps it), AdamW
step, zero_grad. Rank 0 prints one JSON line with the median step time.

    /usr/bin/python3 bench/torch_ddp_step.py [--ranks 2] [--steps 5]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import torch_model as tm  # noqa: E402

SIZES = dict(n_layer=6, d_model=384, n_head=6, seq_len=256, vocab_size=8192, family="gpt2")
GLOBAL_BATCH = 8


def blas_info():
    """The OpenBLAS this process loaded (through torch), as meshtrain's benchmark names it."""
    with open("/proc/self/maps") as maps:
        libs = sorted({l.split()[-1] for l in maps if "libopenblas" in l})
    if not libs:
        return "not OpenBLAS"
    blas = ctypes.CDLL(libs[0])
    blas.openblas_get_corename.restype = blas.openblas_get_config.restype = ctypes.c_char_p
    return (f"{blas.openblas_get_config().decode()}; kernels {blas.openblas_get_corename().decode()}, "
            f"{torch.get_num_threads()} thread(s) per rank")


def worker(rank, ranks, steps, store_path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank, world_size=ranks)
    model = tm.Model(dict(SIZES))
    model.load_numpy(tm.init_params(SIZES, seed=0))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = tm.make_optimizer(model, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    T, V = SIZES["seq_len"], SIZES["vocab_size"]
    g = torch.Generator().manual_seed(1 + rank)
    warmup, times = 2, []
    for i in range(warmup + steps):
        batch = torch.randint(0, V, (GLOBAL_BATCH // ranks, T + 1), generator=g)
        x, y = batch[:, :-1], batch[:, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x).view(-1, V), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        out.put({"impl": "pytorch-ddp-gloo", "ranks": ranks, "threads_per_rank": 1,
                 "step_ms_median": round(statistics.median(times), 2), "step_ms_min": round(min(times), 2),
                 "torch": torch.__version__, "blas": blas_info()})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(a.ranks, a.steps, os.path.join(d, "store"), out), nprocs=a.ranks, join=True)
    print(json.dumps(out.get()))


if __name__ == "__main__":
    main()
