// The CUDA loss and optimizer kernels (ops/cuda/loss_optim.cu) against the CPU ops: fused
// cross-entropy forward and backward, the AdamW, SGD, LARS and LAMB updates against
// mt::Optimizer, sums of squares against a double host sum, in-place scaling; determinism (two runs, the same
// bits) and the errors on bad operands. Skips where there is no GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/autocast.h"
#include "ops/cross_entropy.h"
#include "ops/linear.h"
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
  // not multiples of the block (256) with ignored rows, Llama's 32000, and GPT-2's own odd
  // vocabulary over many rows (a training step's thousands).
  const CeCase cases[] = {{8, 50304}, {5, 37}, {1, 1000}, {33, 769}, {7, 257}, {4, 32000}, {2049, 50257}};
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

// The forward's one pass (a running max per thread, its sum rescaled as the max rises)
// against float64, on rows that rescale at every step (ascending logits up to 80, where
// exp(logit) alone would overflow fp32's sums of a few hundred), descending rows, a row where
// one thread's columns are all -inf (they add nothing, as exp(-inf) = 0) and a row with a
// NaN logit (its loss is NaN, so a NaN step is seen).
TEST(CudaLoss, CrossEntropyOnePassRescalesAndKeepsInfAndNaN) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const int N = 5, V = 700;
  VecF logits((size_t)N * V);
  for (int i = 0; i < V; ++i) {
    logits[i] = 80.0f * i / V;                   // row 0: ascending
    logits[V + i] = 80.0f * (V - i) / V;         // row 1: descending
    logits[2 * V + i] = std::sin(0.37f * i) * 5;  // row 2: thread 5's columns (5, 261, 517) -inf
    logits[3 * V + i] = std::cos(0.11f * i) * 3;  // row 3: one NaN
    logits[4 * V + i] = -1e4f + i;                // row 4: large negative logits
  }
  for (int i = 5; i < V; i += 256) logits[2 * V + i] = -INFINITY;
  logits[3 * V + 400] = std::nanf("");
  const std::vector<int32_t> tg = {3, 699, 17, 0, 600};
  Tensor dloss = poisoned({N}), dlse = poisoned({N});
  cuda::cross_entropy_forward(dloss, dlse, to_dev(logits, {N, V}), to_dev_i(tg, {N}));
  const VecF glosses = to_host(dloss), glse = to_host(dlse);
  for (int n : {0, 1, 2, 4}) {
    double m = -INFINITY, s = 0;
    for (int i = 0; i < V; ++i) m = std::max(m, (double)logits[(size_t)n * V + i]);
    for (int i = 0; i < V; ++i) s += std::exp((double)logits[(size_t)n * V + i] - m);
    const double lse = m + std::log(s);
    EXPECT_NEAR(glse[n], lse, 2e-6 * std::fabs(lse) + 1e-6) << "row " << n;
    EXPECT_NEAR(glosses[n], lse - logits[(size_t)n * V + tg[n]], 2e-6 * std::fabs(lse) + 1e-5) << "row " << n;
  }
  EXPECT_TRUE(std::isnan(glosses[3])) << "a NaN logit gives a NaN loss";
  // GPT-2's padded vocabulary ascending: about 196 rescales per thread
  const int V2 = 50304;
  VecF up(V2);
  for (int i = 0; i < V2; ++i) up[i] = 30.0f * i / V2;
  Tensor l1 = poisoned({1}), s1 = poisoned({1});
  cuda::cross_entropy_forward(l1, s1, to_dev(up, {1, V2}), to_dev_i({7}, {1}));
  double m = up[V2 - 1], s = 0;
  for (int i = 0; i < V2; ++i) s += std::exp((double)up[i] - m);
  EXPECT_NEAR(to_host(s1)[0], m + std::log(s), 2e-6 * (m + std::log(s)));
  EXPECT_NEAR(to_host(l1)[0], m + std::log(s) - up[7], 2e-6 * (m + std::log(s)));
}

