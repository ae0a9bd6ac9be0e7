// Host emulation (no GPU) of the warp-level tensor-core instructions the mma.sync attention
// kernels use (mma.m16n8k16, ldmatrix.x4 with and without .trans), built on the mappings of
// src/ops/cuda/attention_mma_layout.h, and the mma.sync BACKWARD (attention_mma_backward.cu)
// replayed lane by lane with them: for tests/test_attention_mma_emulation.cpp (its only includer).
#pragma once

#include <cmath>
#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "op_harness.h"
#include "ops/autocast.h"
#include "ops/cuda/attention_mma_layout.h"

namespace mt::test::mma_emu {

struct LaneRegs {  // one warp's registers for one mma operand: [lane][element]
  float v[32][8];
};

// acc[lane][4] += A B with A (16x16), B (16x8) gathered from the lanes per the PTX layout.
inline void emu_mma(float (&acc)[32][4], const LaneRegs& a, const LaneRegs& b) {
  namespace ml = mt::cuda::mma_layout;
  double A[16][16] = {}, Bm[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) A[ml::a_row(lane, i)][ml::a_col(lane, i)] = a.v[lane][i];
    for (int i = 0; i < 4; ++i) Bm[ml::b_k(lane, i)][ml::b_n(lane, i)] = b.v[lane][i];
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      double d = 0;
      for (int k = 0; k < 16; ++k) d += A[ml::c_row(lane, i)][k] * Bm[k][ml::c_col(lane, i)];
      acc[lane][i] += (float)d;
    }
}

// ldmatrix.x4 (trans or not) from a tile accessor: lane L's register r, half e, as LaneRegs
// element 2 r + e; key_fn / dim_fn: the row address lane `src` supplies (key, dim offsets).
template <class Tile, class KeyFn, class DimFn>
LaneRegs emu_ldsm(const Tile& tile, int key0, int dim0, KeyFn key_fn, DimFn dim_fn, bool trans) {
  namespace ml = mt::cuda::mma_layout;
  LaneRegs r{};
  for (int lane = 0; lane < 32; ++lane)
    for (int reg = 0; reg < 4; ++reg)
      for (int e = 0; e < 2; ++e) {
        const int src = 8 * reg + ml::ldm_row(lane, e, trans);
        r.v[lane][2 * reg + e] = tile(key0 + key_fn(src), dim0 + dim_fn(src) + ml::ldm_col(lane, e, trans));
      }
  return r;
}

// ---- The mma.sync backward replayed ---------------------------------------------------------
// attention_mma_dkv_kernel and attention_mma_dq_kernel replayed lane by lane with the same
// fragment mappings (a_ldm_* for the A operands, k_ldm_* and v_ldm_* .trans for the B operands,
// p_tile / p_elem for P and dS reused as A operands), the same tile walk (4 warps of 16 rows,
// 32-column chunks), skips and masks, P and dS rounded to the 16-bit type dt. lse, delta:
// [B, NH, T]. dqkv: NaN where not written; writes: how often each element was written.
using EmuAcc = float[32][4];

struct EmuBwd {
  DType dt;
  int D;
  float r16(float x) const {
    float y;
    round_to(dt, &x, &y, 1);
    return y;
  }
  static void split(const LaneRegs& r, LaneRegs& b0, LaneRegs& b1) {
    b0 = LaneRegs{};
    b1 = LaneRegs{};
    for (int lane = 0; lane < 32; ++lane)
      for (int x = 0; x < 4; ++x) b0.v[lane][x] = r.v[lane][x], b1.v[lane][x] = r.v[lane][4 + x];
  }
  // score_chunk: acc[n] = A rows [ar0, +16) times B rows [br0 + 8 n, +8) transposed, over D.
  template <class TA, class TB, class Skip>
  void score(EmuAcc (&acc)[4], const TA& A, int ar0, const TB& Bt, int br0, Skip skip) const {
    namespace ml = mt::cuda::mma_layout;
    std::memset(acc, 0, sizeof(acc));
    for (int c = 0; c < D / 32; ++c) {
      const LaneRegs a0 = emu_ldsm(A, ar0, 32 * c, ml::a_ldm_row, ml::a_ldm_col, false);
      const LaneRegs a1 = emu_ldsm(A, ar0, 32 * c + 16, ml::a_ldm_row, ml::a_ldm_col, false);
      for (int n = 0; n < 4; ++n) {
        if (skip(n)) continue;
        LaneRegs b0, b1;
        split(emu_ldsm(Bt, br0 + 8 * n, 32 * c, ml::k_ldm_key, ml::k_ldm_dim, false), b0, b1);
        emu_mma(acc[n], a0, b0);
        emu_mma(acc[n], a1, b1);
      }
    }
  }
  // pv_product: out[D / 8] += round16(p) (16 x 32) times B rows [br0, br0 + 32) x D.
  template <class TB, class Skip>
  void grad(std::vector<float>& out, const EmuAcc (&p)[4], const TB& Bt, int br0, Skip skip) const {
    namespace ml = mt::cuda::mma_layout;
    for (int st = 0; st < 2; ++st) {
      if (skip(st)) continue;
      LaneRegs pa{};
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j)
          for (int e = 0; e < 2; ++e) pa.v[lane][2 * j + e] = r16(p[ml::p_tile(st, j)][lane][ml::p_elem(j, e)]);
      for (int n2 = 0; n2 < D / 16; ++n2) {
        LaneRegs b0, b1;
        split(emu_ldsm(Bt, br0 + 16 * st, 16 * n2, ml::v_ldm_key, ml::v_ldm_dim, true), b0, b1);
        emu_mma(*reinterpret_cast<EmuAcc*>(&out[(size_t)(2 * n2) * 128]), pa, b0);
        emu_mma(*reinterpret_cast<EmuAcc*>(&out[(size_t)(2 * n2 + 1) * 128]), pa, b1);
      }
    }
  }
};

