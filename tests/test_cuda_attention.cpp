// The CUDA fused attention (src/ops/cuda/attention.cu) against the CPU fused attention
// (ops/attention_fused.cpp, itself checked against float64 and finite differences in
// tests/test_attention.cpp) and against the float64 reference of attention_ref.h: forward
// (out, lse) and backward (dqkv), on shapes that cross the kernels' 32-row tiles or stop
// short of them, with grouped-query heads and head dims from 3 to 128; bit-identical
// reruns; and the shape errors (D above 128 among them). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
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
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

using namespace mt;
using namespace mt::test;

#if MESHTRAIN_CUDA

namespace {

// The GPU's out, lse (forward) and dqkv (backward from the GPU's own out and lse).
struct GpuResult {
  VecF out, lse, dqkv;
};
GpuResult run_gpu(VecF& qkv, VecF& dout, int B, int T, int NH, int NKV, int D) {
  const int W = (NH + 2 * NKV) * D;
  Tensor qkv_d = to_dev(qkv, {B, T, W}), dout_d = to_dev(dout, {B, T, NH * D});
  Tensor out_d = poisoned({B, T, NH * D}), lse_d = poisoned({B, NH, T}), dqkv_d = poisoned({B, T, W});
  cuda::attention_fused_forward(out_d, lse_d, qkv_d, NH, NKV);
  cuda::attention_fused_backward(dqkv_d, dout_d, qkv_d, out_d, lse_d, NH, NKV);
  return {to_host(out_d), to_host(lse_d), to_host(dqkv_d)};
}

}  // namespace

// The shapes: T = 1 (one row, one key); T = 37 (a second, 5-row query tile) with three
// query heads on one kv head; T = 64 (whole tiles) with G = 2; T = 130 (5 tiles, the last
// of 2 rows) at GPT-2's D = 64; T = 256 at the largest D = 128 (the raised shared-memory
// limit); D = 100 (the 4th column group partly used) and D = 3 (odd, under a warp).
TEST(CudaAttention, MatchesCpuAndFloat64) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(2026);
  struct Case { int B, T, NH, NKV, D; };
  for (Case cs : {Case{2, 1, 2, 2, 8}, {1, 37, 3, 1, 16}, {2, 64, 4, 2, 32}, {1, 130, 2, 2, 64}, {1, 256, 2, 2, 128},
                  {1, 45, 4, 1, 100}, {2, 33, 2, 1, 3}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv(B * T * W, g, -2, 2), dout = randv(B * T * NH * D, g);

    // CPU fused attention on host copies.
    VecF out_c(B * T * NH * D, kNaN), lse_c(B * NH * T, kNaN), dqkv_c(B * T * W, kNaN);
    attention_fused_forward(tf(out_c, {B, T, NH * D}), tf(lse_c, {B, NH, T}), tf(qkv, {B, T, W}), NH, NKV);
    attention_fused_backward(tf(dqkv_c, {B, T, W}), tf(dout, {B, T, NH * D}), tf(qkv, {B, T, W}),
                             tf(out_c, {B, T, NH * D}), tf(lse_c, {B, NH, T}), NH, NKV);

    const GpuResult r = run_gpu(qkv, dout, B, T, NH, NKV, D);

    // Both sides are fp32 with errors of a few ulps per dot product / softmax step (u = 6e-8
    // times sqrt of the terms, D <= 128 and T <= 256 here), summed in different orders; the
    // norm-relative difference is expected near 1e-7 to 1e-6. The gradient's dS = P (dP -
    // delta) cancels somewhat, which costs at most a small factor; 1e-5 leaves that room
    // and still catches any indexing error (those give O(1) differences).
    EXPECT_LT(rel_err(r.out, out_c), 1e-5) << "out vs CPU";
    EXPECT_LT(rel_err(r.lse, lse_c), 1e-5) << "lse vs CPU";
    EXPECT_LT(rel_err(r.dqkv, dqkv_c), 1e-5) << "dqkv vs CPU";

    // Elementwise against float64 with the harness's tolerance (kRtol relative plus kAtol of
    // the largest magnitude: the same bound the CPU kernel meets in test_attention.cpp).
    const Ref ref = attention_ref(to_d(qkv), to_d(dout), B, T, NH, NKV, D);
    expect_close(r.out, ref.out, "out vs float64");
    expect_close(r.lse, ref.lse, "lse vs float64");
    expect_close(r.dqkv, ref.dqkv, "dqkv vs float64");
  }
}

// Same inputs, same bits: no atomics, a fixed grid and fixed summation orders.
TEST(CudaAttention, Deterministic) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(7);
  struct Case { int B, T, NH, NKV, D; };
  for (Case cs : {Case{1, 37, 3, 1, 16}, {2, 130, 4, 2, 64}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv(B * T * W, g, -2, 2), dout = randv(B * T * NH * D, g);
    const GpuResult a = run_gpu(qkv, dout, B, T, NH, NKV, D), b = run_gpu(qkv, dout, B, T, NH, NKV, D);
    EXPECT_EQ(0, std::memcmp(a.out.data(), b.out.data(), a.out.size() * sizeof(float))) << "out";
    EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << "lse";
    EXPECT_EQ(0, std::memcmp(a.dqkv.data(), b.dqkv.data(), a.dqkv.size() * sizeof(float))) << "dqkv";
  }
}

// Bad shapes throw mt::Error naming the op: D = 160 (above the kernels' 128), a width that
// is not (NH + 2 NKV) D, NH not a multiple of NKV, out / lse / dqkv of the wrong size.
TEST(CudaAttention, RejectsBadShapes) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(3);
  auto dev = [&](const Shape& s) {
    VecF v = randv(shape_numel(s), g);
    return to_dev(v, s);
  };
  {  // D = 160
    const int B = 1, T = 4, NH = 2, NKV = 1, D = 160, W = (NH + 2 * NKV) * D;
    Tensor qkv = dev({B, T, W}), out = dev({B, T, NH * D}), lse = dev({B, NH, T}), dqkv = dev({B, T, W});
    EXPECT_THROW(cuda::attention_fused_forward(out, lse, qkv, NH, NKV), Error);
    EXPECT_THROW(cuda::attention_fused_backward(dqkv, out, qkv, out, lse, NH, NKV), Error);
    try {
      cuda::attention_fused_forward(out, lse, qkv, NH, NKV);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("head dim D = 160"), std::string::npos) << e.what();
    }
  }
  const int B = 2, T = 5, NH = 4, NKV = 2, D = 8, W = (NH + 2 * NKV) * D;
  Tensor qkv = dev({B, T, W}), out = dev({B, T, NH * D}), lse = dev({B, NH, T}), dqkv = dev({B, T, W});
  EXPECT_THROW(cuda::attention_fused_forward(out, lse, dev({B, T, W + 1}), NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_forward(out, lse, qkv, 3, 2), Error);
  EXPECT_THROW(cuda::attention_fused_forward(dev({B, T, NH * D + 1}), lse, qkv, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_forward(out, dev({B, NH, T + 1}), qkv, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dev({B, T, W - 1}), out, qkv, out, lse, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dqkv, dev({B, T, NH * D - 1}), qkv, out, lse, NH, NKV), Error);
  EXPECT_THROW(cuda::attention_fused_backward(dqkv, out, qkv, out, dev({B, NH, T - 1}), NH, NKV), Error);
  // a host tensor where the device is expected
  VecF host(B * T * NH * D, 0.5f);
  EXPECT_THROW(cuda::attention_fused_forward(tf(host, {B, T, NH * D}), lse, qkv, NH, NKV), Error);
}

#else
TEST(CudaAttention, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif
