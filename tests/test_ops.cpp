// The op harness: every CPU op against
//   (a) a float64 reference forward written here with naive loops, and
//   (b) for backward, central finite differences of that float64 reference: with
//       L = sum(out * R) for a fixed random R, the op's float32 backward seeded with
//       dout = R must match dL/dinput of the float64 reference (eps 1e-6 in double, so the
//       finite differences themselves are accurate to ~1e-9 and both the backward formulas
//       and the forward are checked against float64).
// Plus: overwrite vs accumulate semantics, ignored targets, in-place aliasing, bit-exact
// results for 1, 2 and 3 OpenMP threads, and shape errors that throw mt::Error.
// The attention ops (both paths, and context parallelism's parts) are in
// tests/test_attention.cpp, on the same harness (tests/op_harness.h).
//
// Tolerances: element i passes when |got - ref| <= rtol |ref_i| + atol max_j |ref_j| with
// rtol = 1e-4, atol = 1e-5. float32 has a unit roundoff of 6e-8; sums of up to a few hundred
// terms (and cancellation in the norm backward) give errors up to ~1e-6 of the magnitude
// of the terms, so 1e-4 / 1e-5 leaves a wide margin, while a wrong formula is off by O(1).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"
#include "op_harness.h"

using namespace mt;
using namespace mt::test;

namespace {

// ---- float64 references ---------------------------------------------------------------

VecD layernorm_ref(const VecD& x, const VecD& w, const VecD& b, int N, int C, double eps, VecD* mean = nullptr,
                   VecD* rstd = nullptr) {
  VecD y(N * C);
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    const double r = 1.0 / std::sqrt(v / C + eps);
    for (int c = 0; c < C; ++c) y[n * C + c] = (x[n * C + c] - m) * r * w[c] + b[c];
    if (mean) (*mean)[n] = m;
    if (rstd) (*rstd)[n] = r;
  }
  return y;
}

VecD rmsnorm_ref(const VecD& x, const VecD& w, int N, int C, double eps, VecD* rstd = nullptr) {
  VecD y(N * C);
  for (int n = 0; n < N; ++n) {
    double ss = 0;
    for (int c = 0; c < C; ++c) ss += x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    for (int c = 0; c < C; ++c) y[n * C + c] = x[n * C + c] * r * w[c];
    if (rstd) (*rstd)[n] = r;
  }
  return y;
}

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }

VecD swiglu_ref(const VecD& gu, int N, int F) {
  VecD y(N * F);
  for (int n = 0; n < N; ++n)
    for (int f = 0; f < F; ++f) {
      const double g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
      y[n * F + f] = g / (1 + std::exp(-g)) * u;
    }
  return y;
}

VecD rope_ref(VecD x, int B, int T, int H, int D, int n_rot, double theta) {
  const int half = D / 2;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < n_rot; ++h)
        for (int i = 0; i < half; ++i) {
          const double ang = t * std::pow(theta, -2.0 * i / D);
          double* p = &x[((b * T + t) * H + h) * D];
          const double a = p[i], c = p[i + half];
          p[i] = a * std::cos(ang) - c * std::sin(ang);
          p[i + half] = c * std::cos(ang) + a * std::sin(ang);
        }
  return x;
}

VecD ce_ref(const VecD& logits, const std::vector<int32_t>& tg, int N, int V, VecD* lse = nullptr) {
  VecD loss(N, 0.0);
  for (int n = 0; n < N; ++n) {
    double m = -1e300, z = 0;
    for (int v = 0; v < V; ++v) m = std::max(m, logits[n * V + v]);
    for (int v = 0; v < V; ++v) z += std::exp(logits[n * V + v] - m);
    const double l = m + std::log(z);
    if (lse) (*lse)[n] = l;
    if (tg[n] >= 0) loss[n] = l - logits[n * V + tg[n]];
  }
  return loss;
}

}  // namespace

// ---- linear -----------------------------------------------------------------------------

TEST(Ops, Linear) {
  std::mt19937 g(1);
  for (auto [N, I, O] : {std::array{1, 5, 3}, {7, 17, 33}, {33, 64, 5}, {3, 1, 7}})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(testing::Message() << "N=" << N << " I=" << I << " O=" << O << " bias=" << bias);
      VecF x = randv(N * I, g), w = randv(O * I, g), b = randv(O, g), R = randv(N * O, g), y(N * O, kNaN);
      Tensor bt = tf(b, {O});
      linear_forward(tf(y, {N, O}), tf(x, {N, I}), tf(w, {O, I}), bias ? &bt : nullptr);
      VecD bd = to_d(b);
      expect_close(y, linear_ref(to_d(x), to_d(w), bias ? &bd : nullptr, N, I, O), "y");
      // dx overwrite (pre-filled with NaN) and accumulate (pre-filled with 0.5).
      VecF dx(N * I, kNaN), dxa(N * I, 0.5f), dw(O * I, 0.25f), db(O, -0.5f);
      linear_backward_input(tf(dx, {N, I}), tf(R, {N, O}), tf(w, {O, I}), false);
      linear_backward_input(tf(dxa, {N, I}), tf(R, {N, O}), tf(w, {O, I}), true);
      Tensor dbt = tf(db, {O});
      linear_backward_weight(tf(dw, {O, I}), bias ? &dbt : nullptr, tf(R, {N, O}), tf(x, {N, I}));
      const VecD Rd = to_d(R);
      auto L = [&](const VecD& xx, const VecD& ww, const VecD& bb) {
        return dot(linear_ref(xx, ww, bias ? &bb : nullptr, N, I, O), Rd);
      };
      expect_close(dx, fd_grad([&](const VecD& v) { return L(v, to_d(w), bd); }, to_d(x)), "dx");
      expect_close(dxa, fd_grad([&](const VecD& v) { return L(v, to_d(w), bd); }, to_d(x)), "dx (accumulate)", {},
                   0.5);
      expect_close(dw, fd_grad([&](const VecD& v) { return L(to_d(x), v, bd); }, to_d(w)), "dw", {}, 0.25);
      if (bias) expect_close(db, fd_grad([&](const VecD& v) { return L(to_d(x), to_d(w), v); }, bd), "db", {}, -0.5);
      else for (float v : db) EXPECT_EQ(v, -0.5f);
    }
}

// ---- embedding ----------------------------------------------------------------------------

TEST(Ops, Embedding) {
  std::mt19937 g(2);
  const int V = 11;
  for (int C : {5, 17, 64})
    for (bool pos : {true, false}) {
      SCOPED_TRACE(testing::Message() << "C=" << C << " wpe=" << pos);
      const int B = 3, T = 5, maxT = 7;
      std::vector<int32_t> tok(B * T);
      for (auto& t : tok) t = std::uniform_int_distribution<int>(0, V - 1)(g);
      tok[3] = tok[7] = tok[11] = 4;  // repeated ids: the scatter must add them all
      VecF wte = randv(V * C, g), wpe = randv(maxT * C, g), R = randv(B * T * C, g), out(B * T * C, kNaN);
      Tensor wpet = tf(wpe, {maxT, C});
      embedding_forward(tf(out, {B, T, C}), ti(tok, {B, T}), tf(wte, {V, C}), pos ? &wpet : nullptr);
      auto fwd = [&](const VecD& e, const VecD& p) {
        VecD o(B * T * C);
        for (int bt = 0; bt < B * T; ++bt)
          for (int c = 0; c < C; ++c) o[bt * C + c] = e[tok[bt] * C + c] + (pos ? p[(bt % T) * C + c] : 0.0);
        return o;
      };
      expect_close(out, fwd(to_d(wte), to_d(wpe)), "out");
      VecF dwte(V * C, 0.1f), dwpe(maxT * C, 0.2f);
      Tensor dwpet = tf(dwpe, {maxT, C});
      embedding_backward(tf(dwte, {V, C}), pos ? &dwpet : nullptr, tf(R, {B, T, C}), ti(tok, {B, T}));
      const VecD Rd = to_d(R);
      expect_close(dwte, fd_grad([&](const VecD& v) { return dot(fwd(v, to_d(wpe)), Rd); }, to_d(wte)), "dwte", {},
                   0.1f);
      if (pos)
        expect_close(dwpe, fd_grad([&](const VecD& v) { return dot(fwd(to_d(wte), v), Rd); }, to_d(wpe)), "dwpe",
                     {}, 0.2f);
      // 1-D tokens [B*T] take T from out's [B, T, C]: positions still restart every T rows.
      VecF out1(B * T * C, kNaN);
      embedding_forward(tf(out1, {B, T, C}), ti(tok, {B * T}), tf(wte, {V, C}), pos ? &wpet : nullptr);
      EXPECT_EQ(0, std::memcmp(out1.data(), out.data(), out.size() * sizeof(float))) << "1-D tokens";
    }
}

// ---- norms ---------------------------------------------------------------------------------

TEST(Ops, LayerNorm) {
  std::mt19937 g(3);
  for (auto [N, C] : {std::array{1, 5}, {3, 17}, {7, 64}, {33, 17}, {70, 5}}) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C);
    const float eps = 1e-5f;
    VecF x = randv(N * C, g, -2, 3), w = randv(C, g, 0.5, 1.5), b = randv(C, g), R = randv(N * C, g);
    VecF out(N * C), mean(N), rstd(N);
    layernorm_forward(tf(out, {N, C}), tf(mean, {N}), tf(rstd, {N}), tf(x, {N, C}), tf(w, {C}), tf(b, {C}), eps);
    VecD md(N), rd(N);
    expect_close(out, layernorm_ref(to_d(x), to_d(w), to_d(b), N, C, eps, &md, &rd), "out");
    expect_close(mean, md, "mean");
    expect_close(rstd, rd, "rstd");
    VecF dx(N * C, 0.3f), dw(C, 0.1f), db(C, -0.2f);  // all three accumulate
    layernorm_backward(tf(dx, {N, C}), tf(dw, {C}), tf(db, {C}), tf(R, {N, C}), tf(x, {N, C}), tf(w, {C}),
                       tf(mean, {N}), tf(rstd, {N}));
    const VecD Rd = to_d(R), xd = to_d(x), wd = to_d(w), bd = to_d(b);
    expect_close(dx, fd_grad([&](const VecD& v) { return dot(layernorm_ref(v, wd, bd, N, C, eps), Rd); }, xd), "dx",
                 {}, 0.3f);
    expect_close(dw, fd_grad([&](const VecD& v) { return dot(layernorm_ref(xd, v, bd, N, C, eps), Rd); }, wd), "dw",
                 {}, 0.1f);
    expect_close(db, fd_grad([&](const VecD& v) { return dot(layernorm_ref(xd, wd, v, N, C, eps), Rd); }, bd), "db",
                 {}, -0.2f);
  }
}

TEST(Ops, RMSNorm) {
  std::mt19937 g(4);
  for (auto [N, C] : {std::array{1, 5}, {3, 17}, {7, 64}, {33, 17}, {70, 5}}) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C);
    const float eps = 1e-6f;
    VecF x = randv(N * C, g, -2, 3), w = randv(C, g, 0.5, 1.5), R = randv(N * C, g), out(N * C), rstd(N);
    rmsnorm_forward(tf(out, {N, C}), tf(rstd, {N}), tf(x, {N, C}), tf(w, {C}), eps);
    VecD rd(N);
    expect_close(out, rmsnorm_ref(to_d(x), to_d(w), N, C, eps, &rd), "out");
    expect_close(rstd, rd, "rstd");
    VecF dx(N * C, 0.3f), dw(C, 0.1f);
    rmsnorm_backward(tf(dx, {N, C}), tf(dw, {C}), tf(R, {N, C}), tf(x, {N, C}), tf(w, {C}), tf(rstd, {N}));
    const VecD Rd = to_d(R), xd = to_d(x), wd = to_d(w);
    expect_close(dx, fd_grad([&](const VecD& v) { return dot(rmsnorm_ref(v, wd, N, C, eps), Rd); }, xd), "dx", {},
                 0.3f);
    expect_close(dw, fd_grad([&](const VecD& v) { return dot(rmsnorm_ref(xd, v, N, C, eps), Rd); }, wd), "dw", {},
                 0.1f);
  }
}

// The residual add fused into the norms' forward (x += r, then the norm of the sum): the
// bits of add_inplace then the unfused norm, in x (the residual stream) and every output.
TEST(Ops, NormsFuseTheResidualAddBitForBit) {
  std::mt19937 g(14);
  for (auto [N, C] : {std::array{1, 5}, {33, 17}, {7, 64}}) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C);
    const VecF x0 = randv(N * C, g, -2, 3), r = randv(N * C, g);
    VecF w = randv(C, g, 0.5, 1.5), b = randv(C, g);
    for (bool rms : {false, true}) {
      auto run = [&](bool fused) {
        VecF x = x0, out(N * C, kNaN), mean(N, kNaN), rstd(N, kNaN), rv = r;
        const Tensor xt = tf(x, {N, C}), rt = tf(rv, {N, C});
        if (!fused) add_inplace(xt, rt);
        const Tensor* res = fused ? &rt : nullptr;
        if (rms) rmsnorm_forward(tf(out, {N, C}), tf(rstd, {N}), xt, tf(w, {C}), 1e-6f, res);
        else layernorm_forward(tf(out, {N, C}), tf(mean, {N}), tf(rstd, {N}), xt, tf(w, {C}), tf(b, {C}), 1e-5f, res);
        EXPECT_EQ(rv, r) << "the residual changed";
        return std::vector<VecF>{x, out, mean, rstd};
      };
      const auto fused = run(true), apart = run(false);
      for (size_t i = 0; i < fused.size(); ++i)
        EXPECT_EQ(0, std::memcmp(fused[i].data(), apart[i].data(), fused[i].size() * sizeof(float)))
            << (rms ? "rmsnorm" : "layernorm") << " output " << i << " (x, out, mean, rstd)";
    }
  }
  VecF x(8), out(8), mean(2), rstd(2), w(4, 1.0f), b(4), r(6);
  const Tensor short_r = tf(r, {6}), xt = tf(x, {2, 4}), r_overlapping = xt.view(1, {1, 4});
  EXPECT_THROW(layernorm_forward(tf(out, {2, 4}), tf(mean, {2}), tf(rstd, {2}), xt, tf(w, {4}), tf(b, {4}), 1e-5f,
                                 &short_r),
               Error);
  EXPECT_THROW(rmsnorm_forward(tf(out, {2, 4}), tf(rstd, {2}), xt, tf(w, {4}), 1e-6f, &xt), Error) << "r is x";
  EXPECT_THROW(rmsnorm_forward(tf(out, {1, 4}), tf(rstd, {1}), xt.view(0, {1, 4}), tf(w, {4}), 1e-6f, &r_overlapping),
               Error)
      << "r overlaps x";
}

// A 16-bit out (a block's kept norm output): the bits of an fp32 out then convert_from, with
// and without the fused residual add (x and the statistics as the fp32 run gives them).
TEST(Ops, NormsWriteSixteenBitOutputsAsTheirFp32ValuesRounded) {
  std::mt19937 g(15);
  for (auto [N, C] : {std::array{1, 5}, {33, 17}, {7, 64}})
    for (DType dt : {DType::bf16, DType::f16})
      for (bool rms : {false, true})
        for (bool fused : {false, true}) {
          SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C << " " << dtype_name(dt) << " rms " << rms
                                          << " residual " << fused);
          const VecF x0 = randv(N * C, g, -2, 3), r = randv(N * C, g), w = randv(C, g, 0.5, 1.5), b = randv(C, g);
          auto run = [&](DType out_dt) {
            VecF x = x0, rv = r, wv = w, bv = b, mean(N, kNaN), rstd(N, kNaN);
            std::vector<uint16_t> out16(N * C, 0xffff);
            VecF out32(N * C, kNaN);
            const Tensor out = out_dt == DType::f32 ? tf(out32, {N, C}) : Tensor::wrap(out16.data(), {N, C}, out_dt);
            const Tensor xt = tf(x, {N, C}), rt = tf(rv, {N, C});
            const Tensor* res = fused ? &rt : nullptr;
            if (rms) rmsnorm_forward(out, tf(rstd, {N}), xt, tf(wv, {C}), 1e-6f, res);
            else layernorm_forward(out, tf(mean, {N}), tf(rstd, {N}), xt, tf(wv, {C}), tf(bv, {C}), 1e-5f, res);
            VecF widened(N * C);
            const Tensor wt = tf(widened, {N, C});
            if (out_dt == DType::f32) {  // the fp32 out rounded, then widened back to compare
              std::vector<uint16_t> h(N * C);
              const Tensor ht = Tensor::wrap(h.data(), {N, C}, dt);
              ht.convert_from(out);
              wt.convert_from(ht);
            } else {
              wt.convert_from(out);
            }
            return std::vector<VecF>{x, widened, mean, rstd};
          };
          const auto half = run(dt), full = run(DType::f32);
          for (size_t i = 0; i < half.size(); ++i)
            EXPECT_EQ(0, std::memcmp(half[i].data(), full[i].data(), half[i].size() * sizeof(float)))
                << "output " << i << " (x, out, mean, rstd)";
        }
  VecF x(8), mean(2), rstd(2), w(4, 1.0f), b(4);
  const Tensor xt = tf(x, {2, 4}), over_x = Tensor::wrap(x.data(), {2, 4}, DType::bf16);  // x's first half
  EXPECT_THROW(layernorm_forward(over_x, tf(mean, {2}), tf(rstd, {2}), xt, tf(w, {4}), tf(b, {4}), 1e-5f), Error);
  EXPECT_THROW(rmsnorm_forward(over_x, tf(rstd, {2}), xt, tf(w, {4}), 1e-6f), Error);
}

// ---- activations ---------------------------------------------------------------------------

TEST(Ops, Gelu) {
  std::mt19937 g(5);
  for (int n : {1, 7, 33, 4099}) {  // 4099: crosses a fixed chunk boundary
    SCOPED_TRACE(testing::Message() << "n=" << n);
    VecF x = randv(n, g, -5, 5), R = randv(n, g), out(n, kNaN), dx(n, kNaN);
    x[0] = 0.0f;
    gelu_forward(tf(out, {n}), tf(x, {n}));
    auto fwd = [&](const VecD& v) {
      VecD o(v.size());
      for (size_t i = 0; i < v.size(); ++i) o[i] = gelu_ref(v[i]);
      return o;
    };
    expect_close(out, fwd(to_d(x)), "out");
    gelu_backward(tf(dx, {n}), tf(x, {n}), tf(R, {n}));
    const VecD Rd = to_d(R);
    const VecD ref = fd_grad([&](const VecD& v) { return dot(fwd(v), Rd); }, to_d(x));
    expect_close(dx, ref, "dx");
    gelu_backward(tf(R, {n}), tf(x, {n}), tf(R, {n}));  // dx aliasing dout
    EXPECT_EQ(0, std::memcmp(R.data(), dx.data(), n * sizeof(float))) << "in-place gelu_backward differs";
    gelu_forward(tf(x, {n}), tf(x, {n}));  // out aliasing x
    EXPECT_EQ(0, std::memcmp(x.data(), out.data(), n * sizeof(float))) << "in-place gelu_forward differs";
  }
}

TEST(Ops, SwiGLU) {
  std::mt19937 g(6);
  for (auto [N, F] : {std::array{1, 5}, {7, 17}, {3, 64}}) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " F=" << F);
    VecF gu = randv(N * 2 * F, g, -6, 6), R = randv(N * F, g), out(N * F, kNaN), dgu(N * 2 * F, kNaN);
    swiglu_forward(tf(out, {N, F}), tf(gu, {N, 2 * F}));
    expect_close(out, swiglu_ref(to_d(gu), N, F), "out");
    swiglu_backward(tf(dgu, {N, 2 * F}), tf(gu, {N, 2 * F}), tf(R, {N, F}));
    const VecD Rd = to_d(R);
    expect_close(dgu, fd_grad([&](const VecD& v) { return dot(swiglu_ref(v, N, F), Rd); }, to_d(gu)), "dgu");
    swiglu_backward(tf(gu, {N, 2 * F}), tf(gu, {N, 2 * F}), tf(R, {N, F}));  // dgu aliasing gu
    EXPECT_EQ(0, std::memcmp(gu.data(), dgu.data(), dgu.size() * sizeof(float))) << "in-place swiglu_backward";
  }
}

TEST(Ops, AddInplace) {
  std::mt19937 g(7);
  VecF a = randv(5000, g), b = randv(5000, g);
  VecD ref(5000);
  for (int i = 0; i < 5000; ++i) ref[i] = (double)a[i] + b[i];
  add_inplace(tf(a, {50, 100}), tf(b, {5000}));
  expect_close(a, ref, "a");
}

// ---- rope ------------------------------------------------------------------------------------

TEST(Ops, Rope) {
  std::mt19937 g(8);
  for (auto [T, D, n_rot] : {std::array{1, 4, 3}, {5, 8, 6}, {13, 16, 4}, {13, 6, 0}})
    for (float theta : {10000.0f, 500000.0f}) {
      SCOPED_TRACE(testing::Message() << "T=" << T << " D=" << D << " n_rot=" << n_rot << " theta=" << theta);
      const int B = 2, H = 6, n = B * T * H * D;
      VecF x = randv(n, g), R = randv(n, g), y = x;
      rope_forward(tf(y, {B, T, H, D}), n_rot, theta);
      expect_close(y, rope_ref(to_d(x), B, T, H, D, n_rot, theta), "out");
      VecF dx = R;
      rope_backward(tf(dx, {B, T, H, D}), n_rot, theta);
      const VecD Rd = to_d(R);
      expect_close(dx, fd_grad([&](const VecD& v) { return dot(rope_ref(v, B, T, H, D, n_rot, theta), Rd); }, to_d(x)),
                   "dx");
      rope_backward(tf(y, {B, T, H, D}), n_rot, theta);  // inverse of forward
      expect_close(y, to_d(x), "backward(forward(x))");
    }
}

// ---- cross-entropy ---------------------------------------------------------------------------

TEST(Ops, CrossEntropy) {
  std::mt19937 g(10);
  for (auto [N, V] : {std::array{1, 11}, {7, 259}, {33, 11}, {5, 8200}}) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " V=" << V);
    VecF logits = randv(N * V, g, -3, 3), losses(N, kNaN), lse(N, kNaN);
    for (int v = 0; v < V; ++v) logits[v] += 60.0f;  // row 0 far from 0: needs the max shift
    std::vector<int32_t> tg(N);
    int valid = 0;
    for (int n = 0; n < N; ++n) {
      tg[n] = (n % 3 == 2) ? -1 : std::uniform_int_distribution<int>(0, V - 1)(g);  // every third ignored
      valid += tg[n] >= 0;
    }
    const double total = cross_entropy_forward(tf(losses, {N}), tf(lse, {N}), tf(logits, {N, V}), ti(tg, {N}));
    VecD lsed(N);
    const VecD ref = ce_ref(to_d(logits), tg, N, V, &lsed);
    expect_close(losses, ref, "losses");
    expect_close(lse, lsed, "lse");
    double ref_total = 0;
    for (double l : ref) ref_total += l;
    EXPECT_NEAR(total, ref_total, 1e-5 * std::max(1.0, std::fabs(ref_total)));
    for (int n = 0; n < N; ++n) {
      if (tg[n] < 0) {
        EXPECT_EQ(losses[n], 0.0f);
      }
    }
    const float scale = 1.0f / valid;
    VecF dl(N * V, kNaN);
    cross_entropy_backward(tf(dl, {N, V}), tf(logits, {N, V}), tf(lse, {N}), ti(tg, {N}), scale);
    const auto idx = sample_idx(logits.size(), 2000, g);
    expect_close(dl,
                 fd_grad([&](const VecD& v) { return scale * dot(ce_ref(v, tg, N, V), VecD(N, 1.0)); }, to_d(logits),
                         idx),
                 "dlogits", idx);
    for (int n = 0; n < N; ++n) {
      if (tg[n] < 0) {
        for (int v = 0; v < V; ++v) ASSERT_EQ(dl[n * V + v], 0.0f) << "ignored row " << n;
      }
    }
    // In place: dlogits aliasing logits gives the same bits.
    cross_entropy_backward(tf(logits, {N, V}), tf(logits, {N, V}), tf(lse, {N}), ti(tg, {N}), scale);
    EXPECT_EQ(0, std::memcmp(logits.data(), dl.data(), dl.size() * sizeof(float)));
  }
}

// ---- determinism across thread counts -------------------------------------------------------

TEST(Ops, ThreadCountInvariance) {
  std::mt19937 g(11);
  const int B = 3, T = 67, C = 96, V = 259, NH = 4, NKV = 2, D = 24, W = (NH + 2 * NKV) * D, N = B * T;
  const VecF x = randv(N * C, g), w = randv(3 * C * C, g), bias = randv(3 * C, g), dy = randv(N * 3 * C, g);
  const VecF wn = randv(C, g, 0.5, 1.5), bn = randv(C, g), logits0 = randv(N * V, g, -4, 4);
  const VecF qkv0 = randv(N * W, g), dout0 = randv(N * NH * D, g);
  std::vector<int32_t> tok(N), tg(N);
  for (int i = 0; i < N; ++i) {
    tok[i] = std::uniform_int_distribution<int>(0, V - 1)(g);
    tg[i] = i % 5 == 0 ? -1 : tok[i];
  }
  auto T_ = [](const VecF& v, const Shape& s) { return Tensor::wrap(const_cast<float*>(v.data()), s, DType::f32); };
  expect_thread_invariant([&] {
    VecF y(N * 3 * C), dx(N * C, 1.0f), dw(3 * C * C, 1.0f), db(3 * C, 1.0f);
    Tensor bt = T_(bias, {3 * C}), dbt = tf(db, {3 * C});
    linear_forward(tf(y, {N, 3 * C}), T_(x, {N, C}), T_(w, {3 * C, C}), &bt);
    linear_backward_input(tf(dx, {N, C}), T_(dy, {N, 3 * C}), T_(w, {3 * C, C}), true);
    linear_backward_weight(tf(dw, {3 * C, C}), &dbt, T_(dy, {N, 3 * C}), T_(x, {N, C}));
    return std::vector<VecF>{y, dx, dw, db};
  }, "linear");
  expect_thread_invariant([&] {
    VecF out(N * C), m(N), r(N), dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f), out2(N * C), r2(N), dx2(N * C, 0.0f),
        dw2(C, 0.0f);
    layernorm_forward(tf(out, {N, C}), tf(m, {N}), tf(r, {N}), T_(x, {N, C}), T_(wn, {C}), T_(bn, {C}), 1e-5f);
    layernorm_backward(tf(dx, {N, C}), tf(dw, {C}), tf(db, {C}), T_(dy, {N, C}), T_(x, {N, C}), T_(wn, {C}),
                       tf(m, {N}), tf(r, {N}));
    rmsnorm_forward(tf(out2, {N, C}), tf(r2, {N}), T_(x, {N, C}), T_(wn, {C}), 1e-6f);
    rmsnorm_backward(tf(dx2, {N, C}), tf(dw2, {C}), T_(dy, {N, C}), T_(x, {N, C}), T_(wn, {C}), tf(r2, {N}));
    return std::vector<VecF>{out, m, r, dx, dw, db, out2, r2, dx2, dw2};
  }, "norms");
  expect_thread_invariant([&] {
    VecF ge(N * C), dge(N * C), sw(N * C / 2), dsw(N * C), a = x;
    gelu_forward(tf(ge, {N * C}), T_(x, {N * C}));
    gelu_backward(tf(dge, {N * C}), T_(x, {N * C}), T_(dy, {N * C}));
    swiglu_forward(tf(sw, {N, C / 2}), T_(x, {N, C}));
    swiglu_backward(tf(dsw, {N, C}), T_(x, {N, C}), T_(dy, {N, C / 2}));
    add_inplace(tf(a, {N * C}), T_(dy, {N * C}));
    VecF q = qkv0;
    rope_forward(tf(q, {B, T, NH + 2 * NKV, D}), NH + NKV, 10000.0f);
    return std::vector<VecF>{ge, dge, sw, dsw, a, q};
  }, "pointwise + rope");
  VecF wte = randv(V * C, g), wpe = randv(T * C, g);
  expect_thread_invariant([&] {
    VecF out(N * C), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
    Tensor wpet = tf(wpe, {T, C}), dwpet = tf(dwpe, {T, C});
    embedding_forward(tf(out, {B, T, C}), ti(tok, {B, T}), tf(wte, {V, C}), &wpet);
    embedding_backward(tf(dwte, {V, C}), &dwpet, T_(x, {B, T, C}), ti(tok, {B, T}));
    return std::vector<VecF>{out, dwte, dwpe};
  }, "embedding");
  expect_thread_invariant([&] {
    VecF out(N * NH * D), att(B * NH * T * T), dqkv(N * W), scr(B * NH * T * T);
    attention_forward(tf(out, {B, T, NH * D}), tf(att, {B, NH, T, T}), T_(qkv0, {B, T, W}), NH, NKV);
    attention_backward(tf(dqkv, {B, T, W}), tf(scr, {B, NH, T, T}), T_(dout0, {B, T, NH * D}), T_(qkv0, {B, T, W}),
                       tf(att, {B, NH, T, T}), NH, NKV);
    return std::vector<VecF>{out, att, dqkv};
  }, "attention");
  // The fused variant here (D = 24: padded copies) and at T = 300 with D = 32 (several
  // query blocks, two key blocks, operands in place).
  for (auto [TL, DL] : {std::array{T, D}, {300, 32}}) {
    const int WL = (NH + 2 * NKV) * DL;
    const VecF qkvl = randv(B * TL * WL, g), doutl = randv(B * TL * NH * DL, g);
    expect_thread_invariant([&] {
      VecF out(B * TL * NH * DL), lse(B * NH * TL), dqkv(B * TL * WL);
      attention_fused_forward(tf(out, {B, TL, NH * DL}), tf(lse, {B, NH, TL}), T_(qkvl, {B, TL, WL}), NH, NKV);
      attention_fused_backward(tf(dqkv, {B, TL, WL}), T_(doutl, {B, TL, NH * DL}), T_(qkvl, {B, TL, WL}),
                               tf(out, {B, TL, NH * DL}), tf(lse, {B, NH, TL}), NH, NKV);
      return std::vector<VecF>{out, lse, dqkv};
    }, "attention (fused)");
  }
  expect_thread_invariant([&] {
    VecF losses(N), lse(N), lg = logits0;
    const double tot = cross_entropy_forward(tf(losses, {N}), tf(lse, {N}), tf(lg, {N, V}), ti(tg, {N}));
    cross_entropy_backward(tf(lg, {N, V}), tf(lg, {N, V}), tf(lse, {N}), ti(tg, {N}), 0.01f);
    return std::vector<VecF>{losses, lse, lg, VecF{(float)tot, (float)(tot - (float)tot)}};
  }, "cross-entropy");
}

// ---- shape and dtype errors ------------------------------------------------------------------

TEST(Ops, ShapeErrorsThrow) {
  VecF a(64, 0.0f), b(64, 0.0f), c(64, 0.0f), d(64, 0.0f);
  std::vector<int32_t> tok(8, 0), badtok(8, 0);
  badtok[3] = 99;
  EXPECT_THROW(linear_forward(tf(a, {4, 4}), tf(b, {4, 3}), tf(c, {4, 4}), nullptr), Error);  // x in-dim != w in-dim
  EXPECT_THROW(linear_forward(tf(a, {2, 4}), tf(b, {4, 4}), tf(c, {4, 4}), nullptr), Error);  // y rows != x rows
  EXPECT_THROW(linear_backward_input(tf(a, {4, 3}), tf(b, {4, 4}), tf(c, {4, 4}), false), Error);
  EXPECT_THROW(linear_backward_weight(tf(a, {4, 4}), nullptr, tf(b, {3, 4}), tf(c, {4, 4})), Error);
  Tensor bias5 = tf(d, {5});
  EXPECT_THROW(linear_forward(tf(a, {4, 4}), tf(b, {4, 4}), tf(c, {4, 4}), &bias5), Error);
  EXPECT_THROW(layernorm_forward(tf(a, {4, 8}), tf(b, {4}), tf(c, {4}), tf(d, {4, 8}), tf(b, {7}), tf(c, {8}), 1e-5f),
               Error);
  EXPECT_THROW(rmsnorm_forward(tf(a, {4, 8}), tf(b, {3}), tf(d, {4, 8}), tf(c, {8}), 1e-5f), Error);
  EXPECT_THROW(gelu_forward(tf(a, {10}), tf(b, {11})), Error);
  EXPECT_THROW(swiglu_forward(tf(a, {4, 4}), tf(b, {4, 4})), Error);  // gu must be [N, 2F]
  EXPECT_THROW(add_inplace(tf(a, {10}), tf(b, {9})), Error);
  EXPECT_THROW(rope_forward(tf(a, {2, 4, 8}), 2, 10000.0f), Error);  // not 4-D
  EXPECT_THROW(rope_forward(tf(a, {2, 2, 2, 3}), 2, 10000.0f), Error);  // odd D
  EXPECT_THROW(rope_forward(tf(a, {2, 2, 2, 4}), 3, 10000.0f), Error);  // n_rot > H
  EXPECT_THROW(attention_forward(tf(a, {1, 2, 8}), tf(b, {1, 2, 2, 2}), tf(c, {1, 2, 10}), 2, 1), Error);  // W % 4
  EXPECT_THROW(attention_forward(tf(a, {1, 2, 8}), tf(b, {1, 2, 2, 2}), tf(c, {1, 2, 12}), 3, 2), Error);  // NH % NKV
  EXPECT_THROW(attention_forward(tf(a, {1, 2, 3}), tf(b, {1, 2, 2, 2}), tf(c, {1, 2, 12}), 2, 2), Error);  // out size
  EXPECT_THROW(cross_entropy_forward(tf(a, {8}), tf(b, {8}), tf(c, {8, 8}), tf(d, {8})), Error);  // f32 targets
  EXPECT_THROW(cross_entropy_forward(tf(a, {7}), tf(b, {8}), tf(c, {8, 8}), ti(tok, {8})), Error);
  EXPECT_THROW(cross_entropy_forward(tf(a, {8}), tf(b, {8}), tf(c, {8, 8}), ti(badtok, {8})), Error);  // target 99
  EXPECT_THROW(embedding_forward(tf(a, {2, 4, 8}), ti(badtok, {2, 4}), tf(b, {8, 8}), nullptr), Error);  // id 99
  EXPECT_THROW(embedding_forward(tf(a, {2, 4, 4}), ti(tok, {2, 4}), tf(b, {8, 8}), nullptr), Error);
  Tensor wpe_short = tf(c, {2, 8});
  EXPECT_THROW(embedding_forward(tf(a, {1, 8, 8}), ti(tok, {1, 8}), tf(b, {8, 8}), &wpe_short), Error);  // maxT < T
}
