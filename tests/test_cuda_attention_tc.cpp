// The tensor-core attention path (src/ops/cuda/attention_tc.cu), taken by
// cuda::attention_fused_forward / attention_fused_backward under a bf16 or f16 Autocast
// scope: out, lse and dqkv against a float64 reference computed from the 16-bit-ROUNDED q,
// k, v and dout (attention_ref.h), and against the fp32 GPU kernels (outside the scope) on
// the same rounded inputs; shapes that cross the 64-row tiles or stop short of them,
// grouped-query heads, every templated D = 16, 32, ..., 128 and GPT-2's shape; the forward's
// rescale path (a row max that jumps between key tiles); bit-identical reruns; D = 40
// falling back to the fp32 kernels bit for bit; the shape errors. The mma.sync forward
// (attention_mma.cu, D = 64 and 128): against float64, the fp32 kernels and the WMMA
// forward, the backward fed its out and lse, its rescale path, bit-identical reruns and the
// dispatch. The mma.sync backward (attention_mma_backward.cu): against float64 and the WMMA
// backward on the same out and lse, reruns and dispatch. q|k|v and out handed over in 16
// bits against their fp32 values, bit for bit, on every path. Skips the GPU tests without a
// GPU (the host-side checks of attention_tc_supported and the tensor-core entry points'
// argument checks run anyway). The mma.sync kernels replayed on the host:
// tests/test_attention_mma_emulation.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_ref.h"
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
using Case = AttentionCase;

#if MESHTRAIN_CUDA

