// The float64 causal grouped-query attention the attention tests hold the kernels to, and
// the 16-bit rounding of their inputs: for tests/test_cuda_attention*.cpp and
// tests/test_attention_mma_emulation.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "op_harness.h"
#include "ops/autocast.h"

namespace mt::test {

// Float64 causal GQA attention over qkv [B, T, W]: out [B, T, NH D], lse [B, NH, T], and,
// given dout [B, T, NH D], the gradient dqkv [B, T, W] of sum(out * dout).
struct Ref {
  VecD out, lse, dqkv;
};
inline Ref attention_ref(const VecD& qkv, const VecD& dout, int B, int T, int NH, int NKV, int D) {
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


// v rounded to dt (bf16 or f16), widened back to fp32.
inline VecF rounded(DType dt, const VecF& v) {
  VecF r(v.size());
  round_to(dt, v.data(), r.data(), (int64_t)v.size());
  return r;
}

// One attention shape and the 16-bit dtype of its operands.
struct AttentionCase {
  int B, T, NH, NKV, D;
  DType dt;
};

}  // namespace mt::test
