// The mma.sync attention kernels' logic checked on the host, without a GPU: the fragment
// mappings of src/ops/cuda/attention_mma_layout.h emulated lane by lane, and the forward
// (attention_mma.cu) and backward (attention_mma_backward.cu) replayed with them against the
// float64 reference. These catch errors in the kernels' logic (tile counts, skips, masks,
// register packing) before any GPU run; a divergence between a replay and the CUDA code is
// for the GPU tests (tests/test_cuda_attention_tc.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attention_mma_emulation.h"
#include "attention_ref.h"
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/cuda/attention_mma_layout.h"

using namespace mt;
using namespace mt::test;
using namespace mt::test::mma_emu;
using Case = AttentionCase;

// ---- Host emulation of the mma.sync forward (no GPU) -----------------------------------------
// attention_mma_forward_kernel's algorithm replayed lane by lane on the host with the same
// fragment mappings (attention_mma_layout.h) and the same tile walk, skips, masks, lazy max and
// quad reductions: each mma.m16n8k16 is emulated by gathering A and B from the 32 lanes'
// registers with the PTX layout and scattering D back; ldmatrix by reading the rows whose
// addresses the lanes supply. Checked against the float64 reference (the kernel's bounds), and
// that every out element and lse of a row < T is written exactly once. This catches errors in
// the kernel's logic (tile counts, skips, masks, packing) before any GPU run; it cannot catch
// a divergence between this replay and the CUDA code, which the GPU tests do.
namespace {

// The kernel replayed (LaneRegs, emu_mma, emu_ldsm: attention_mma_emulation.h): NW warps
// per block (8 at D 64, 4 at D 128 in the kernel).
void emulate_mma_forward(const VecF& qkv16, int B, int T, int NH, int NKV, int D, int NW, DType dt, VecF& out,
                         VecF& lse, std::vector<int>& out_writes, std::vector<int>& lse_writes) {
  namespace ml = mt::cuda::mma_layout;
  const int W = (NH + 2 * NKV) * D, OW = NH * D, G = NH / NKV, kM = 16 * NW, kN = 64, NO = D / 8;
  const float scale = 1.0f / std::sqrt((float)D);
  out.assign((size_t)B * T * OW, NAN);
  lse.assign((size_t)B * NH * T, NAN);
  out_writes.assign(out.size(), 0);
  lse_writes.assign(lse.size(), 0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const int kh = h / G;
      auto at = [&](int row, int col) { return row < T ? qkv16[((size_t)b * T + row) * W + col] : 0.0f; };
      for (int qt = 0; qt < (T + kM - 1) / kM; ++qt) {
        const int q0 = qt * kM, nkt = std::min((q0 + kM + kN - 1) / kN, (T + kN - 1) / kN);
        for (int w = 0; w < NW; ++w) {
          const int wr = q0 + 16 * w;
          // Q registers: qf[kk] as LaneRegs (element 2 j + e = register j, half e), rounded
          std::vector<LaneRegs> qf(D / 16);
          for (int kk = 0; kk < D / 16; ++kk)
            for (int lane = 0; lane < 32; ++lane)
              for (int j = 0; j < 4; ++j)
                for (int e = 0; e < 2; ++e)
                  qf[kk].v[lane][2 * j + e] =
                      at(wr + ml::q_reg_row(lane, j), h * D + 16 * kk + ml::q_reg_col(lane, j) + e);
          std::vector<float> o((size_t)NO * 32 * 4, 0.0f);
          auto O = [&](int n) -> float(&)[32][4] { return *reinterpret_cast<float(*)[32][4]>(&o[(size_t)n * 128]); };
          float m[32][2], l[32][2];
          for (int lane = 0; lane < 32; ++lane) m[lane][0] = m[lane][1] = -INFINITY, l[lane][0] = l[lane][1] = 0;
          for (int kt = 0; kt < nkt; ++kt) {
            const int k0 = kt * kN;
            auto Kt = [&](int key, int d) { return key < T ? at(key, (NH + kh) * D + d) : 0.0f; };
            auto Vt = [&](int key, int d) { return key < T ? at(key, (NH + NKV + kh) * D + d) : 0.0f; };
            if (k0 > wr + 15) continue;
            const bool diag = k0 + kN - 1 > wr;
            float s[8][32][4] = {};
            for (int n = 0; n < 8; ++n) {
              if (k0 + 8 * n > wr + 15) continue;
              for (int c = 0; c < D / 32; ++c) {
                const LaneRegs bk = emu_ldsm(Kt, k0 + 8 * n, 32 * c, ml::k_ldm_key, ml::k_ldm_dim, false);
                LaneRegs b0{}, b1{};
                for (int lane = 0; lane < 32; ++lane)
                  for (int x = 0; x < 4; ++x) b0.v[lane][x] = bk.v[lane][x], b1.v[lane][x] = bk.v[lane][4 + x];
                emu_mma(s[n], qf[2 * c], b0);
                emu_mma(s[n], qf[2 * c + 1], b1);
              }
            }
            // per lane (the quad's reductions computed from all 4 lanes, as the butterflies do)
            float x[8][32][4], a[32][2], mxq[32][2];
            for (int lane = 0; lane < 32; ++lane)
              for (int n = 0; n < 8; ++n)
                for (int i = 0; i < 4; ++i) {
                  const int key = k0 + 8 * n + ml::c_col(lane, i), row = wr + ml::c_row(lane, i);
                  x[n][lane][i] = !diag || key <= row ? s[n][lane][i] * scale : -INFINITY;
                }
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
                for (int ql = lane & ~3; ql < (lane & ~3) + 4; ++ql)
                  for (int n = 0; n < 8; ++n)
                    for (int i = 2 * r; i < 2 * r + 2; ++i) mx = std::max(mx, x[n][ql][i]);
                mxq[lane][r] = mx;
              }
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r) {
                a[lane][r] = 1.0f;
                EXPECT_TRUE(std::isfinite(mxq[lane][r])) << "a visited tile without an unmasked key for a row";
                if (mxq[lane][r] > m[lane][r] + 8.0f) {
                  if (m[lane][r] != -INFINITY) a[lane][r] = std::exp(m[lane][r] - mxq[lane][r]);
                  m[lane][r] = mxq[lane][r];
                }
              }
            float p[8][32][4], rs[32][2] = {};
            for (int lane = 0; lane < 32; ++lane)
              for (int n = 0; n < 8; ++n)
                for (int i = 0; i < 4; ++i) p[n][lane][i] = std::exp(x[n][lane][i] - m[lane][i / 2]);
            float p16[8][32][4];  // P rounded to 16 bits (one call: round_to may go parallel)
            round_to(dt, &p[0][0][0], &p16[0][0][0], 8 * 32 * 4);
            for (int lane = 0; lane < 32; ++lane)
              for (int r = 0; r < 2; ++r) {
                for (int ql = lane & ~3; ql < (lane & ~3) + 4; ++ql)
                  for (int n = 0; n < 8; ++n)
                    for (int i = 2 * r; i < 2 * r + 2; ++i) rs[lane][r] += p[n][ql][i];
                l[lane][r] = a[lane][r] * l[lane][r] + rs[lane][r];
              }
            for (int n = 0; n < NO; ++n)
              for (int lane = 0; lane < 32; ++lane)
                for (int i = 0; i < 4; ++i) O(n)[lane][i] *= a[lane][i / 2];
            for (int st = 0; st < kN / 16; ++st) {
              if (k0 + 16 * st > wr + 15) continue;
              LaneRegs pa{};
              for (int lane = 0; lane < 32; ++lane)
                for (int j = 0; j < 4; ++j)
                  for (int e = 0; e < 2; ++e)
                    pa.v[lane][2 * j + e] = p16[ml::p_tile(st, j)][lane][ml::p_elem(j, e)];
              for (int n2 = 0; n2 < D / 16; ++n2) {
                const LaneRegs bv = emu_ldsm(Vt, k0 + 16 * st, 16 * n2, ml::v_ldm_key, ml::v_ldm_dim, true);
                LaneRegs b0{}, b1{};
                for (int lane = 0; lane < 32; ++lane)
                  for (int xx = 0; xx < 4; ++xx) b0.v[lane][xx] = bv.v[lane][xx], b1.v[lane][xx] = bv.v[lane][4 + xx];
                emu_mma(O(2 * n2), pa, b0);
                emu_mma(O(2 * n2 + 1), pa, b1);
              }
            }
          }
          for (int lane = 0; lane < 32; ++lane)
            for (int r = 0; r < 2; ++r) {
              const int row = wr + lane / 4 + 8 * r;
              if (row >= T) continue;
              const float inv = 1.0f / l[lane][r];
              if (lane % 4 == 0) {
                const size_t li = ((size_t)b * NH + h) * T + row;
                lse[li] = m[lane][r] + std::log(l[lane][r]);
                ++lse_writes[li];
              }
              for (int n = 0; n < NO; ++n)
                for (int e = 0; e < 2; ++e) {
                  const size_t oi = ((size_t)b * T + row) * OW + h * D + 8 * n + 2 * (lane % 4) + e;
                  out[oi] = O(n)[lane][2 * r + e] * inv;
                  ++out_writes[oi];
                }
            }
        }
      }
    }
}

}  // namespace

TEST(AttentionMmaEmulation, Forward) {
  std::mt19937 g(99);
  for (Case cs : {Case{1, 1, 2, 2, 64, DType::bf16}, {1, 70, 4, 2, 64, DType::bf16}, {2, 150, 2, 1, 64, DType::f16},
                  {1, 77, 4, 1, 128, DType::bf16}, {1, 130, 2, 2, 128, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    const int NW = D <= 64 ? 8 : 4;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    VecF qkv16 = rounded(cs.dt, qkv), dout16 = rounded(cs.dt, dout);
    VecF out, lse;
    std::vector<int> ow, lw;
    emulate_mma_forward(qkv16, B, T, NH, NKV, D, NW, cs.dt, out, lse, ow, lw);
    for (int c : ow) ASSERT_EQ(c, 1) << "an out element written " << c << " times";
    for (int c : lw) ASSERT_EQ(c, 1) << "an lse element written " << c << " times";
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    EXPECT_LT(rel_err(out, ref.out), 1e-2) << "out vs float64";
    EXPECT_LT(rel_err(lse, ref.lse), 1e-3) << "lse vs float64";
  }
}

// ---- Host emulation of the mma.sync backward (no GPU) ----------------------------------------
// attention_mma_dkv_kernel and attention_mma_dq_kernel (attention_mma_backward.cu) replayed lane
// by lane on the host with the same fragment mappings (a_ldm_* for the A operands, k_ldm_* and
// v_ldm_* .trans for the B operands, p_tile / p_elem for P and dS reused as A operands), the
// same tile walk (4 warps of 16 rows, 32-column chunks), skips and masks, P and dS rounded to
// the 16-bit type. Fed the float64 reference's lse and a delta computed as the delta kernel
// does; checked against the float64 dqkv (the GPU test's bound, 2e-2) and that every dqkv
// element of a row < T is written exactly once (by dK/dV or dQ). The replay:
// attention_mma_emulation.h.

TEST(AttentionMmaEmulation, Backward) {
  std::mt19937 g(123);
  for (Case cs : {Case{1, 1, 2, 2, 64, DType::bf16}, {1, 77, 4, 2, 64, DType::bf16}, {2, 130, 2, 1, 64, DType::f16},
                  {1, 70, 4, 1, 128, DType::bf16}, {1, 17, 2, 2, 128, DType::f16}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D, OW = NH * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NH=" << NH << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv((size_t)B * T * W, g, -2, 2), dout = randv((size_t)B * T * NH * D, g);
    VecF qkv16 = rounded(cs.dt, qkv), dout16 = rounded(cs.dt, dout);
    const Ref ref = attention_ref(to_d(qkv16), to_d(dout16), B, T, NH, NKV, D);
    VecF lse(ref.lse.begin(), ref.lse.end()), delta((size_t)B * NH * T, 0.0f);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h)
        for (int t = 0; t < T; ++t) {
          float s = 0;
          for (int d = 0; d < D; ++d) {
            const size_t at = ((size_t)b * T + t) * OW + h * D + d;
            s += dout16[at] * (float)ref.out[at];
          }
          delta[((size_t)b * NH + h) * T + t] = s;
        }
    VecF dqkv;
    std::vector<int> writes;
    emulate_mma_backward(qkv16, dout16, lse, delta, B, T, NH, NKV, D, cs.dt, dqkv, writes);
    for (int c : writes) ASSERT_EQ(c, 1) << "a dqkv element written " << c << " times";
    EXPECT_LT(rel_err(dqkv, ref.dqkv), 2e-2) << "dqkv vs float64";
  }
}

// Host-side (no GPU): the fragment mappings of attention_mma_layout.h, which the mma.sync
// forward computes its addresses and register packing with, emulated lane by lane:
// each mma.m16n8k16 operand (A 16x16, B 16x8, C 16x8) holds every element of its tile exactly
// once; the K tile's ldmatrix.x4 (row addresses k_ldm_*) delivers to every lane exactly the
// B elements of S = Q K^T (k = dim, n = key) it needs; the V tile's ldmatrix.x4.trans
// (v_ldm_*) those of O += P V (k = key, n = dim); the Q registers loaded from global memory
// are the A elements; and the S accumulators packed into P registers are the A elements of
// the P V k-step (the same lane holds the same (row, key) in both roles).
TEST(AttentionMmaEmulation, FragmentLayout) {
  namespace ml = mt::cuda::mma_layout;
  {  // coverage
    std::vector<int> a(16 * 16, 0), b(16 * 8, 0), c(16 * 8, 0);
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < 8; ++i) ++a[ml::a_row(lane, i) * 16 + ml::a_col(lane, i)];
      for (int i = 0; i < 4; ++i) ++b[ml::b_k(lane, i) * 8 + ml::b_n(lane, i)];
      for (int i = 0; i < 4; ++i) ++c[ml::c_row(lane, i) * 8 + ml::c_col(lane, i)];
    }
    for (int x : a) EXPECT_EQ(x, 1);
    for (int x : b) EXPECT_EQ(x, 1);
    for (int x : c) EXPECT_EQ(x, 1);
  }
  // ldmatrix.x4: lane L's register r element e is element (ldm_row, ldm_col)(L, e) of matrix r,
  // whose row rho is at the address lane 8 r + rho supplies.
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) {
        {  // K, no .trans: 8 keys x 32 dims; registers (2 q, 2 q + 1) = B of the k-step q
          const int rho = ml::ldm_row(lane, e, false), kap = ml::ldm_col(lane, e, false), src = 8 * r + rho;
          const int key = ml::k_ldm_key(src), dim = ml::k_ldm_dim(src) + kap;
          const int q = r / 2, i = 2 * (r % 2) + e;  // B element b_i of k-step q
          EXPECT_EQ(key, ml::b_n(lane, i)) << "K lane " << lane << " reg " << r << " e " << e;
          EXPECT_EQ(dim, 16 * q + ml::b_k(lane, i)) << "K lane " << lane << " reg " << r << " e " << e;
        }
        {  // V, .trans: 16 keys x 16 dims; registers (2 q, 2 q + 1) = B of output dims [8 q, 8 q + 8)
          const int rho = ml::ldm_row(lane, e, true), kap = ml::ldm_col(lane, e, true), src = 8 * r + rho;
          const int key = ml::v_ldm_key(src), dim = ml::v_ldm_dim(src) + kap;
          const int q = r / 2, i = 2 * (r % 2) + e;
          EXPECT_EQ(key, ml::b_k(lane, i)) << "V lane " << lane << " reg " << r << " e " << e;
          EXPECT_EQ(dim, 8 * q + ml::b_n(lane, i)) << "V lane " << lane << " reg " << r << " e " << e;
        }
      }
  for (int lane = 0; lane < 32; ++lane)
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * j + e;  // A element a_i in register j, half e
        // Q: register j = (row, col + e) of the k-step
        EXPECT_EQ(ml::q_reg_row(lane, j), ml::a_row(lane, i));
        EXPECT_EQ(ml::q_reg_col(lane, j) + e, ml::a_col(lane, i));
        // P of k-step st: accumulator s[p_tile(st, j)][p_elem(j, e)] sits at (c_row, 8 tile + c_col)
        for (int st = 0; st < 4; ++st) {
          const int tile = ml::p_tile(st, j), ce = ml::p_elem(j, e);
          EXPECT_EQ(ml::c_row(lane, ce), ml::a_row(lane, i)) << "P lane " << lane << " j " << j;
          EXPECT_EQ(8 * tile + ml::c_col(lane, ce), 16 * st + ml::a_col(lane, i)) << "P lane " << lane << " j " << j;
        }
      }
  // The backward's A operands by ldmatrix.x4 (a_ldm_*, no .trans) from a row-major [rows][cols]
  // tile: lane L's register r, half e is exactly A element a_{2 r + e} of the 16 x 16 k-step; and
  // the 32 row addresses cover the 16 rows x 2 column halves once each.
  {
    std::vector<int> cover(16 * 2, 0);
    for (int src = 0; src < 32; ++src) ++cover[ml::a_ldm_row(src) * 2 + ml::a_ldm_col(src) / 8];
    for (int x : cover) EXPECT_EQ(x, 1);
  }
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < 4; ++r)
      for (int e = 0; e < 2; ++e) {
        const int src = 8 * r + ml::ldm_row(lane, e, false);
        const int row = ml::a_ldm_row(src), col = ml::a_ldm_col(src) + ml::ldm_col(lane, e, false);
        EXPECT_EQ(row, ml::a_row(lane, 2 * r + e)) << "A ldmatrix lane " << lane << " reg " << r << " e " << e;
        EXPECT_EQ(col, ml::a_col(lane, 2 * r + e)) << "A ldmatrix lane " << lane << " reg " << r << " e " << e;
      }
  // ldmatrix row addresses are 16-byte aligned: dims offsets multiples of 8 elements
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(ml::a_ldm_col(lane) % 8, 0);
    EXPECT_EQ(ml::k_ldm_dim(lane) % 8, 0);
    EXPECT_EQ(ml::v_ldm_dim(lane) % 8, 0);
  }
}
