// One training step of the benchmark GPT-2 (forward, backward, clip, AdamW), timed.
// Prints one JSON line; bench/core.sh runs it beside PyTorch and reports the ratio.
//
//   bench_step [--family gpt2|llama] [--steps K] [--threads N] [--recompute] [--recompute-blocks N]
//              [--seq-len T] [--batch B] [--attention fused|materialized]
//   bench_step --coretype: the OpenBLAS kernel set meshtrain sets for this CPU (ops/gemm.h),
//              or nothing where it sets none (bench/same_kernels.sh)
// (defaults T = 256, B = 8: configs/gpt2_bench.toml's micro-batch; bench/attention.sh runs
// T = 1024 with B = 2, the same tokens per step)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cblas.h>

#include "core/rng.h"
#include "nn/model.h"
#include "ops/gemm.h"
#include "optim/optimizer.h"

using namespace mt;

// Measured rate of a product shaped like the benchmark's MLP matmul (N=2048, 1536 x 384):
// OpenBLAS alone with its own threads (the machine's sgemm ceiling for the kernels in
// use), or meshtrain's gemm (the same kernels in a fixed tile grid).
static double sgemm_gflops(bool meshtrain_grid) {
  const int M = 2048, N = 1536, K = 384;
  std::vector<float> a(M * K, 0.5f), b(N * K, 0.25f), c(M * N);
  double best = 1e30;
  for (int r = 0; r < 6; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    if (meshtrain_grid)
      gemm(false, true, M, N, K, a.data(), K, b.data(), K, 0.0f, c.data(), N);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a.data(), K, b.data(), K, 0.0f, c.data(), N);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * M * N * K / best / 1e9;
}

int main(int argc, char** argv) {
  blas_use_the_cpus_kernels(argv);  // before any thread starts
  std::string family = "gpt2";
  int steps = 5, threads = 0, seq_len = 256, B = 8;
  Recompute recompute;  // --recompute: every block; --recompute-blocks N: the first N
  std::string attention = "fused";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--coretype") {
      const char* set = std::getenv("MESHTRAIN_SET_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : nullptr;
      std::printf("%s\n", set ? set : "");
      return 0;
    }
    if (a == "--family" && i + 1 < argc) family = argv[++i];
    else if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--recompute") recompute = {Recompute::kAll};
    else if (a == "--recompute-blocks" && i + 1 < argc) recompute = {std::atoi(argv[++i])};
    else if (a == "--seq-len" && i + 1 < argc) seq_len = std::atoi(argv[++i]);
    else if (a == "--batch" && i + 1 < argc) B = std::atoi(argv[++i]);
    else if (a == "--attention" && i + 1 < argc) attention = argv[++i];
    else {
      std::fprintf(stderr, "bench_step: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (threads > 0) omp_set_num_threads(threads);

  ModelConfig cfg;
  cfg.family = family;
  cfg.n_layer = 6, cfg.d_model = 384, cfg.n_head = 6, cfg.seq_len = seq_len, cfg.vocab_size = 8192;
  cfg.attention = attention;
  const int T = cfg.seq_len;
  CpuAllocator alloc;
  Model model(cfg, alloc, B, recompute);
  model.init(1);
  std::vector<OptimSegment> segs;
  for (Unit& u : model.units()) {
    OptimSegment s{u.w, u.g, {}};
    for (const ParamSpec& p : u.params)
      if (p.decay) s.decay_ranges.emplace_back(p.offset, p.offset + p.numel());
    segs.push_back(s);
  }
  OptimConfig oc;
  oc.lr = 3e-4;
  Optimizer opt(oc, segs, alloc);
  Philox rng{2};
  std::vector<int32_t> tok(B * (T + 1));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>(rng.uniform(0, i) * cfg.vocab_size);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) in[b * T + t] = tok[b * (T + 1) + t], tg[b * T + t] = tok[b * (T + 1) + t + 1];

  std::vector<double> times;
  double loss = 0;
  for (int s = 0; s < steps + 2; ++s) {
    auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    loss = model.forward(in.data(), tg.data(), B, T) / (B * T);
    model.backward(1.0f / (B * T));
    double norm = std::sqrt(grad_sumsq(segs));
    grad_clip(segs, norm, 1.0);
    opt.step(oc.lr);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= 2) times.push_back(dt * 1000);  // two warm-up steps
  }
  std::string all;  // every timed step, in order
  for (double t : times) all += (all.empty() ? "" : ",") + std::to_string(t);
  std::sort(times.begin(), times.end());
  // Model FLOPs per step: 6 per parameter-token for every matmul weight (the tied head
  // included, wpe excluded) plus attention's QK^T and PV: 6 * 2 * L * T * C per token
  // counting the full T x T square (the causal half is skipped, so this is an upper count).
  const double tokens = double(B) * T;
  double matmul_params = double(model.num_params()) - (family == "gpt2" ? double(T) * cfg.d_model : 0.0);
  double flops = 6.0 * matmul_params * tokens + 12.0 * cfg.n_layer * T * cfg.d_model * tokens;
  double med = times[times.size() / 2];
  std::printf("{\"impl\":\"meshtrain\",\"family\":\"%s\",\"threads\":%d,\"step_ms_median\":%.2f,\"step_ms_min\":%.2f,"
              "\"params\":%lld,\"flops_per_step\":%.4g,\"gflops\":%.2f,\"sgemm_gflops\":%.2f,\"grid_gflops\":%.2f,"
              "\"loss\":%.4f,\"peak_bytes\":%zu,\"seq_len\":%d,\"batch\":%d,\"attention\":\"%s\",\"blas\":\"%s\","
              "\"blas_warning\":\"%s\",\"recompute_blocks\":%d,\"activation_bytes\":%zu,\"step_ms_all\":[%s]}\n",
              family.c_str(), omp_get_max_threads(), med, times.front(), static_cast<long long>(model.num_params()),
              flops, flops / (med / 1000) / 1e9, sgemm_gflops(false), sgemm_gflops(true), loss, alloc.stats().peak_total,
              T, B, attention.c_str(), blas_description().c_str(), blas_kernel_warning().c_str(),
              recompute.of(cfg.n_layer), alloc.stats().peak[int(MemTag::activations)], all.c_str());
  return 0;
}