inline void emulate_mma_backward(const VecF& qkv16, const VecF& dout16, const VecF& lse, const VecF& delta, int B, int T,
                          int NH, int NKV, int D, DType dt, VecF& dqkv, std::vector<int>& writes) {
  namespace ml = mt::cuda::mma_layout;
  const int W = (NH + 2 * NKV) * D, OW = NH * D, G = NH / NKV, NO = D / 8, nt = (T + 63) / 64;
  const float scale = 1.0f / std::sqrt((float)D);
  const EmuBwd E{dt, D};
  dqkv.assign((size_t)B * T * W, NAN);
  writes.assign(dqkv.size(), 0);
  auto store = [&](const std::vector<float>& acc, int row0, int b, int col0) {
    for (int lane = 0; lane < 32; ++lane)
      for (int n = 0; n < NO; ++n)
        for (int i = 0; i < 4; ++i) {
          const int row = row0 + ml::c_row(lane, i);
          if (row >= T) continue;
          const size_t at = ((size_t)b * T + row) * W + col0 + 8 * n + ml::c_col(lane, i);
          dqkv[at] = acc[(size_t)n * 128 + lane * 4 + i];
          ++writes[at];
        }
  };
  for (int b = 0; b < B; ++b) {
    auto qkv_at = [&](int col0) {
      return [&, col0](int row, int d) { return row < T ? qkv16[((size_t)b * T + row) * W + col0 + d] : 0.0f; };
    };
    auto dout_at = [&](int h) {
      return [&, h](int row, int d) { return row < T ? dout16[((size_t)b * T + row) * OW + h * D + d] : 0.0f; };
    };
    // dK, dV
    for (int kh = 0; kh < NKV; ++kh) {
      const auto Kt = qkv_at((NH + kh) * D), Vt = qkv_at((NH + NKV + kh) * D);
      for (int kt = 0; kt < nt; ++kt)
        for (int w = 0; w < 4; ++w) {
          const int k0 = 64 * kt, wk = k0 + 16 * w;
          std::vector<float> dk((size_t)NO * 128, 0.0f), dv((size_t)NO * 128, 0.0f);
          for (int gq = 0; gq < G; ++gq) {
            const int h = kh * G + gq;
            const auto Qt = qkv_at(h * D);
            const auto dOt = dout_at(h);
            for (int q0 = k0; q0 < T; q0 += 64)
              for (int qc = 0; qc < 64; qc += 32) {
                const int qa = q0 + qc;
                if (qa + 31 < wk) continue;
                EmuAcc s[4], dp[4];
                auto skip8 = [&](int n) { return qa + 8 * n + 7 < wk; };
                E.score(s, Kt, wk, Qt, qa, skip8);
                E.score(dp, Vt, wk, dOt, qa, skip8);
                for (int n = 0; n < 4; ++n)
                  for (int lane = 0; lane < 32; ++lane)
                    for (int i = 0; i < 4; ++i) {
                      const int key = wk + ml::c_row(lane, i), t = qa + 8 * n + ml::c_col(lane, i);
                      const bool seen = key <= t && t < T;
                      const size_t r = ((size_t)b * NH + h) * T + (seen ? t : 0);
                      const float p = seen ? std::exp(s[n][lane][i] * scale - lse[r]) : 0.0f;
                      s[n][lane][i] = p;
                      dp[n][lane][i] = seen ? p * (dp[n][lane][i] - delta[r]) * scale : 0.0f;
                    }
                auto skip16 = [&](int st) { return qa + 16 * st + 15 < wk; };
                E.grad(dv, s, dOt, qa, skip16);
                E.grad(dk, dp, Qt, qa, skip16);
              }
          }
          store(dk, wk, b, (NH + kh) * D);
          store(dv, wk, b, (NH + NKV + kh) * D);
        }
    }
    // dQ
    for (int h = 0; h < NH; ++h) {
      const int kh = h / G;
      const auto Qt = qkv_at(h * D), Kt = qkv_at((NH + kh) * D), Vt = qkv_at((NH + NKV + kh) * D);
      const auto dOt = dout_at(h);
      for (int qt = 0; qt < nt; ++qt)
        for (int w = 0; w < 4; ++w) {
          const int q0 = 64 * qt, wq = q0 + 16 * w;
          std::vector<float> dq((size_t)NO * 128, 0.0f);
          for (int k0 = 0; k0 <= q0; k0 += 64)
            for (int kc = 0; kc < 64; kc += 32) {
              const int ka = k0 + kc;
              if (ka > wq + 15) break;
              EmuAcc s[4], dp[4];
              auto skip8 = [&](int n) { return ka + 8 * n > wq + 15; };
              E.score(s, Qt, wq, Kt, ka, skip8);
              E.score(dp, dOt, wq, Vt, ka, skip8);
              for (int n = 0; n < 4; ++n)
                for (int lane = 0; lane < 32; ++lane)
                  for (int i = 0; i < 4; ++i) {
                    const int t = wq + ml::c_row(lane, i), key = ka + 8 * n + ml::c_col(lane, i);
                    const bool seen = key <= t && t < T;
                    const size_t r = ((size_t)b * NH + h) * T + (seen ? t : 0);
                    const float p = seen ? std::exp(s[n][lane][i] * scale - lse[r]) : 0.0f;
                    dp[n][lane][i] = seen ? p * (dp[n][lane][i] - delta[r]) * scale : 0.0f;
                  }
              auto skip16 = [&](int st) { return ka + 16 * st > wq + 15; };
              E.grad(dq, dp, Kt, ka, skip16);
            }
          store(dq, wq, b, h * D);
        }
    }
  }
}

}  // namespace mt::test::mma_emu
