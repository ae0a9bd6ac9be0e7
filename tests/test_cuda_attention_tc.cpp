// The tensor-core attention path (src/ops/cuda/attention_tc.cu), taken by
// cuda::attention_fused_forward / attention_fused_backward under a bf16 or f16 Autocast
// scope: out, lse and dqkv against a float64 reference computed from the 16-bit-ROUNDED q,
// k, v and dout, and against the fp32 GPU kernels (outside the scope) on the same rounded
// inputs; shapes that cross the 64-row tiles or stop short of them, grouped-query heads,
// every templated D = 16, 32, ..., 128 and GPT-2's shape; the forward's rescale path (a row
// max that jumps between key tiles); bit-identical reruns; D = 40 falling back to the fp32
// kernels bit for bit; the shape errors. Skips without a GPU (the host-side checks of
// attention_tc_supported and the tensor-core entry points' argument checks run anyway).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/attention_tc.h"
#include "ops/cuda/ops.h"
#endif

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {

// Float64 causal GQA attention over qkv [B, T, W]: out [B, T, NH D], lse [B, NH, T], and,
// given dout [B, T, NH D], the gradient dqkv [B, T, W] of sum(out * dout).
struct Ref {
  VecD out, lse, dqkv;
};
Ref attention_ref(const VecD& qkv, const VecD& dout, int B, int T, int NH, int NKV, int D) {
  const int W = (NH + 2 * NKV) * D, OW = NH * D, G = NH / NKV;
  const double scale = 1.0 / std::sqrt((double)D);
  Ref r{VecD((size_t)B * T * OW, 0.0), VecD((size_t)B * NH * T, 0.0), VecD((size_t)B * T * W, 0.0)};
  VecD p(T), dp(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const int kc = (NH + h / G) * D, vc = kc + NKV * D;
      for (int t = 0; t < T; ++t) {
        const double* q = &qkv[((size_t)b * T + t) * W + h * D];
        const double* dO = &dout[((size_t)b * T + t) * OW + h * D];
        double* o = &r.out[((size_t)b * T + t) * OW + h * D];
        double m = -INFINITY, z = 0, delta = 0;
        for (int s = 0; s <= t; ++s) {
          const double* k = &qkv[((size_t)b * T + s) * W + kc];
          double d = 0;
          for (int i = 0; i < D; ++i) d += q[i] * k[i];
          p[s] = d * scale;
          m = std::max(m, p[s]);
        }
        for (int s = 0; s <= t; ++s) z += (p[s] = std::exp(p[s] - m));
        r.lse[((size_t)b * NH + h) * T + t] = m + std::log(z);
        for (int s = 0; s <= t; ++s) {
          const double* v = &qkv[((size_t)b * T + s) * W + vc];
          p[s] /= z;
          for (int i = 0; i < D; ++i) o[i] += p[s] * v[i];
        }
        for (int s = 0; s <= t; ++s) {
          const double* v = &qkv[((size_t)b * T + s) * W + vc];
          dp[s] = 0;
          for (int i = 0; i < D; ++i) dp[s] += dO[i] * v[i];
          delta += p[s] * dp[s];
        }
        for (int s = 0; s <= t; ++s) {
          const double ds = p[s] * (dp[s] - delta) * scale;
          const size_t ks = ((size_t)b * T + s) * W;
          for (int i = 0; i < D; ++i) {
            r.dqkv[((size_t)b * T + t) * W + h * D + i] += ds * qkv[ks + kc + i];
            r.dqkv[ks + kc + i] += ds * q[i];
            r.dqkv[ks + vc + i] += p[s] * dO[i];
          }
        }
      }
    }
  return r;
}


// The GPU's out, lse (forward) and dqkv (backward from the GPU's own out and lse), under an
// Autocast scope of dtype dt (f32: no scope, the fp32 kernels).
struct GpuResult {
  VecF out, lse, dqkv;
};
GpuResult run_gpu(DType dt, VecF& qkv, VecF& dout, int B, int T, int NH, int NKV, int D) {
  const int W = (NH + 2 * NKV) * D;
  Tensor qkv_d = to_dev(qkv, {B, T, W}), dout_d = to_dev(dout, {B, T, NH * D});
  Tensor out_d = poisoned({B, T, NH * D}), lse_d = poisoned({B, NH, T}), dqkv_d = poisoned({B, T, W});
  {
    Autocast scope(dt);
    cuda::attention_fused_forward(out_d, lse_d, qkv_d, NH, NKV);
    cuda::attention_fused_backward(dqkv_d, dout_d, qkv_d, out_d, lse_d, NH, NKV);
  }
  return {to_host(out_d), to_host(lse_d), to_host(dqkv_d)};
}

VecF rounded(DType dt, const VecF& v) {
  VecF r(v.size());
  round_to(dt, v.data(), r.data(), (int64_t)v.size());
  return r;
}

struct Case {
  int B, T, NH, NKV, D;
  DType dt;
};

}  // namespace