namespace {

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



// ---- The mma.sync forward (attention_mma.cu) ----------------------------------------------

namespace {

double max_abs_diff(const VecF& a, const VecF& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs((double)a[i] - (double)b[i]);
    if (!std::isfinite(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

// out, lse of one forward kernel (poisoned first), and dqkv of the tensor-core backward fed
// with that out and lse.
GpuResult run_tc_kernel(cuda::AttentionTcForward kernel, DType dt, VecF& qkv, VecF& dout, int B, int T, int NH,
                        int NKV, int D) {
  const int W = (NH + 2 * NKV) * D;
  Tensor qkv_d = to_dev(qkv, {B, T, W}), dout_d = to_dev(dout, {B, T, NH * D});
  Tensor out_d = poisoned({B, T, NH * D}), lse_d = poisoned({B, NH, T}), dqkv_d = poisoned({B, T, W});
  const AttentionShape s = attention_shape(qkv_d, NH, NKV, "test");
  cuda::attention_tc_forward(out_d, lse_d, qkv_d, s, dt, kernel);
  cuda::attention_tc_backward(dqkv_d, dout_d, qkv_d, out_d, lse_d, s, dt);
  return {to_host(out_d), to_host(lse_d), to_host(dqkv_d)};
}

}  // namespace

// The mma.sync forward at D = 64 and 128 over T = 1, T < 64, T = 64, T not a multiple of 64,
// several tiles, B = 1, 2 and G = 1, 2, 4, bf16 and f16, held (1) to the main test's bounds
// against the float64 reference and the fp32 kernels; (2) to the WMMA forward: both round the
// same q, k, v to 16 bits, use the same lazy max (so the same P before rounding up to fp32
// summation order, ~1e-6 relative) and the same expf / 1 / l / logf steps; only the fp32
// summation order differs, which flips the 16-bit rounding of a P element rarely (one ulp of
// P: at most 2^-8 |v| <= 8e-3 on one output, far less in norm): out norm-relative 1e-3 and
// max-abs 2e-2, lse norm-relative 1e-5 and max-abs 1e-4 (an indexing or layout error gives
// O(1) differences); (3) the existing backward fed its out and lse: dqkv against the float64
// reference (2e-2) and against the backward fed the WMMA forward's (1e-3). Outputs are poisoned
// with NaN first (rel_err and max_abs_diff are infinite on a NaN: every row < T is written).
TEST(CudaAttentionTc, MmaForwardMatchesReferencesAndWmma) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(4242);
  for (Case cs : {Case{1, 1, 2, 2, 64, DType::bf16}, {2, 17, 4, 2, 64, DType::bf16}, {1, 64, 4, 1, 64, DType::bf16},
                  {2, 130, 2, 2, 64, DType::bf16}, {1, 200, 4, 1, 64, DType::f16}, {2, 1024, 12, 12, 64, DType::bf16},
                  {1, 1, 2, 1, 128, DType::bf16}, {1, 50, 4, 2, 128, DType::bf16}, {2, 77, 4, 1, 128, DType::f16},
                  {1, 192, 2, 2, 128, DType::bf16}, {1, 333, 4, 2, 128, DType::bf16}, {1, 333, 2, 1, 64, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D
                                    << " " << dtype_name(cs.dt));
    ASSERT_TRUE(cuda::attention_mma_supported(D));
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    VecF qkv16 = rounded(cs.dt, qkv), dout16 = rounded(cs.dt, dout);

    const GpuResult r = run_tc_kernel(cuda::AttentionTcForward::mma, cs.dt, qkv, dout, B, T, NH, NKV, D);
    const GpuResult w = run_tc_kernel(cuda::AttentionTcForward::wmma, cs.dt, qkv, dout, B, T, NH, NKV, D);
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.out, ref.out), 1e-2) << "out vs float64";
    EXPECT_LT(rel_err(r.lse, ref.lse), 1e-3) << "lse vs float64";
    EXPECT_LT(rel_err(r.dqkv, ref.dqkv), 2e-2) << "dqkv (backward from the mma forward) vs float64";

    const GpuResult f = run_gpu(DType::f32, qkv16, dout16, B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.out, f.out), 1e-2) << "out vs fp32 kernel";
    EXPECT_LT(rel_err(r.lse, f.lse), 1e-3) << "lse vs fp32 kernel";

    EXPECT_LT(rel_err(r.out, w.out), 1e-3) << "out vs WMMA forward";
    EXPECT_LT(max_abs_diff(r.out, w.out), 2e-2) << "out vs WMMA forward (max abs)";
    EXPECT_LT(rel_err(r.lse, w.lse), 1e-5) << "lse vs WMMA forward";
    EXPECT_LT(max_abs_diff(r.lse, w.lse), 1e-4) << "lse vs WMMA forward (max abs)";
    EXPECT_LT(rel_err(r.dqkv, w.dqkv), 1e-3) << "dqkv: backward from the mma vs the WMMA forward's out, lse";
  }
}

// The lazy max's rescale path in the mma kernel (the RescaleWhenTheMaxJumps inputs: the row
// max jumps by ~10 > kSlack at the second key tile), at D = 64 and 128, against float64 and
// against the WMMA forward.
TEST(CudaAttentionTc, MmaForwardRescaleWhenTheMaxJumps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(31);
  for (int D : {64, 128}) {
    const int B = 1, T = 200, NH = 2, NKV = 1, W = (NH + 2 * NKV) * D;
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < NH; ++h) qkv[(size_t)t * W + h * D] = 4.0f;
      qkv[(size_t)t * W + NH * D] = t >= 64 ? 20.0f * std::sqrt(D / 64.0f) : 0.0f;
    }
    for (DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(testing::Message() << "D=" << D << " " << dtype_name(dt));
      VecF qkv16 = rounded(dt, qkv), dout16 = rounded(dt, dout);
      const GpuResult r = run_tc_kernel(cuda::AttentionTcForward::mma, dt, qkv, dout, B, T, NH, NKV, D);
      const GpuResult w = run_tc_kernel(cuda::AttentionTcForward::wmma, dt, qkv, dout, B, T, NH, NKV, D);
      const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
      EXPECT_LT(rel_err(r.out, ref.out), 1e-2) << "out vs float64";
      EXPECT_LT(rel_err(r.lse, ref.lse), 1e-3) << "lse vs float64";
      EXPECT_LT(rel_err(r.dqkv, ref.dqkv), 2e-2) << "dqkv vs float64";
      EXPECT_LT(rel_err(r.out, w.out), 1e-3) << "out vs WMMA forward";
      EXPECT_LT(rel_err(r.lse, w.lse), 1e-5) << "lse vs WMMA forward";
    }
  }
}