// The loss's gradient fed straight to the head's products in 16 bits
// (cross_entropy_head_backward) gives the bits of the loss's backward in place then
// linear_backward: a shard with padding columns (valid < V) and an offset (begin), ignored
// rows, bf16 and f16; the logits are left as they are; false (nothing written) in fp32.
TEST(CudaLoss, HeadBackwardFromTheLossMatchesTheTwoStepsBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(21);
  // (N, V, C, w16): w16 > 0 passes the weight as the model does, a 16-bit view that many
  // elements into its unit's buffer (w16 x 2 bytes past 256-byte alignment); V = 50304 is
  // GPT-2's padded vocabulary (the kernels' many column blocks); 50257, GPT-2's own, is odd:
  // its 16-bit rows are only 2-byte aligned, where cuBLASLt may have no 16-bit algorithm
  // (then the products run in fp32, said once), over a thousand rows.
  for (auto [N, V, C, w16] :
       {std::array<int, 4>{37, 104, 48, 0}, {37, 104, 48, 8}, {5, 50304, 64, 1}, {1025, 50257, 64, 0}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " V " + std::to_string(V) + " w16 offset " + std::to_string(w16));
    const int valid = V - 4, begin = 200;
    VecF logits = randv(N * V, g, -4.0f, 4.0f), x = randv(N * C, g), w = randv(V * C, g), dw0 = randv(V * C, g);
    std::vector<int32_t> tg = make_targets(N, 2 * valid + begin, true, g);  // some in this shard, most not
    for (int n = 0; n < N; n += 4) tg[n] = begin + n % valid;
    VecF lse(N);
    for (int n = 0; n < N; ++n) {
      double m = -1e30, s = 0;
      for (int i = 0; i < valid; ++i) m = std::max<double>(m, logits[n * V + i]);
      for (int i = 0; i < valid; ++i) s += std::exp(logits[n * V + i] - m);
      lse[n] = static_cast<float>(m + std::log(s));
    }
    const float scale = 1.0f / N;
    for (DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(dtype_name(dt));
      VecF wr = w, xr = x;
      round_to(dt, wr.data(), wr.data(), V * C);  // a working copy's values
      round_to(dt, xr.data(), xr.data(), N * C);  // the kept norm output's
      const Tensor dlse = to_dev(lse, {N}), dtg = to_dev_i(tg, {N}), dx_in = to_dev(xr, {N, C});
      Tensor dw_in = to_dev(wr, {V, C});
      if (w16 > 0) {
        const Tensor buf = Tensor::empty({int64_t{V} * C + w16}, dt, test::gpu(), MemTag::params);
        const Tensor view = buf.view(w16, {V, C});
        view.convert_from(dw_in);
        dw_in = view;
      }
      Autocast scope(dt);
      const Tensor lg1 = to_dev(logits, {N, V}), dx1 = poisoned({N, C}), dw1 = to_dev(dw0, {V, C});
      ASSERT_TRUE(cross_entropy_head_backward(dx1, dw1, lg1, dlse, dtg, scale, begin, valid, dx_in, dw_in));
      EXPECT_TRUE(same_bits(to_host(lg1), logits)) << "the logits changed";
      const Tensor lg2 = to_dev(logits, {N, V}), dx2 = poisoned({N, C}), dw2 = to_dev(dw0, {V, C});
      cross_entropy_backward_shard(lg2, lg2, dlse, dtg, scale, begin, valid);
      linear_backward(dx2, dw2, nullptr, lg2, dx_in, dw_in);
      EXPECT_TRUE(same_bits(to_host(dx1), to_host(dx2))) << "dx";
      EXPECT_TRUE(same_bits(to_host(dw1), to_host(dw2))) << "dw";
    }
  }
  const int N = 37, V = 104, C = 48;
  const VecF logits = randv(N * V, g), lse = randv(N, g), x = randv(N * C, g), w = randv(V * C, g), dw0 = randv(V * C, g);
  const std::vector<int32_t> tg = make_targets(N, V, true, g);
  const Tensor dx = poisoned({N, C});
  EXPECT_FALSE(cross_entropy_head_backward(dx, to_dev(dw0, {V, C}), to_dev(logits, {N, V}), to_dev(lse, {N}),
                                           to_dev_i(tg, {N}), 1.0f / N, 0, V, to_dev(x, {N, C}),
                                           to_dev(w, {V, C})))
      << "fp32";
  for (float v : to_host(dx)) ASSERT_TRUE(std::isnan(v)) << "written in fp32";
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

// ---- SGD, LARS, LAMB ----

namespace {

// One segment of several tensors, updated by the CPU optimizer and by one whose buffers live
// on the GPU, for 5 steps with new gradients each step: a matrix (decays), a bias, a matrix
// that a tp replica holds too (not counted in its norms), an empty tensor, a matrix with
// zero gradients and a large matrix (more than one sumsq block per thread). The per-tensor
// sums pass through a hook that adds what "other holders" would (the same on both), so the
// GPU must hand the sums over in the CPU's order. w and the state compared after each step.
void layerwise_case(const std::string& name, bool nesterov, uint32_t seed) {
  CudaAllocator& gpu = test::gpu();
  CpuAllocator cpu;
  std::mt19937 rng(seed);
  OptimConfig cfg;
  cfg.name = name;
  cfg.lr = name == "lars" ? 0.5 : 1e-2;
  cfg.weight_decay = 0.1;
  cfg.eps = 1e-8;
  cfg.nesterov = nesterov;
  cfg.trust_coef = 0.01;
  struct Piece {
    int64_t n;
    bool decay, counted, zero_g;
  };
  const std::vector<Piece> pieces = {{300, true, true, false},  {17, false, true, false}, {260, true, false, false},
                                     {0, true, true, false},    {64, true, true, true},   {600001, true, true, false}};
  std::vector<OptimTensor> tensors;
  std::vector<std::pair<int64_t, int64_t>> decay, replicas;
  int64_t n = 0;
  for (const Piece& p : pieces) {
    tensors.push_back({n, n + p.n, p.decay, p.counted});
    if (p.decay && p.n) decay.push_back({n, n + p.n});
    if (!p.counted) replicas.push_back({n, n + p.n});
    n += p.n;
  }
  VecF w0 = randv(n, rng);
  auto segment = [&](Allocator& a) {
    OptimSegment s;
    s.w = Tensor::empty({n}, DType::f32, a, MemTag::params);
    s.g = Tensor::empty({n}, DType::f32, a, MemTag::grads);
    s.w.copy_from(tf(w0, {n}));
    s.decay_ranges = decay;
    s.replica_ranges = replicas;
    s.tensors = tensors;
    return s;
  };
  OptimSegment cs = segment(cpu), gs = segment(gpu);
  Optimizer copt(cfg, {cs}, cpu), gopt(cfg, {gs}, gpu);
  ASSERT_EQ(copt.norm_sums(), gopt.norm_sums());
  std::vector<std::vector<double>> seen_cpu, seen_gpu;  // the sums each hook was handed
  auto hook = [](std::vector<std::vector<double>>& seen) {
    return [&seen](std::vector<double>& sums) {
      seen.push_back(sums);
      for (size_t k = 0; k < sums.size(); ++k) sums[k] += 0.25 * static_cast<double>(k % 3);
    };
  };
  for (int t = 1; t <= 5; ++t) {
    SCOPED_TRACE(testing::Message() << name << (nesterov ? " nesterov" : "") << " step " << t);
    VecF g = randv(n, rng, -0.5f, 0.5f);
    int64_t at = 0;
    for (const Piece& p : pieces) {
      if (p.zero_g) std::fill(g.begin() + at, g.begin() + at + p.n, 0.0f);
      at += p.n;
    }
    cs.g.copy_from(tf(g, {n}));
    gs.g.copy_from(tf(g, {n}));
    const double lr = cfg.lr * (1.0 - 0.1 * t);
    copt.step(lr, hook(seen_cpu));
    gopt.step(lr, hook(seen_gpu));
    if (name == "lamb" || name == "lars") {
      ASSERT_EQ(seen_gpu.size(), seen_cpu.size());
      const std::vector<double>&a = seen_cpu.back(), &b = seen_gpu.back();
      ASSERT_EQ(a.size(), b.size());
      // doubles summed in other orders (and u from fp32 operations the CPU may contract)
      for (size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(b[k], a[k], 1e-6 * std::abs(a[k])) << "sum " << k;
    }
    // As for AdamW: the same float operations, but the CPU compiler contracts under
    // -march=native; an ulp or so per step, carried by the moments over 5 steps.
    EXPECT_LT(rel_err(to_host(gs.w), to_host(cs.w)), 1e-5);
    const auto cst = copt.state(0), gst = gopt.state(0);
    ASSERT_EQ(cst.size(), gst.size());
    for (size_t k = 0; k < cst.size(); ++k)
      EXPECT_LT(rel_err(to_host(gst[k].second), to_host(cst[k].second)), 1e-5) << cst[k].first;
  }
}

}  // namespace

TEST(CudaOptim, SgdLarsLambMatchCpuOptimizer) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  layerwise_case("sgd", false, 31);
  layerwise_case("sgd", true, 32);
  layerwise_case("lars", false, 33);
  layerwise_case("lars", true, 34);
  layerwise_case("lamb", false, 35);
}

TEST(CudaOptim, SumsqEachMatchesSumsqAndLambsDirection) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  std::mt19937 rng(23);
  const int n = 70001;
  VecF x = randv(n, rng), m = randv(n, rng, -0.01f, 0.01f), v = randv(n, rng, 1e-6f, 1e-4f);
  const Tensor dx = to_dev(x, {n}), dm = to_dev(m, {n}), dv = to_dev(v, {n});
  const cuda::LambConsts c = {0.9f, 0.95f, 0.1f, 0.05f, 1.5f, 0.4f, 1e-8f};
  const float wd = 0.1f;
  const std::vector<double> sums = cuda::sumsq_each({{dx, {}, {}, 0.0f},
                                                     {},
                                                     {dx.view(0, {0}), {}, {}, 0.0f},
                                                     {dx, dm, dv, wd},
                                                     {dx.view(5, {100}), {}, {}, 0.0f}},
                                                    c);
  ASSERT_EQ(sums.size(), 5u);
  const double one = cuda::sumsq(dx), part = cuda::sumsq(dx.view(5, {100}));
  EXPECT_EQ(0, std::memcmp(&sums[0], &one, sizeof(double))) << "not sumsq's order";
  EXPECT_EQ(sums[1], 0.0);  // undefined
  EXPECT_EQ(sums[2], 0.0);  // empty
  EXPECT_EQ(0, std::memcmp(&sums[4], &part, sizeof(double))) << "a view: not sumsq's order";
  long double ref = 0;  // u in float with the kernel's rounding of each operation, summed exactly
  for (int i = 0; i < n; ++i) {
    volatile float a = m[i] * c.inv_bc1, r = std::sqrt(v[i]), q = r / c.bc2_sqrt, den = q + c.eps, dq = a / den,
                   wdw = wd * x[i], u = dq + wdw;
    ref += (long double)u * u;
  }
  EXPECT_NEAR(sums[3], (double)ref, 1e-12 * (double)ref);
  EXPECT_THROW(cuda::sumsq_each({{dx, dm, dv.view(0, {n - 1}), wd}}, c), Error);  // v shorter than w
}