// The shapes: T = 64 (one whole tile) with G = 2 at D = 32; T = 130 (3 tiles, the last of 2
// rows) at D = 64; GPT-2's B 2, T 1024, 12 heads of 64 (16 tiles); T = 77 with four query
// heads on one kv head at the largest D = 128 (the largest shared memory); T = 1 at the
// smallest D = 16; T = 130 again with f16 operands; and the other head dims the kernels are
// compiled for (48, 80, 96, 112: each is its own template instance) at awkward T.
//
// Tolerances. The reference uses the same 16-bit-rounded q, k, v, dout the kernels use, so
// what remains is the kernels' own 16-bit rounding of P (forward's P V, backward's P^T dO)
// and of dS (dS^T Q, dS K): a relative error up to u = 2^-8 (bf16; 2^-11 for f16) per
// element, random in sign (RMS about u / sqrt(3) = 2.3e-3), plus fp32 accumulation (~1e-6).
// out = sum_s P_s V_s / l is a weighted sum of random V rows, so its norm-relative error is
// about that RMS, 2e-3; 1e-2 leaves a 4x margin and still catches indexing errors (those
// give O(1) differences). The gradients add delta (from out, with out's error) and dS =
// P (dP - delta), whose cancellation can amplify the rounding a little: 2e-2. lse comes
// from fp32 statistics of fp32-accumulated scores of the rounded operands (no 16-bit
// rounding after the product): 1e-3 is loose. The fp32 GPU kernels on the same rounded
// inputs are held to the same bounds (they differ from the float64 reference only by fp32
// rounding, ~1e-6). (Against the fp32 kernels on the UNrounded inputs the rounding of q, k
// alone moves a score by ~4e-3 absolute, so lse at T = 1 would differ by ~3e-3 relative:
// that comparison would measure the rounding of the inputs, not these kernels.)
TEST(CudaAttentionTc, MatchesFloat64AndFp32Kernel) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(2027);
  for (Case cs : {Case{2, 64, 4, 2, 32, DType::bf16}, {1, 130, 2, 2, 64, DType::bf16}, {2, 1024, 12, 12, 64, DType::bf16},
                  {1, 77, 4, 1, 128, DType::bf16}, {1, 1, 2, 2, 16, DType::bf16}, {1, 130, 2, 2, 64, DType::f16},
                  {1, 100, 2, 1, 48, DType::bf16}, {1, 90, 3, 3, 80, DType::f16}, {2, 70, 2, 2, 96, DType::bf16},
                  {1, 140, 2, 1, 112, DType::bf16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D
                                    << " " << dtype_name(cs.dt));
    ASSERT_TRUE(cuda::attention_tc_supported(D));
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    VecF qkv16 = rounded(cs.dt, qkv), dout16 = rounded(cs.dt, dout);

    const GpuResult r = run_gpu(cs.dt, qkv, dout, B, T, NH, NKV, D);
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.out, ref.out), 1e-2) << "out vs float64";
    EXPECT_LT(rel_err(r.lse, ref.lse), 1e-3) << "lse vs float64";
    EXPECT_LT(rel_err(r.dqkv, ref.dqkv), 2e-2) << "dqkv vs float64";

    const GpuResult f = run_gpu(DType::f32, qkv16, dout16, B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.out, f.out), 1e-2) << "out vs fp32 kernel";
    EXPECT_LT(rel_err(r.lse, f.lse), 1e-3) << "lse vs fp32 kernel";
    EXPECT_LT(rel_err(r.dqkv, f.dqkv), 2e-2) << "dqkv vs fp32 kernel";
  }
}

// The forward's lazily updated row max: the first key tile's scores are ~N(0, 1.3) but every
// later key adds 10 to its scores (q[0] = 4 for every query, k[0] = 20 for keys >= 64, 0
// before, scale 1/8), so for the rows >= 64 the max jumps by ~10 > kSlack = 8 at the second
// tile and the warp's O fragments go through the per-row rescale; the softmax stays spread
// over the later keys (not one-hot), so the main test's bounds and reasoning apply as is.
TEST(CudaAttentionTc, RescaleWhenTheMaxJumps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(31);
  const int B = 1, T = 200, NH = 2, NKV = 1, D = 64, W = (NH + 2 * NKV) * D;
  VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < NH; ++h) qkv[(size_t)t * W + h * D] = 4.0f;  // q[0]
    qkv[(size_t)t * W + NH * D] = t >= 64 ? 20.0f : 0.0f;             // k[0]
  }
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    VecF qkv16 = rounded(dt, qkv), dout16 = rounded(dt, dout);
    const GpuResult r = run_gpu(dt, qkv, dout, B, T, NH, NKV, D);
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.out, ref.out), 1e-2) << "out vs float64";
    EXPECT_LT(rel_err(r.lse, ref.lse), 1e-3) << "lse vs float64";
    EXPECT_LT(rel_err(r.dqkv, ref.dqkv), 2e-2) << "dqkv vs float64";
  }
}

