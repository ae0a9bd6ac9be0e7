// The CUDA loss and optimizer kernels (ops/cuda/loss_optim.cu) against the CPU ops: fused
// cross-entropy forward and backward, the AdamW update against mt::Optimizer, sums of
// squares against a double host sum, in-place scaling; determinism (two runs, the same
// bits) and the errors on bad operands. Skips where there is no GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/cross_entropy.h"
#include "optim/optimizer.h"
#include "cuda_harness.h"
#include "op_harness.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {


// ---- cross entropy ----

struct CeCase {
  int N, V;
};

// Targets in [0, V) with every third row (from row 1) ignored when `ignore` is set.
std::vector<int32_t> make_targets(int N, int V, bool ignore, std::mt19937& g) {
  std::uniform_int_distribution<int32_t> u(0, V - 1);
  std::vector<int32_t> t(N);
  for (int n = 0; n < N; ++n) t[n] = (ignore && n % 3 == 1) ? -1 : u(g);
  if (N > 1) t[N - 1] = V - 1;  // the last column is a target somewhere
  return t;
}

}  // namespace

TEST(CudaLoss, CrossEntropyMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  std::mt19937 rng(11);
  // GPT-2's padded vocabulary with 8 rows, an odd small vocabulary, one row, sizes that are
  // not multiples of the block (256) with ignored rows, Llama's 32000.
  const CeCase cases[] = {{8, 50304}, {5, 37}, {1, 1000}, {33, 769}, {7, 257}, {4, 32000}};
  for (const CeCase c : cases) {
    SCOPED_TRACE(testing::Message() << "N=" << c.N << " V=" << c.V);
    const int N = c.N, V = c.V;
    VecF logits = randv((size_t)N * V, rng, -4.0f, 4.0f);
    std::vector<int32_t> tg = make_targets(N, V, N >= 5, rng);
    const float scale = 1.0f / 3.0f;

    // CPU
    VecF losses(N), lse(N), dl((size_t)N * V);
    const double total = cross_entropy_forward(tf(losses, {N}), tf(lse, {N}), tf(logits, {N, V}), ti(tg, {N}));
    cross_entropy_backward(tf(dl, {N, V}), tf(logits, {N, V}), tf(lse, {N}), ti(tg, {N}), scale);

    // GPU
    Tensor dlog = to_dev(logits, {N, V}), dtg = to_dev_i(tg, {N});
    Tensor dloss = poisoned({N}), dlse = poisoned({N}), ddl = poisoned({N, V});
    const double gtotal = cuda::cross_entropy_forward(dloss, dlse, dlog, dtg);
    cuda::cross_entropy_backward(ddl, dlog, dlse, dtg, scale);
    const VecF glosses = to_host(dloss), glse = to_host(dlse), gdl = to_host(ddl);

    // The loss sum: both add fp32 losses in double; the per-row losses differ by a few fp32
    // ulps (GPU expf/logf vs the CPU's polynomial exp, other summation order): 1e-6 relative.
    EXPECT_NEAR(gtotal, total, 1e-6 * std::fabs(total));
    // lse and losses: a few ulps of values around log(V), far inside 1e-5 relative (norm).
    EXPECT_LT(rel_err(glse, lse), 1e-5);
    if (total > 0) {
      EXPECT_LT(rel_err(glosses, losses), 1e-5);
    }
    expect_close(glosses, to_d(losses), "losses");
    // lse against a float64 reference: fp32 rounding of the exp sum, ~1e-6 relative.
    VecD lse_ref(N);
    for (int n = 0; n < N; ++n) {
      double m = -INFINITY, s = 0;
      for (int i = 0; i < V; ++i) m = std::max(m, (double)logits[(size_t)n * V + i]);
      for (int i = 0; i < V; ++i) s += std::exp((double)logits[(size_t)n * V + i] - m);
      lse_ref[n] = m + std::log(s);
      EXPECT_NEAR(glse[n], lse_ref[n], 1e-6 * std::fabs(lse_ref[n]) + 1e-6) << "row " << n;
    }
    // dlogits: exp(logit - lse) differs by a few ulps plus the lse's error times |logit|;
    // relative 1e-5 over the whole tensor, and elementwise with the harness's kRtol/kAtol.
    EXPECT_LT(rel_err(gdl, dl), 1e-5);
    expect_close(gdl, to_d(dl), "dlogits");
    // Ignored rows: loss exactly 0 and gradient exactly 0.
    for (int n = 0; n < N; ++n) {
      if (tg[n] >= 0) continue;
      EXPECT_EQ(glosses[n], 0.0f) << "row " << n;
      for (int i = 0; i < V; ++i) ASSERT_EQ(gdl[(size_t)n * V + i], 0.0f) << "row " << n << " col " << i;
    }

    // Determinism: the same inputs give the same bits.
    Tensor dloss2 = poisoned({N}), dlse2 = poisoned({N}), ddl2 = poisoned({N, V});
    const double gtotal2 = cuda::cross_entropy_forward(dloss2, dlse2, dlog, dtg);
    cuda::cross_entropy_backward(ddl2, dlog, dlse2, dtg, scale);
    EXPECT_EQ(0, std::memcmp(&gtotal, &gtotal2, sizeof(double)));
    EXPECT_TRUE(same_bits(to_host(dloss2), glosses));
    EXPECT_TRUE(same_bits(to_host(dlse2), glse));
    EXPECT_TRUE(same_bits(to_host(ddl2), gdl));

    // In place (dlogits aliases logits): the same bits as the separate output.
    cuda::cross_entropy_backward(dlog, dlog, dlse, dtg, scale);
    EXPECT_TRUE(same_bits(to_host(dlog), gdl)) << "in-place backward differs";
  }
}

TEST(CudaLoss, CrossEntropyRejectsBadOperands) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  std::mt19937 rng(12);
  const int N = 8, V = 8;
  VecF logits = randv(N * V, rng);
  Tensor dlog = to_dev(logits, {N, V});
  Tensor dloss = poisoned({N}), dlse = poisoned({N});
  std::vector<int32_t> good = {0, 1, 2, 3, 4, 5, 6, -1};
  Tensor dtg = to_dev_i(good, {N});
  EXPECT_NO_THROW(cuda::cross_entropy_forward(dloss, dlse, dlog, dtg));
  for (int32_t bad : {8, 99, -2}) {
    std::vector<int32_t> tg = good;
    tg[3] = bad;
    Tensor dbad = to_dev_i(tg, {N});
    EXPECT_THROW(cuda::cross_entropy_forward(dloss, dlse, dlog, dbad), Error) << "target " << bad;
    EXPECT_THROW(cuda::cross_entropy_backward(dlog, dlog, dlse, dbad, 1.0f), Error) << "target " << bad;
  }
  // targets: wrong count, f32 instead of i32, on the host
  Tensor short_tg = to_dev_i({0, 1, 2, 3, 4, 5, 6}, {7});
  EXPECT_THROW(cuda::cross_entropy_forward(dloss, dlse, dlog, short_tg), Error);
  Tensor f32_tg = to_dev(VecF(N, 1.0f), {N});
  EXPECT_THROW(cuda::cross_entropy_forward(dloss, dlse, dlog, f32_tg), Error);
  EXPECT_THROW(cuda::cross_entropy_forward(dloss, dlse, dlog, ti(good, {N})), Error);
  // losses / lse / dlogits of the wrong size, logits on the host
  Tensor small = poisoned({N - 1});
  EXPECT_THROW(cuda::cross_entropy_forward(small, dlse, dlog, dtg), Error);
  EXPECT_THROW(cuda::cross_entropy_forward(dloss, small, dlog, dtg), Error);
  Tensor small_dl = poisoned({N, V - 1});
  EXPECT_THROW(cuda::cross_entropy_backward(small_dl, dlog, dlse, dtg, 1.0f), Error);
  EXPECT_THROW(cuda::cross_entropy_forward(dloss, dlse, tf(logits, {N, V}), dtg), Error);
}

// ---- AdamW ----

namespace {

// Several AdamW steps of one segment on the CPU optimizer and on the GPU, with new
// gradients each step and a learning rate that changes; w, m and v compared after each.
void adamw_case(int n, const std::vector<std::pair<int64_t, int64_t>>& decay, uint32_t seed) {
  CudaAllocator& gpu = test::gpu();
  CpuAllocator cpu;
  std::mt19937 rng(seed);
  OptimConfig cfg;
  cfg.name = "adamw";
  cfg.lr = 1e-2;
  cfg.weight_decay = 0.1;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  VecF w0 = randv(n, rng);
  OptimSegment seg;
  seg.w = Tensor::empty({n}, DType::f32, cpu, MemTag::params);
  seg.g = Tensor::empty({n}, DType::f32, cpu, MemTag::grads);
  seg.w.copy_from(tf(w0, {n}));
  seg.decay_ranges = decay;
  Optimizer opt(cfg, {seg}, cpu);
  Tensor dw = to_dev(w0, {n}), dg = poisoned({n});
  Tensor dm = Tensor::empty({n}, DType::f32, gpu, MemTag::optim);
  Tensor dv = Tensor::empty({n}, DType::f32, gpu, MemTag::optim);
  dm.zero_();
  dv.zero_();
  VecF last_w;
  for (int t = 1; t <= 5; ++t) {
    SCOPED_TRACE(testing::Message() << "n=" << n << " step " << t);
    VecF g = randv(n, rng, -0.5f, 0.5f);
    seg.g.copy_from(tf(g, {n}));
    dg.copy_from(tf(g, {n}));
    const double lr = cfg.lr * (1.0 - 0.1 * t);
    opt.step(lr);
    cuda::adamw_step(dw, dg, dm, dv, decay, lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, t);
    const auto state = opt.state(0);
    const VecF cw = to_host(seg.w), cm = to_host(state[0].second), cv = to_host(state[1].second);
    const VecF gw = to_host(dw), gm = to_host(dm), gv = to_host(dv);
    // Same float constants and operation order as the CPU (no fused multiply-add on the
    // GPU; the CPU compiler contracts under -march=native): an ulp or so apart per step,
    // which the moments' sums over 5 steps carry (measured on an H100: 3.1e-6 relative on m),
    // so 1e-5; a wrong formula or constant is off by far more.
    EXPECT_LT(rel_err(gw, cw), 1e-5);
    EXPECT_LT(rel_err(gm, cm), 1e-5);
    EXPECT_LT(rel_err(gv, cv), 1e-5);
    expect_close(gw, to_d(cw), "w");
    expect_close(gm, to_d(cm), "m");
    expect_close(gv, to_d(cv), "v");
    last_w = gw;
  }
  // Determinism: a second run from the same start gives the same bits.
  Tensor dw2 = to_dev(w0, {n});
  Tensor dm2 = Tensor::empty({n}, DType::f32, gpu, MemTag::optim);
  Tensor dv2 = Tensor::empty({n}, DType::f32, gpu, MemTag::optim);
  dm2.zero_();
  dv2.zero_();
  std::mt19937 rng2(seed);
  randv(n, rng2);  // w0
  for (int t = 1; t <= 5; ++t) {
    VecF g = randv(n, rng2, -0.5f, 0.5f);
    dg.copy_from(tf(g, {n}));
    cuda::adamw_step(dw2, dg, dm2, dv2, decay, cfg.lr * (1.0 - 0.1 * t), cfg.beta1, cfg.beta2, cfg.eps,
                     cfg.weight_decay, t);
  }
  EXPECT_TRUE(same_bits(to_host(dw2), last_w)) << "AdamW is not deterministic";
}

}  // namespace