// The mma forward twice: the same bits; and attention_fused_forward under a bf16 scope takes
// it at D = 64 (unless MESHTRAIN_ATTENTION_KERNEL is set): the same bits as the explicit call.
TEST(CudaAttentionTc, MmaForwardDeterministicAndDispatched) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(77);
  for (Case cs : {Case{2, 200, 4, 2, 64, DType::bf16}, {1, 77, 4, 1, 128, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " D=" << D);
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    const GpuResult a = run_tc_kernel(cuda::AttentionTcForward::mma, cs.dt, qkv, dout, B, T, NH, NKV, D);
    const GpuResult b = run_tc_kernel(cuda::AttentionTcForward::mma, cs.dt, qkv, dout, B, T, NH, NKV, D);
    EXPECT_TRUE(same_bits(a.out, b.out)) << "out";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << "lse";
    EXPECT_TRUE(same_bits(a.dqkv, b.dqkv)) << "dqkv";
    const char* env = std::getenv("MESHTRAIN_ATTENTION_KERNEL");
    if (env == nullptr || *env == '\0') {  // unset or empty: the dispatch's own choice
      const GpuResult c = run_gpu(cs.dt, qkv, dout, B, T, NH, NKV, D);
      EXPECT_TRUE(same_bits(a.out, c.out)) << "out via attention_fused_forward";
      EXPECT_TRUE(same_bits(a.lse, c.lse)) << "lse via attention_fused_forward";
    }
  }
}

// ---- The mma.sync backward (attention_mma_backward.cu) ---------------------------------------

namespace {

// dqkv (poisoned first) of attention_tc_backward with the given kernels, from one forward's out
// and lse (the mma forward): both backward variants see the same out, lse.
struct BwdPair {
  VecF mma, wmma, mma_again;
};
BwdPair run_backward_pair(DType dt, VecF& qkv, VecF& dout, int B, int T, int NH, int NKV, int D) {
  const int W = (NH + 2 * NKV) * D;
  Tensor qkv_d = to_dev(qkv, {B, T, W}), dout_d = to_dev(dout, {B, T, NH * D});
  Tensor out_d = poisoned({B, T, NH * D}), lse_d = poisoned({B, NH, T});
  const AttentionShape s = attention_shape(qkv_d, NH, NKV, "test");
  cuda::attention_tc_forward(out_d, lse_d, qkv_d, s, dt);
  BwdPair r;
  for (int k = 0; k < 3; ++k) {
    Tensor dqkv_d = poisoned({B, T, W});
    cuda::attention_tc_backward(dqkv_d, dout_d, qkv_d, out_d, lse_d, s, dt,
                                k == 1 ? cuda::AttentionTcBackward::wmma : cuda::AttentionTcBackward::mma);
    (k == 0 ? r.mma : k == 1 ? r.wmma : r.mma_again) = to_host(dqkv_d);
  }
  return r;
}

}  // namespace

// The mma.sync dK/dV and dQ kernels at D = 64 and 128, T = 1, 17, 64, 77, 130, 333, 1024, G = 1,
// 2, 4, B = 1, 2, bf16 and f16, all fed the same forward's out and lse, dqkv poisoned with NaN
// first (every element is written: rel_err is infinite on a NaN): (1) against the float64
// reference, the main test's 2e-2; (2) against the WMMA backward: both round the same q, k, v,
// dout, P and dS with the same expressions, only the fp32 summation order of S, dP and the
// gradient sums differs, which flips the 16-bit rounding of a P or dS element rarely:
// norm-relative 1e-3 (an indexing or layout error gives O(1)); (3) run twice: the same bits.
TEST(CudaAttentionTc, MmaBackwardMatchesReferencesAndWmma) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(5151);
  for (Case cs : {Case{1, 1, 2, 2, 64, DType::bf16}, {2, 17, 4, 2, 64, DType::bf16}, {1, 64, 4, 1, 64, DType::f16},
                  {2, 77, 2, 1, 64, DType::bf16}, {2, 130, 2, 2, 64, DType::bf16}, {1, 333, 4, 2, 64, DType::f16},
                  {1, 1024, 4, 4, 64, DType::bf16}, {1, 1, 2, 1, 128, DType::f16}, {2, 17, 2, 2, 128, DType::bf16},
                  {1, 64, 4, 2, 128, DType::bf16}, {2, 77, 4, 1, 128, DType::f16}, {1, 130, 2, 1, 128, DType::bf16},
                  {1, 333, 4, 2, 128, DType::bf16}, {1, 1024, 2, 1, 128, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D
                                    << " " << dtype_name(cs.dt));
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    VecF qkv16 = rounded(cs.dt, qkv), dout16 = rounded(cs.dt, dout);
    const BwdPair r = run_backward_pair(cs.dt, qkv, dout, B, T, NH, NKV, D);
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    EXPECT_LT(rel_err(r.mma, ref.dqkv), 2e-2) << "mma backward vs float64";
    EXPECT_LT(rel_err(r.wmma, ref.dqkv), 2e-2) << "WMMA backward vs float64";
    EXPECT_LT(rel_err(r.mma, r.wmma), 1e-3) << "mma vs WMMA backward";
    EXPECT_TRUE(same_bits(r.mma, r.mma_again)) << "mma backward twice";
  }
}

// attention_fused_backward under a bf16 / f16 scope takes the mma backward at D = 64 and 128
// (unless MESHTRAIN_ATTENTION_KERNEL is set): the same bits as the explicit call.
TEST(CudaAttentionTc, MmaBackwardDispatched) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  if (const char* e = std::getenv("MESHTRAIN_ATTENTION_KERNEL"); e != nullptr && *e != '\0')
    GTEST_SKIP() << "MESHTRAIN_ATTENTION_KERNEL set";
  std::mt19937 g(78);
  for (Case cs : {Case{2, 200, 4, 2, 64, DType::bf16}, {1, 77, 4, 1, 128, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " D=" << D);
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    const BwdPair r = run_backward_pair(cs.dt, qkv, dout, B, T, NH, NKV, D);
    const GpuResult c = run_gpu(cs.dt, qkv, dout, B, T, NH, NKV, D);
    EXPECT_TRUE(same_bits(r.mma, c.dqkv)) << "dqkv via attention_fused_backward";
  }
}

// ---- q|k|v and out handed over in 16 bits --------------------------------------------------

namespace {

// A device tensor of dtype dt holding v rounded to dt.
Tensor to_dev16(const VecF& v, const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt, gpu(), MemTag::activations);
  t.convert_from(to_dev(v, s));
  return t;
}

// out, lse, dqkv from q|k|v values that are already 16-bit numbers (qkv16: rounded to dt),
// handed over in dt (in16) or in fp32; the forward's out rounded to dt before the backward
// reads it (in16: converted to a dt tensor; else rounded in place), as a block keeps it. kernel
// 0: attention_fused_* under a scope of dtype `scope`; 1: the mma kernels, 2: the WMMA ones
// (attention_tc_*, dt).
// offset > 0 (in16): the 16-bit qkv a view that many elements into its buffer.
GpuResult run_operands(int kernel, DType dt, DType scope, bool in16, const VecF& qkv16, VecF& dout, int B, int T,
                       int NH, int NKV, int D, int offset = 0) {
  const int W = (NH + 2 * NKV) * D;
  Tensor qkv = to_dev(qkv16, {B, T, W});
  if (in16) {
    const Tensor buf = Tensor::empty({(int64_t)B * T * W + offset}, dt, gpu(), MemTag::activations);
    const Tensor view = buf.view(offset, {B, T, W});
    view.convert_from(qkv);
    qkv = view;
  }
  Tensor dout_d = to_dev(dout, {B, T, NH * D});
  Tensor out_d = poisoned({B, T, NH * D}), lse_d = poisoned({B, NH, T}), dqkv_d = poisoned({B, T, W});
  Autocast guard(scope);
  const AttentionShape sh = attention_shape(to_dev(qkv16, {B, T, W}), NH, NKV, "test");
  auto forward = [&](const Tensor& out, const Tensor& lse) {
    if (kernel == 0) cuda::attention_fused_forward(out, lse, qkv, NH, NKV);
    else cuda::attention_tc_forward(out, lse, qkv, sh, dt, kernel == 1 ? cuda::AttentionTcForward::mma
                                                                   : cuda::AttentionTcForward::wmma);
  };
  forward(out_d, lse_d);
  const VecF out_rounded = rounded(dt, to_host(out_d));
  if (in16)  // the output in 16 bits too, as a block keeps it: the fp32 output rounded; on the
             // dispatch also one element into its buffer (2 bytes: the WMMA kernel through fp32)
    for (int64_t at : kernel == 0 ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{0}) {
      const Tensor buf = Tensor::empty({(int64_t)B * T * NH * D + at}, dt, gpu(), MemTag::activations);
      buf.convert_from(poisoned({(int64_t)B * T * NH * D + at}));  // NaN in 16 bits: unwritten shows
      const Tensor out16 = buf.view(at, {B, T, NH * D}), lse16 = poisoned({B, NH, T}), wide = poisoned({B, T, NH * D});
      forward(out16, lse16);
      wide.convert_from(out16);
      const VecF lse_host = to_host(lse16);
      if (at == 0) {
        EXPECT_TRUE(same_bits(to_host(wide), out_rounded)) << "a 16-bit out against the fp32 out rounded";
        EXPECT_TRUE(same_bits(lse_host, to_host(lse_d))) << "lse with a 16-bit out";
      } else {  // another kernel than the aligned out's where that was the mma one: 16-bit steps
        EXPECT_LT(rel_err(to_host(wide), out_rounded), 1e-2) << "a misaligned 16-bit out";
        EXPECT_LT(rel_err(lse_host, to_host(lse_d)), 1e-5) << "lse with a misaligned 16-bit out";
      }
    }
  const Tensor out_in = in16 ? to_dev16(out_rounded, {B, T, NH * D}, dt) : to_dev(out_rounded, {B, T, NH * D});
  if (kernel == 0) cuda::attention_fused_backward(dqkv_d, dout_d, qkv, out_in, lse_d, NH, NKV);
  else cuda::attention_tc_backward(dqkv_d, dout_d, qkv, out_in, lse_d, sh, dt, kernel == 1 ? cuda::AttentionTcBackward::mma
                                                                                  : cuda::AttentionTcBackward::wmma);
  return {to_host(out_d), to_host(lse_d), to_host(dqkv_d)};
}

}  // namespace

// q|k|v and out handed over in 16 bits, as a block keeps them on the GPU, give the bits of the
// same values in fp32 (and a 16-bit out is written as the fp32 out rounded): the mma kernels read 16-bit operands (fp32 ones rounded into scratch
// first, dout by the delta kernel), the WMMA and fp32 kernels widen 16-bit ones into scratch,
// and rounding a 16-bit number again changes nothing. For the explicit mma and WMMA kernels
// (D = 64 and 128, grouped-query heads, T across the tiles), attention_fused_* under the
// scope (the dispatch), at D = 40 (the fp32 kernels under a bf16 scope) and at D = 64
// outside any scope (the fp32 kernels): out, lse and dqkv bit for bit, bf16 and f16; the mma
// kernels at T = 1024 (16 key tiles through both buffers) give the same bits on a rerun.
// attention_fused_reads_16bit says which of these read the 16 bits as they are: a 16-bit qkv
// 4 elements into its buffer (8 bytes: not 16-byte aligned) does not, and takes the WMMA
// kernels (the bits of the explicit WMMA run). A 16-bit qkv of the other 16-bit dtype than
// the scope's is refused (rounding it would round twice).
TEST(CudaAttentionTc, SixteenBitOperandsGiveTheBitsOfTheirFp32Values) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(6161);
  struct Op {
    int kernel, B, T, NH, NKV, D;
    DType dt, scope;
  };
  for (Op c : {Op{1, 2, 130, 4, 2, 64, DType::bf16, DType::bf16}, {1, 1, 77, 4, 1, 128, DType::f16, DType::f16},
               {2, 2, 130, 4, 2, 64, DType::f16, DType::f16}, {2, 1, 77, 2, 1, 128, DType::bf16, DType::bf16},
               {0, 2, 200, 4, 2, 64, DType::bf16, DType::bf16}, {0, 1, 70, 4, 2, 40, DType::bf16, DType::bf16},
               {0, 1, 70, 2, 2, 64, DType::f16, DType::f32}, {1, 1, 1024, 4, 2, 64, DType::bf16, DType::bf16}}) {
    const int W = (c.NH + 2 * c.NKV) * c.D;
    SCOPED_TRACE(testing::Message() << "kernel " << c.kernel << " B=" << c.B << " T=" << c.T << " NH=" << c.NH
                                    << " NKV=" << c.NKV << " D=" << c.D << " " << dtype_name(c.dt) << " under "
                                    << dtype_name(c.scope));
    const VecF qkv16 = rounded(c.dt, randv((size_t)c.B * c.T * W, g, -2, 2));
    VecF dout = randv((size_t)c.B * c.T * c.NH * c.D, g);
    const GpuResult a = run_operands(c.kernel, c.dt, c.scope, true, qkv16, dout, c.B, c.T, c.NH, c.NKV, c.D);
    const GpuResult f = run_operands(c.kernel, c.dt, c.scope, false, qkv16, dout, c.B, c.T, c.NH, c.NKV, c.D);
    EXPECT_TRUE(same_bits(a.out, f.out)) << "out";
    EXPECT_TRUE(same_bits(a.lse, f.lse)) << "lse";
    EXPECT_TRUE(same_bits(a.dqkv, f.dqkv)) << "dqkv";
    // every element written: a NaN left from the poison is infinitely far
    EXPECT_LT(rel_err(a.out, f.out) + rel_err(a.lse, f.lse) + rel_err(a.dqkv, f.dqkv), 1e-30);
    const GpuResult again = run_operands(c.kernel, c.dt, c.scope, true, qkv16, dout, c.B, c.T, c.NH, c.NKV, c.D);
    EXPECT_TRUE(same_bits(a.out, again.out) && same_bits(a.lse, again.lse) && same_bits(a.dqkv, again.dqkv))
        << "rerun";
  }
  {  // which calls read the 16 bits as they are
    std::mt19937 g2(3);
    const int B = 1, T = 130, NH = 4, NKV = 2, W = (NH + 2 * NKV) * 64;
    const VecF qkv16 = rounded(DType::bf16, randv((size_t)B * T * W, g2, -2, 2));
    VecF dout = randv((size_t)B * T * NH * 64, g2);
    Autocast scope(DType::bf16);
    const Tensor q32 = to_dev(qkv16, {B, T, W}), q16 = to_dev16(qkv16, {B, T, W}, DType::bf16);
    const char* e = std::getenv("MESHTRAIN_ATTENTION_KERNEL");
    const bool env = e != nullptr && *e != '\0';  // set (to wmma: anything else is an error)
    EXPECT_EQ(attention_fused_reads_16bit(q16, NH, NKV), !env);
    EXPECT_FALSE(attention_fused_reads_16bit(q32, NH, NKV));
    EXPECT_FALSE(attention_fused_reads_16bit(to_dev16(qkv16, {B, T, W}, DType::f16), NH, NKV));
    const int W40 = (NH + 2 * NKV) * 40;
    EXPECT_FALSE(attention_fused_reads_16bit(to_dev16(VecF((size_t)B * T * W40, 0.5f), {B, T, W40}, DType::bf16),
                                             NH, NKV));
    const Tensor buf = Tensor::empty({(int64_t)B * T * W + 4}, DType::bf16, gpu(), MemTag::activations);
    EXPECT_FALSE(attention_fused_reads_16bit(buf.view(4, {B, T, W}), NH, NKV)) << "8-byte aligned";
    {
      Autocast off(DType::f32);
      EXPECT_FALSE(attention_fused_reads_16bit(q16, NH, NKV)) << "outside a 16-bit scope";
    }
    const GpuResult mis = run_operands(0, DType::bf16, DType::bf16, true, qkv16, dout, B, T, NH, NKV, 64, 4);
    const GpuResult wmma = run_operands(2, DType::bf16, DType::bf16, true, qkv16, dout, B, T, NH, NKV, 64);
    EXPECT_TRUE(same_bits(mis.out, wmma.out) && same_bits(mis.lse, wmma.lse) && same_bits(mis.dqkv, wmma.dqkv))
        << "a misaligned 16-bit qkv takes the WMMA kernels";
  }
  const int B = 1, T = 5, NH = 2, NKV = 1, D = 64, W = (NH + 2 * NKV) * D;
  const VecF v = randv((size_t)B * T * W, g);
  Tensor out = poisoned({B, T, NH * D}), lse = poisoned({B, NH, T});
  Autocast scope(DType::f16);
  EXPECT_THROW(cuda::attention_fused_forward(out, lse, to_dev16(v, {B, T, W}, DType::bf16), NH, NKV), Error);
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
