// Per-op timings at the benchmark model's shapes, and the machine's sgemm rate.
//
//   bench_ops [--reps K]
//
// Shapes: GPT-2 / Llama with 6 layers, d_model C = 384, NH = 6 heads of D = 64, T = 256,
// vocab V = 8192, B = 8 sequences per step => N = B T = 2048 rows. Each op runs K times
// (after one warm-up call) and the fastest run is reported. At the end: the sum of the op times
// one GPT-2 training step would make (forward + backward, optimizer not included).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cblas.h>

#include "core/allocator.h"
#include "core/tensor.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

using namespace mt;

static int g_reps = 10;

// Wall time of fn in milliseconds: the minimum over the repetitions (the machine may be
// shared; the minimum is the least disturbed run).
static double time_ms(const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < g_reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[0];
}

static void report(const char* name, double ms, double count_per_step) {
  std::printf("  %-34s %8.3f ms   x%-3g per step\n", name, ms, count_per_step);
}

int main(int argc, char** argv) {
  blas_use_the_cpus_kernels(argv);  // before any thread starts
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::atoi(argv[++i]);
  const int L = 6, B = 8, T = 256, C = 384, NH = 6, D = 64, V = 8192, N = B * T, F4 = 4 * C;
  CpuAllocator alloc;
  std::mt19937 g(0);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto rnd = [&](const Shape& s, float a = 1.0f) {
    Tensor t = Tensor::empty(s, DType::f32, alloc, MemTag::other);
    float* p = t.f32();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = a * u(g);
    return t;
  };
  std::printf("bench_ops: %d OpenMP threads, B=%d T=%d C=%d NH=%d D=%d V=%d (N=%d rows)\n", omp_get_max_threads(), B,
              T, C, NH, D, V, N);
  std::printf("BLAS: %s\n", blas_description().c_str());
  if (const std::string w = blas_kernel_warning(); !w.empty()) std::printf("note: %s\n", w.c_str());

  // sgemm rate on the MLP matmul's shape: [2048, 384] x [384, 1536]^T.
  {
    Tensor a = rnd({N, C}), w = rnd({F4, C}), c = rnd({N, F4});
    const double ms = time_ms([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, F4, C, 1.0f, a.f32(), C, w.f32(), C, 0.0f, c.f32(), F4);
    });
    std::printf("sgemm %dx%dx%d (OpenBLAS threaded): %.3f ms = %.1f GFLOP/s\n", N, F4, C, ms,
                2.0 * N * F4 * C / ms * 1e-6);
  }

  double step = 0;  // estimated forward + backward time of one GPT-2 step
  auto add = [&](const char* name, double ms, double per_step) {
    report(name, ms, per_step);
    step += ms * per_step;
  };

  std::printf("GPT-2 ops:\n");
  std::vector<int32_t> tokv(N), tgv(N);
  for (int i = 0; i < N; ++i) tokv[i] = tgv[i] = (int32_t)(g() % V);
  Tensor tok = Tensor::wrap(tokv.data(), {B, T}, DType::i32), tg = Tensor::wrap(tgv.data(), {N}, DType::i32);
  Tensor wte = rnd({V, C}, 0.02f), wpe = rnd({T, C}, 0.02f), x = rnd({B, T, C}), dx = rnd({B, T, C});
  Tensor dwte = rnd({V, C}), dwpe = rnd({T, C});
  add("embedding_forward", time_ms([&] { embedding_forward(x, tok, wte, &wpe); }), 1);
  add("embedding_backward", time_ms([&] { embedding_backward(dwte, &dwpe, dx, tok); }), 1);

  Tensor lnw = rnd({C}), lnb = rnd({C}), y = rnd({N, C}), mean = rnd({N}), rstd = rnd({N}), dw = rnd({C}),
         db = rnd({C});
  add("layernorm_forward", time_ms([&] { layernorm_forward(y, mean, rstd, x, lnw, lnb, 1e-5f); }), 2 * L + 1);
  add("layernorm_backward", time_ms([&] { layernorm_backward(dx, dw, db, y, x, lnw, mean, rstd); }), 2 * L + 1);

  // The block's four linears.
  struct Lin { const char* name; int I, O; };
  for (Lin l : {Lin{"qkv", C, 3 * C}, Lin{"attn proj", C, C}, Lin{"fc", C, F4}, Lin{"fc proj", F4, C}}) {
    Tensor li = rnd({N, l.I}), lw = rnd({l.O, l.I}, 0.02f), lb = rnd({l.O}), lo = rnd({N, l.O}),
           ldw = rnd({l.O, l.I}), ldb = rnd({l.O}), ldx = rnd({N, l.I});
    const double flop = 2.0 * N * l.I * l.O;
    std::string n = std::string("linear ") + l.name;
    double ms = time_ms([&] { linear_forward(lo, li, lw, &lb); });
    add((n + " fwd").c_str(), ms, L);
    std::printf("      (%.1f GFLOP/s)\n", flop / ms * 1e-6);
    ms = time_ms([&] { linear_backward_input(ldx, lo, lw, false); });
    add((n + " bwd input").c_str(), ms, L);
    std::printf("      (%.1f GFLOP/s)\n", flop / ms * 1e-6);
    ms = time_ms([&] { linear_backward_weight(ldw, &ldb, lo, li); });
    add((n + " bwd weight").c_str(), ms, L);
    std::printf("      (%.1f GFLOP/s)\n", flop / ms * 1e-6);
  }

  Tensor qkv = rnd({B, T, 3 * C}), dqkv = rnd({B, T, 3 * C}), ao = rnd({B, T, C}), dao = rnd({B, T, C});
  Tensor att = rnd({B, NH, T, T}), scratch = rnd({B, NH, T, T});
  add("attention_forward", time_ms([&] { attention_forward(ao, att, qkv, NH, NH); }), L);
  add("attention_backward", time_ms([&] { attention_backward(dqkv, scratch, dao, qkv, att, NH, NH); }), L);

  Tensor h = rnd({N, F4}, 3.0f), gh = rnd({N, F4}), dh = rnd({N, F4});
  add("gelu_forward", time_ms([&] { gelu_forward(gh, h); }), L);
  add("gelu_backward", time_ms([&] { gelu_backward(dh, h, gh); }), L);
  add("add_inplace (residual)", time_ms([&] { add_inplace(y, x); }), 2 * L);

  Tensor logits = rnd({N, V}, 5.0f), losses = rnd({N}), lse = rnd({N}), dlog = rnd({N, V});
  {
    Tensor hw = rnd({V, C}, 0.02f), hdw = rnd({V, C});
    double ms = time_ms([&] { linear_forward(logits, x, hw, nullptr); });
    add("lm head fwd", ms, 1);
    std::printf("      (%.1f GFLOP/s)\n", 2.0 * N * C * V / ms * 1e-6);
    add("lm head bwd input", time_ms([&] { linear_backward_input(dx, dlog, hw, false); }), 1);
    add("lm head bwd weight", time_ms([&] { linear_backward_weight(hdw, nullptr, dlog, x); }), 1);
  }
  add("cross_entropy_forward", time_ms([&] { cross_entropy_forward(losses, lse, logits, tg); }), 1);
  add("cross_entropy_backward", time_ms([&] { cross_entropy_backward(dlog, logits, lse, tg, 1.0f / N); }), 1);
  std::printf("GPT-2 step, forward + backward ops (no optimizer): %.1f ms\n", step);

  std::printf("Llama ops:\n");
  const int FF = 1024;
  Tensor gu = rnd({N, 2 * FF}, 3.0f), sw = rnd({N, FF}), dgu = rnd({N, 2 * FF});
  report("rmsnorm_forward", time_ms([&] { rmsnorm_forward(y, rstd, x, lnw, 1e-5f); }), 2 * L + 1);
  report("rmsnorm_backward", time_ms([&] { rmsnorm_backward(dx, dw, y, x, lnw, rstd); }), 2 * L + 1);
  Tensor q4 = qkv.reshape({B, T, 3 * NH, D});
  report("rope_forward (q and k)", time_ms([&] { rope_forward(q4, 2 * NH, 10000.0f); }), L);
  report("rope_backward (q and k)", time_ms([&] { rope_backward(q4, 2 * NH, 10000.0f); }), L);
  report("swiglu_forward (F=1024)", time_ms([&] { swiglu_forward(sw, gu); }), L);
  report("swiglu_backward (F=1024)", time_ms([&] { swiglu_backward(dgu, gu, sw); }), L);
  return 0;
}