TEST(CudaOptim, AdamWMatchesCpuOptimizer) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  adamw_case(1, {}, 1);                             // one element, no decay
  adamw_case(1, {{0, 1}}, 2);                       // one element, decayed
  adamw_case(4099, {{100, 1100}, {2000, 3500}}, 3);  // a few ranges, n not a multiple of 256
  adamw_case(4099, {{0, 4099}}, 4);                 // all decayed
  // more ranges than pass by value (16): the device list and its binary search; empty ones too
  std::vector<std::pair<int64_t, int64_t>> many;
  for (int64_t k = 0; k < 40; ++k) many.push_back({k * 250 + 3, k * 250 + (k % 5 == 0 ? 3 : 130)});
  adamw_case(10007, many, 5);
  // a GPT-2 block's worth of elements (several 2-D ranges between 1-D ones)
  adamw_case(300001, {{512, 50000}, {50100, 150000}, {150300, 290000}}, 6);
}

TEST(CudaOptim, AdamWRejectsBadOperands) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  const int n = 100;
  Tensor w = poisoned({n}), g = poisoned({n}), m = poisoned({n}), v = poisoned({n});
  Tensor short_v = poisoned({n - 1});
  EXPECT_THROW(cuda::adamw_step(w, g, m, short_v, {}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1), Error);
  EXPECT_THROW(cuda::adamw_step(w, g, m, v, {{50, 40}}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1), Error);   // reversed
  EXPECT_THROW(cuda::adamw_step(w, g, m, v, {{50, 101}}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1), Error);  // past the end
  EXPECT_THROW(cuda::adamw_step(w, g, m, v, {{10, 30}, {20, 40}}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1), Error);  // overlap
  EXPECT_THROW(cuda::adamw_step(w, g, m, v, {}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0), Error);  // t starts at 1
  VecF host(n, 1.0f);
  EXPECT_THROW(cuda::adamw_step(tf(host, {n}), g, m, v, {}, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1), Error);
}

// ---- sums of squares, scaling ----

TEST(CudaOptim, SumsqMatchesDoubleSum) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  std::mt19937 rng(21);
  for (int n : {1, 255, 257, 100003, (1 << 20) + 7, 300 * 1024 * 1024 / 256 + 5}) {
    SCOPED_TRACE(testing::Message() << "n=" << n);
    VecF x = randv(n, rng, -2.0f, 2.0f);
    long double acc = 0;  // 64-bit mantissa: the reference's own rounding is negligible
    for (float v : x) acc += (long double)v * v;
    const double ref = (double)acc;
    Tensor dx = to_dev(x, {n});
    const double got = cuda::sumsq(dx);
    // Squares of fp32 values are exact in double; only the summation (order, rounding at
    // 2^-53 per add, a few adds per thread then trees) errs: ~1e-12 relative is far above it.
    EXPECT_NEAR(got, ref, 1e-12 * ref);
    const double again = cuda::sumsq(dx);
    EXPECT_EQ(0, std::memcmp(&got, &again, sizeof(double))) << "sumsq is not deterministic";
  }
  EXPECT_THROW(cuda::sumsq(to_dev_i({1, 2}, {2})), Error);  // not f32
}

TEST(CudaOptim, ScaleInplace) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  std::mt19937 rng(22);
  for (int n : {1, 257, 100003}) {
    VecF x = randv(n, rng);
    Tensor dx = to_dev(x, {n});
    const float s = 0.37f;
    cuda::scale_inplace(dx, s);
    VecF ref(n);
    for (int i = 0; i < n; ++i) ref[i] = x[i] * s;
    EXPECT_TRUE(same_bits(to_host(dx), ref)) << "n=" << n << ": one fp32 multiply must match exactly";
  }
  VecF host(4, 1.0f);
  EXPECT_THROW(cuda::scale_inplace(tf(host, {4}), 2.0f), Error);
}

#else
TEST(CudaLoss, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif
