// Attention forward + backward, materialized against fused, at one head shape.
//
//   bench_attention [--batch B] [--seq T] [--heads NH] [--head-dim D] [--reps K]
//
// Prints one JSON line: the fastest of K runs (after a warm-up) of forward, backward and
// their sum for each variant, the BLAS kernel set and the thread count.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cblas.h>

#include "core/allocator.h"
#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/gemm.h"  // blas_use_the_cpus_kernels

using namespace mt;

// Wall time of fn in milliseconds: the minimum over the repetitions (the least disturbed).
static double time_ms(const std::function<void()>& fn, int reps) {
  fn();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  blas_use_the_cpus_kernels(argv);  // before any thread starts
  int B = 8, T = 256, NH = 6, D = 64, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (a == "--batch") B = v;
    else if (a == "--seq") T = v;
    else if (a == "--heads") NH = v;
    else if (a == "--head-dim") D = v;
    else if (a == "--reps") reps = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  const int W = 3 * NH * D;
  CpuAllocator alloc;
  std::mt19937 g(0);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto rnd = [&](const Shape& s) {
    Tensor t = Tensor::empty(s, DType::f32, alloc, MemTag::other);
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = u(g);
    return t;
  };
  Tensor qkv = rnd({B, T, W}), dqkv = rnd({B, T, W}), out = rnd({B, T, NH * D}), dout = rnd({B, T, NH * D});
  double mf, mb, ff, fb;
  {
    Tensor att = rnd({B, NH, T, T}), scratch = rnd({B, NH, T, T});
    mf = time_ms([&] { attention_forward(out, att, qkv, NH, NH); }, reps);
    mb = time_ms([&] { attention_backward(dqkv, scratch, dout, qkv, att, NH, NH); }, reps);
  }
  Tensor lse = rnd({B, NH, T});
  ff = time_ms([&] { attention_fused_forward(out, lse, qkv, NH, NH); }, reps);
  fb = time_ms([&] { attention_fused_backward(dqkv, dout, qkv, out, lse, NH, NH); }, reps);
  std::printf("{\"B\":%d,\"T\":%d,\"NH\":%d,\"D\":%d,\"blas\":\"%s\",\"blas_threads\":%d,\"omp_threads\":%d,"
              "\"materialized_fwd_ms\":%.3f,\"materialized_bwd_ms\":%.3f,\"fused_fwd_ms\":%.3f,\"fused_bwd_ms\":%.3f}\n",
              B, T, NH, D, openblas_get_corename(), openblas_get_num_threads(), omp_get_max_threads(), mf, mb, ff, fb);
  return 0;
}