// 16-bit gradients (training.grad_dtype) on the GPU: the optimizer widens them into its GPU
// scratch and applies the clip / unscale factor there, so every optimizer updates exactly as
// over fp32 gradients holding the widened values times the factor; the gradient norm of
// 16-bit gradients is that of their widened values. Both bit for bit (the same kernels over
// the same floats), as on the CPU (tests/test_precision.cpp).
TEST(CudaOptim, Reads16BitGradientsAsWidenedAndScaled) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator& gpu = test::gpu();
  CpuAllocator cpu;
  const int64_t n = 40000;
  std::mt19937 rng(8);
  VecF w0 = randv(n, rng);
  for (DType dt : {DType::bf16, DType::f16}) {
    const Tensor h16 = Tensor::empty({n}, dt, cpu, MemTag::grads);
    VecF values = randv(n, rng, -0.02f, 0.02f);
    h16.convert_from(tf(values, {n}));
    const Tensor g16 = Tensor::empty({n}, dt, gpu, MemTag::grads);
    g16.copy_from(h16);
    const float c = 0.37f;  // a clip coefficient times 1 / loss scale
    VecF widened(n), scaled(n);
    tf(widened, {n}).convert_from(h16);
    for (int64_t i = 0; i < n; ++i) scaled[i] = widened[i] * c;
    for (const char* name : {"adamw", "sgd", "lamb", "lars"}) {
      OptimConfig cfg;
      cfg.name = name;
      auto segment = [&](const Tensor& g) {
        OptimSegment s{to_dev(w0, {n}), g, {{1000, 30000}}, {}};
        s.tensors = {{0, 1000, false, true}, {1000, 30000, true, true}, {30000, n, false, true}};
        return std::vector<OptimSegment>{s};
      };
      const auto wide_segs = segment(to_dev(scaled, {n})), half_segs = segment(g16);
      Optimizer wide(cfg, wide_segs, gpu), half(cfg, half_segs, gpu);
      for (int step = 0; step < 3; ++step) {
        wide.step(1e-2);
        half.step(1e-2, {}, c);
      }
      EXPECT_TRUE(same_bits(to_host(wide_segs[0].w), to_host(half_segs[0].w))) << name << " " << dtype_name(dt);
    }
    const OptimSegment a{to_dev(w0, {n}), to_dev(widened, {n}), {}, {{5, 17}}};
    const OptimSegment b{to_dev(w0, {n}), g16, {}, {{5, 17}}};
    EXPECT_EQ(grad_sumsq({a}), grad_sumsq({b})) << dtype_name(dt);
    long double ref = 0;
    for (int64_t i = 0; i < n; ++i)
      if (i < 5 || i >= 17) ref += (long double)widened[i] * widened[i];
    EXPECT_NEAR(grad_sumsq({b}), (double)ref, 1e-12 * (double)ref) << dtype_name(dt);
  }
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