// Same inputs, same bits: no atomics, a fixed grid and fixed summation orders.
TEST(CudaAttentionTc, Deterministic) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(8);
  for (Case cs : {Case{1, 77, 4, 1, 128, DType::bf16}, {2, 200, 4, 2, 64, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    const GpuResult a = run_gpu(cs.dt, qkv, dout, B, T, NH, NKV, D);
    const GpuResult b = run_gpu(cs.dt, qkv, dout, B, T, NH, NKV, D);
    EXPECT_TRUE(same_bits(a.out, b.out)) << "out";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << "lse";
    EXPECT_TRUE(same_bits(a.dqkv, b.dqkv)) << "dqkv";
  }
}

// D = 40 (not a multiple of 16) under a bf16 scope takes the fp32 kernels: the results equal
// the fp32 kernels' outside any scope bit for bit.
TEST(CudaAttentionTc, UnsupportedHeadDimFallsBackToFp32) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(9);
  const int B = 2, T = 70, NH = 4, NKV = 2, D = 40, W = (NH + 2 * NKV) * D;
  ASSERT_FALSE(cuda::attention_tc_supported(D));
  VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
  const GpuResult a = run_gpu(DType::bf16, qkv, dout, B, T, NH, NKV, D);
  const GpuResult f = run_gpu(DType::f32, qkv, dout, B, T, NH, NKV, D);
  EXPECT_TRUE(same_bits(a.out, f.out)) << "out";
  EXPECT_TRUE(same_bits(a.lse, f.lse)) << "lse";
  EXPECT_TRUE(same_bits(a.dqkv, f.dqkv)) << "dqkv";
}

// Bad shapes under a bf16 scope throw mt::Error as outside it (the checks come before the
// dispatch): a width that is not (NH + 2 NKV) D, D = 160, out / lse / dqkv of the wrong size.
TEST(CudaAttentionTc, RejectsBadShapes) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(4);
  auto dev = [&](const Shape& s) {
    VecF v = randv(shape_numel(s), g);
    return to_dev(v, s);
  };
  const int B = 2, T = 5, NH = 4, NKV = 2, D = 16, W = (NH + 2 * NKV) * D;
  Tensor qkv = dev({B, T, W}), out = dev({B, T, NH * D}), lse = dev({B, NH, T}), dqkv = dev({B, T, W});
  Autocast scope(DType::bf16);
  EXPECT_THROW(cuda::attention_fused_forward(out, lse, dev({B, T, W + 1}), NH, NKV), Error);
  {  // D = 160: a multiple of 16, but above both paths' 128
    const int D2 = 160, W2 = (NH + 2 * NKV) * D2;
    EXPECT_THROW(cuda::attention_fused_forward(dev({B, T, NH * D2}), lse, dev({B, T, W2}), NH, NKV), Error);
    EXPECT_THROW(cuda::attention_fused_backward(dev({B, T, W2}), dev({B, T, NH * D2}), dev({B, T, W2}),
                                                dev({B, T, NH * D2}), lse, NH, NKV),
                 Error);
  }
  EXPECT_THROW(cuda::attention_fused_forward(dev({B, T, NH * D + 1}), lse, qkv, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_forward(out, dev({B, NH, T + 1}), qkv, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dev({B, T, W - 1}), out, qkv, out, lse, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dqkv, dev({B, T, NH * D - 1}), qkv, out, lse, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dqkv, out, qkv, out, dev({B, NH, T - 1}), NH, NKV), Error);
}

// Host-side checks (no GPU needed): which head dims the tensor-core kernels take, and their
// entry points refusing an unsupported D or a non-16-bit dtype before touching the device.
TEST(CudaAttentionTc, SupportedHeadDimsAndArgumentChecks) {
  for (int64_t D : {16, 32, 48, 64, 80, 96, 112, 128}) EXPECT_TRUE(cuda::attention_tc_supported(D)) << D;
  for (int64_t D : {0, 3, 8, 40, 100, 144, 160, 256}) EXPECT_FALSE(cuda::attention_tc_supported(D)) << D;
  const AttentionShape s40{1, 4, 2, 1, 40, (2 + 2) * 40, 2}, s64{1, 4, 2, 1, 64, (2 + 2) * 64, 2};
  VecF buf(1, 0.0f);
  Tensor t = tf(buf, {1});
  EXPECT_THROW(cuda::attention_tc_forward(t, t, t, s40, DType::bf16), Error);
  EXPECT_THROW(cuda::attention_tc_backward(t, t, t, t, t, s40, DType::f16), Error);
  EXPECT_THROW(cuda::attention_tc_forward(t, t, t, s64, DType::f32), Error);
  try {
    cuda::attention_tc_forward(t, t, t, s40, DType::bf16);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim D = 40"), std::string::npos) << e.what();
  }
}

#else
TEST(CudaAttentionTc, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif
