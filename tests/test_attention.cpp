// The attention ops on the op harness (tests/op_harness.h; the method and the tolerances are
// described at the top of tests/test_ops.cpp): the materialized and the fused attention
// against a float64 reference forward and central differences of it, the two paths against
// each other within a derived rounding bound, the attention parts that context parallelism
// runs (single parts, a ring without the communication, the whole sequence as the fused
// kernel), and shape errors that name the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#include "op_harness.h"

using namespace mt;
using namespace mt::test;

namespace {

// ---- float64 references ---------------------------------------------------------------

// out[B, T, NH D]; optionally att[B, NH, T, T] and lse[B, NH, T] (log-sum-exp of each
// row of scaled scores).
VecD attention_ref(const VecD& qkv, int B, int T, int NH, int NKV, int D, VecD* att = nullptr, VecD* lse = nullptr) {
  const int W = (NH + 2 * NKV) * D, G = NH / NKV;
  VecD out(B * T * NH * D, 0.0);
  if (att) att->assign(B * NH * T * T, 0.0);
  if (lse) lse->assign(B * NH * T, 0.0);
  VecD p(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const int kh = h / G;
      for (int t = 0; t < T; ++t) {
        const double* q = &qkv[(b * T + t) * W + h * D];
        double m = -1e300;
        for (int s = 0; s <= t; ++s) {
          const double* k = &qkv[(b * T + s) * W + (NH + kh) * D];
          double d = 0;
          for (int i = 0; i < D; ++i) d += q[i] * k[i];
          p[s] = d / std::sqrt((double)D);
          m = std::max(m, p[s]);
        }
        double z = 0;
        for (int s = 0; s <= t; ++s) z += (p[s] = std::exp(p[s] - m));
        if (lse) (*lse)[(b * NH + h) * T + t] = m + std::log(z);
        for (int s = 0; s <= t; ++s) {
          p[s] /= z;
          if (att) (*att)[((b * NH + h) * T + t) * T + s] = p[s];
          const double* v = &qkv[(b * T + s) * W + (NH + NKV + kh) * D];
          for (int i = 0; i < D; ++i) out[(b * T + t) * NH * D + h * D + i] += p[s] * v[i];
        }
      }
    }
  return out;
}

// One attention part (see attention_part_forward) in float64: query rows q of qkvq
// [B, Tq, W] over key/value rows k of qkvk [B, Tk, W]. Writes rows q of out [B, Tq, NH D]
// and lse [B, NH, Tq] (out 0 and lse -inf where a row sees no key). With dout, adds the
// gradient of sum(out * dout) of this part alone (its own softmax) into the query columns
// of rows q of dq [B, Tq, W] and the key/value columns of rows k of dkv [B, Tk, W] (dq and
// dkv may be one vector). The whole sequence: q = k = {0, T, 0}.
struct Heads { int B, NH, NKV, D; };
void part_ref(const Heads& g, const VecD& qkvq, int Tq, AttentionRows q, const VecD& qkvk, int Tk, AttentionRows k,
              VecD& out, VecD& lse, const VecD* dout = nullptr, VecD* dq = nullptr, VecD* dkv = nullptr) {
  const int NH = g.NH, NKV = g.NKV, D = g.D, W = (NH + 2 * NKV) * D, OW = NH * D;
  const double scale = 1.0 / std::sqrt((double)D);
  VecD p(k.count), dp(k.count);
  for (int b = 0; b < g.B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < q.count; ++i) {
        const int64_t t = q.first + i, kc = (NH + h / (NH / NKV)) * D, vc = kc + NKV * D;
        const int64_t n = std::clamp<int64_t>(q.position + i - k.position + 1, 0, k.count);  // keys seen
        const double* qv = &qkvq[(b * Tq + t) * W + h * D];
        auto key = [&](int64_t j) { return (b * Tk + k.first + j) * W; };
        double* o = &out[(b * Tq + t) * OW + h * D];
        double& l = lse[(b * NH + h) * Tq + t];
        std::fill_n(o, D, 0.0);
        l = -INFINITY;
        if (n == 0) continue;
        double m = -INFINITY, z = 0, delta = 0;
        for (int64_t j = 0; j < n; ++j) {
          p[j] = 0;
          for (int d = 0; d < D; ++d) p[j] += qv[d] * qkvk[key(j) + kc + d] * scale;
          m = std::max(m, p[j]);
        }
        for (int64_t j = 0; j < n; ++j) z += (p[j] = std::exp(p[j] - m));
        l = m + std::log(z);
        for (int64_t j = 0; j < n; ++j) {
          p[j] /= z;
          for (int d = 0; d < D; ++d) o[d] += p[j] * qkvk[key(j) + vc + d];
        }
        if (!dout) continue;
        const double* dO = &(*dout)[(b * Tq + t) * OW + h * D];
        for (int64_t j = 0; j < n; ++j) {
          dp[j] = 0;
          for (int d = 0; d < D; ++d) dp[j] += dO[d] * qkvk[key(j) + vc + d];
          delta += p[j] * dp[j];
        }
        for (int64_t j = 0; j < n; ++j) {
          const double ds = p[j] * (dp[j] - delta) * scale;
          for (int d = 0; d < D; ++d) {
            (*dq)[(b * Tq + t) * W + h * D + d] += ds * qkvk[key(j) + kc + d];
            (*dkv)[key(j) + kc + d] += ds * qv[d];
            (*dkv)[key(j) + vc + d] += p[j] * dO[d];
          }
        }
      }
}

// What fn throws as mt::Error, or "(no error)".
std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// ---- attention ---------------------------------------------------------------------------

TEST(Ops, Attention) {
  std::mt19937 g(9);
  const int NH = 4;
  struct Case { int B, T, NKV, D; };
  // T = 70 and 130 cross the kernels' 64-row blocks; there finite differences run on a
  // random sample of 300 coordinates to keep the test fast.
  for (Case cs : {Case{1, 1, 4, 8}, {2, 5, 1, 8}, {2, 13, 2, 4}, {1, 13, 4, 16}, {1, 70, 2, 8}, {1, 130, 1, 4}}) {
    const int B = cs.B, T = cs.T, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NKV=" << NKV << " D=" << D);
    VecF qkv = randv(B * T * W, g, -2, 2), R = randv(B * T * NH * D, g);
    VecF out(B * T * NH * D, kNaN), att(B * NH * T * T, kNaN), dqkv(B * T * W, kNaN), scr(B * NH * T * T, kNaN);
    attention_forward(tf(out, {B, T, NH * D}), tf(att, {B, NH, T, T}), tf(qkv, {B, T, W}), NH, NKV);
    VecD attd;
    expect_close(out, attention_ref(to_d(qkv), B, T, NH, NKV, D, &attd), "out");
    expect_close(att, attd, "att");
    for (int bh = 0; bh < B * NH; ++bh)  // exact zeros above the diagonal
      for (int t = 0; t < T; ++t)
        for (int s = t + 1; s < T; ++s) ASSERT_EQ(att[(bh * T + t) * T + s], 0.0f);
    attention_backward(tf(dqkv, {B, T, W}), tf(scr, {B, NH, T, T}), tf(R, {B, T, NH * D}), tf(qkv, {B, T, W}),
                       tf(att, {B, NH, T, T}), NH, NKV);
    const VecD Rd = to_d(R);
    const auto idx = sample_idx(qkv.size(), 300, g);
    expect_close(dqkv,
                 fd_grad([&](const VecD& v) { return dot(attention_ref(v, B, T, NH, NKV, D), Rd); }, to_d(qkv), idx),
                 "dqkv", idx);
  }
}

// The fused variant keeps lse instead of the probabilities. T = 70 crosses its 64-row query
// blocks, T = 300 its 256-key blocks (there rows see two key blocks, and in the "rising"
// case, with positive q and keys growing along s, the later block always holds the row
// maximum, so the running sums are rescaled); D = 5 and 3 are odd. D = 16 fills whole
// vectors, which the kernel reads and writes in place; other D go through padded copies.
TEST(Ops, AttentionFused) {
  std::mt19937 g(19);
  const int NH = 4;
  struct Case { int B, T, NKV, D; bool rising; };
  for (Case cs : {Case{1, 1, 4, 8, false}, {2, 5, 1, 5, false}, {2, 13, 2, 4, false}, {1, 67, 4, 3, false},
                  {1, 70, 2, 8, false}, {1, 70, 2, 16, false}, {1, 300, 1, 4, false}, {1, 300, 2, 4, true}}) {
    const int B = cs.B, T = cs.T, NKV = cs.NKV, D = cs.D, W = (NH + 2 * NKV) * D;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NKV=" << NKV << " D=" << D
                                    << (cs.rising ? " rising" : ""));
    VecF qkv = randv(B * T * W, g, -2, 2), R = randv(B * T * NH * D, g);
    if (cs.rising)
      for (int t = 0; t < B * T; ++t)
        for (int c = 0; c < (NH + NKV) * D; ++c) {
          float& x = qkv[t * W + c];
          x = std::fabs(x) * (c < NH * D ? 0.5f : 0.5f + 2.0f * (t % T) / T);
        }
    VecF out(B * T * NH * D, kNaN), lse(B * NH * T, kNaN), dqkv(B * T * W, kNaN);
    attention_fused_forward(tf(out, {B, T, NH * D}), tf(lse, {B, NH, T}), tf(qkv, {B, T, W}), NH, NKV);
    VecD lsed;
    expect_close(out, attention_ref(to_d(qkv), B, T, NH, NKV, D, nullptr, &lsed), "out");
    expect_close(lse, lsed, "lse");
    attention_fused_backward(tf(dqkv, {B, T, W}), tf(R, {B, T, NH * D}), tf(qkv, {B, T, W}), tf(out, {B, T, NH * D}),
                             tf(lse, {B, NH, T}), NH, NKV);
    const VecD Rd = to_d(R);
    const auto idx = sample_idx(qkv.size(), 300, g);
    expect_close(dqkv,
                 fd_grad([&](const VecD& v) { return dot(attention_ref(v, B, T, NH, NKV, D), Rd); }, to_d(qkv), idx),
                 "dqkv", idx);
  }
}

// The fused and the materialized variants compute the same function with different
// rounding. To first order each float32 result is off from the exact value by at most
// u * n * M (u = 2^-24), where M is the same expression evaluated with absolute values
// and n counts the roundings along its longest chain:
//   - a score s = scale q.k carries an absolute error <= u D smax (smax = the largest
//     scale sum_i |q_i k_i|), which exp turns into a relative error of p; exp adds 2 ulp,
//     the row sum (or its log-sum-exp) T roundings, the division 1;
//   - out = sum_s p_s v_s adds T roundings: n_out = D smax + 2 T + 4, M_out = sum_s p_s |v_s|;
//   - gradients add the D-term dot products (dP, delta) and the sums of dQ (T terms), dK
//     and dV (G T terms: every row of the group's G heads): n_grad = D smax + (2 + G) T +
//     2 D + 8, with M built from |dS| = scale p (|dO| . |v| + |dO| . |o|) and p |dO|.
// Two variants differ by at most the sum of their errors: tolerance 2 u n M per element.
// A wrong formula is off by O(M), some 10^3 times more.
TEST(Ops, AttentionFusedMatchesMaterialized) {
  std::mt19937 g(23);
  const int B = 2, T = 300, NH = 4, NKV = 2, D = 64, G = NH / NKV, W = (NH + 2 * NKV) * D;
  const VecF qkv = randv(B * T * W, g), dout = randv(B * T * NH * D, g);
  auto T_ = [](const VecF& v, const Shape& s) { return Tensor::wrap(const_cast<float*>(v.data()), s, DType::f32); };
  VecF out_m(B * T * NH * D), att(B * NH * T * T), scr(B * NH * T * T), dqkv_m(B * T * W);
  VecF out_f(B * T * NH * D), lse(B * NH * T), dqkv_f(B * T * W);
  attention_forward(tf(out_m, {B, T, NH * D}), tf(att, {B, NH, T, T}), T_(qkv, {B, T, W}), NH, NKV);
  attention_backward(tf(dqkv_m, {B, T, W}), tf(scr, {B, NH, T, T}), T_(dout, {B, T, NH * D}), T_(qkv, {B, T, W}),
                     tf(att, {B, NH, T, T}), NH, NKV);
  attention_fused_forward(tf(out_f, {B, T, NH * D}), tf(lse, {B, NH, T}), T_(qkv, {B, T, W}), NH, NKV);
  attention_fused_backward(tf(dqkv_f, {B, T, W}), T_(dout, {B, T, NH * D}), T_(qkv, {B, T, W}),
                           T_(out_f, {B, T, NH * D}), tf(lse, {B, NH, T}), NH, NKV);

  // Magnitudes M (absolute-value evaluations, from the materialized probabilities).
  const double scale = 1.0 / std::sqrt((double)D), u = std::ldexp(1.0, -24);
  auto at = [&](const VecF& v, int b, int t, int col) { return (double)v[(b * T + t) * W + col]; };
  auto od = [&](const VecF& v, int b, int t, int col) { return (double)v[(b * T + t) * NH * D + col]; };
  VecD m_out(out_m.size(), 0.0), m_grad(qkv.size(), 0.0);
  double smax = 0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      const int qc = h * D, kc = (NH + h / G) * D, vc = (NH + NKV + h / G) * D;
      for (int t = 0; t < T; ++t) {
        double doo = 0;  // |dO_t| . |o_t|
        for (int i = 0; i < D; ++i) doo += std::fabs(od(dout, b, t, qc + i) * od(out_m, b, t, qc + i));
        for (int s = 0; s <= t; ++s) {
          const double p = att[((b * NH + h) * T + t) * T + s];
          double qk = 0, dov = 0;  // |q_t| . |k_s|, |dO_t| . |v_s|
          for (int i = 0; i < D; ++i) {
            qk += std::fabs(at(qkv, b, t, qc + i) * at(qkv, b, s, kc + i));
            dov += std::fabs(od(dout, b, t, qc + i) * at(qkv, b, s, vc + i));
          }
          smax = std::max(smax, scale * qk);
          const double ds = scale * p * (dov + doo);
          for (int i = 0; i < D; ++i) {
            m_out[(b * T + t) * NH * D + qc + i] += p * std::fabs(at(qkv, b, s, vc + i));
            m_grad[(b * T + t) * W + qc + i] += ds * std::fabs(at(qkv, b, s, kc + i));
            m_grad[(b * T + s) * W + kc + i] += ds * std::fabs(at(qkv, b, t, qc + i));
            m_grad[(b * T + s) * W + vc + i] += p * std::fabs(od(dout, b, t, qc + i));
          }
        }
      }
    }
  const double n_out = D * smax + 2 * T + 4, n_grad = D * smax + (2 + G) * T + 2 * D + 8;
  auto check = [&](const VecF& a, const VecF& b, const VecD& m, double n, const char* what) {
    int bad = 0;
    double worst = 0;  // largest |a - b| / tolerance, reported to show the margin
    for (size_t i = 0; i < a.size(); ++i) {
      const double tol = 2 * u * n * m[i], diff = std::fabs((double)a[i] - b[i]);
      worst = std::max(worst, diff / (tol + 1e-300));
      if (!(diff <= tol) && bad++ < 5)
        ADD_FAILURE() << what << "[" << i << "]: fused " << a[i] << ", materialized " << b[i] << " (tol " << tol << ")";
    }
    EXPECT_EQ(bad, 0) << what;
    RecordProperty(what, testing::PrintToString(worst));
  };
  check(out_f, out_m, m_out, n_out, "out");
  check(dqkv_f, dqkv_m, m_grad, n_grad, "dqkv");
}

// The fused attention's shape errors say which tensor is wrong and what it should be.
TEST(Ops, AttentionFusedShapeErrorsNameTheProblem) {
  VecF a(64, 0.0f), b(64, 0.0f), c(64, 0.0f), d(64, 0.0f), e(64, 0.0f);
  // Valid: qkv [1, 2, 12] with NH = NKV = 2 (D = 2), out [1, 2, 4], lse [1, 2, 2].
  const struct {
    std::function<void()> fn;
    const char* says;
  } cases[] = {
      {[&] { attention_fused_forward(tf(a, {1, 2, 4}), tf(b, {1, 2, 3}), tf(c, {1, 2, 12}), 2, 2); },
       "attention_fused_forward: lse ([B, NH, T]) has 6 elements"},
      {[&] { attention_fused_forward(tf(a, {1, 2, 3}), tf(b, {1, 2, 2}), tf(c, {1, 2, 12}), 2, 2); },
       "attention_fused_forward: out ([B, T, NH * D]) has 6 elements"},
      {[&] { attention_fused_forward(tf(a, {1, 2, 4}), tf(b, {1, 2, 2}), tf(c, {1, 2, 10}), 2, 2); },
       "qkv's last dim 10 is not a multiple of NH + 2 NKV = 6"},
      {[&] { attention_fused_forward(tf(a, {1, 2, 4}), tf(b, {1, 2, 2}), tf(c, {1, 2, 12}), 3, 2); },
       "n_head = 3 must be a positive multiple of n_kv_head = 2"},
      {[&] { attention_fused_forward(tf(a, {1, 2, 4}), tf(b, {1, 2, 2}), tf(c, {2, 12}), 2, 2); },
       "qkv must be 3-D"},
      {[&] {
         attention_fused_backward(tf(d, {1, 2, 12}), tf(e, {1, 2, 4}), tf(c, {1, 2, 12}), tf(a, {1, 2, 5}),
                                  tf(b, {1, 2, 2}), 2, 2);
       },
       "attention_fused_backward: out ([B, T, NH * D]) has 10 elements"},
      {[&] {
         attention_fused_backward(tf(d, {1, 2, 11}), tf(e, {1, 2, 4}), tf(c, {1, 2, 12}), tf(a, {1, 2, 4}),
                                  tf(b, {1, 2, 2}), 2, 2);
       },
       "attention_fused_backward: dqkv (must match qkv) has 22 elements"},
      {[&] {
         attention_fused_backward(tf(d, {1, 2, 12}), tf(e, {1, 2, 4}), tf(c, {1, 2, 12}), tf(a, {1, 2, 4}),
                                  tf(b, {1, 3}), 2, 2);
       },
       "attention_fused_backward: lse ([B, NH, T]) has 3 elements"},
  };
  for (const auto& cs : cases) {
    const std::string m = error_message(cs.fn);
    EXPECT_NE(m.find(cs.says), std::string::npos) << "message: " << m << "\nexpected it to contain: " << cs.says;
  }
}

// ---- attention parts (context parallelism's pieces) -----------------------------------------

namespace {

bool in_rows(AttentionRows r, int64_t t) { return t >= r.first && t < r.first + r.count; }
bool same_bits(const VecF& a, const VecF& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// lse against its reference: -inf exactly where the reference has it (rows that see no key),
// the rest within the tolerance.
void expect_close_lse(VecF got, VecD ref, const char* what) {
  for (size_t i = 0; i < ref.size(); ++i)
    if (ref[i] == -INFINITY) {
      ASSERT_EQ(got[i], -INFINITY) << what << "[" << i << "]";
      got[i] = 0, ref[i] = 0;
    }
  expect_close(got, ref, what);
}

// Context parallelism without the communication: T tokens in 2 cp chunks of c, rank r
// holding chunks r and 2cp-1-r (in that order in a local buffer of 2c rows), the key/value
// buffers going round the ring: at step s rank r holds rank (r - s)'s. Every rank runs
// every (its chunk, held chunk) part, forward then backward, and the results are put
// together as [B, T, ...] buffers. local = false runs the same calls in place in [B, T, ...]
// buffers (dqkv_q and dqkv_kv one tensor).
struct RingResult {
  VecF out, lse, dqkv;
};
RingResult ring_attention(const Heads& h, int T, int cp, VecF qkv, VecF dout, bool local) {
  const int B = h.B, NH = h.NH, W = (NH + 2 * h.NKV) * h.D, OW = NH * h.D, c = T / (2 * cp), Tl = local ? 2 * c : T;
  auto chunk = [&](int r, int j) { return j == 0 ? r : 2 * cp - 1 - r; };
  auto rows = [&](int r, int j) { return AttentionRows{local ? j * c : chunk(r, j) * c, c, chunk(r, j) * c}; };
  // columns [col0, col1) of [N, T, width] <-> rank r's [N, 2c, width] (lse: N = B NH, width 1)
  auto copy_rows = [&](VecF& global, VecF& part, int N, int width, int r, bool to_part, int col0, int col1) {
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < 2; ++j)
        for (int i = 0; i < c; ++i) {
          float* g = &global[((int64_t)n * T + chunk(r, j) * c + i) * width];
          float* p = &part[((int64_t)n * Tl + j * c + i) * width];
          if (to_part) std::copy(g + col0, g + col1, p + col0);
          else std::copy(p + col0, p + col1, g + col0);
        }
  };
  const int n = local ? cp : 1;
  std::vector<VecF> q(n, VecF(B * Tl * W)), dO(n, VecF(B * Tl * OW)), o(n, VecF(B * Tl * OW, kNaN)),
      l(n, VecF(B * NH * Tl, kNaN)), dq(n, VecF(B * Tl * W, 0.0f)), dkv(n, VecF(B * Tl * W, 0.0f));
  if (!local) q[0] = qkv, dO[0] = dout;
  for (int r = 0; r < cp && local; ++r)
    copy_rows(qkv, q[r], B, W, r, true, 0, W), copy_rows(dout, dO[r], B, OW, r, true, 0, OW);
  auto at = [&](int r) { return local ? r : 0; };
  auto dkv_of = [&](int r) -> VecF& { return local ? dkv[r] : dq[0]; };
  for (bool backward : {false, true})
    for (int r = 0; r < cp; ++r)
      for (int s = 0; s < cp; ++s) {
        const int src = (r - s + cp) % cp, a = at(r), b = at(src);
        for (int jk : {1, 0})  // at s = 0 chunk r meets chunk 2cp-1-r first: no key visible
          for (int jq : {0, 1}) {
            if (!backward)
              attention_part_forward(tf(o[a], {B, Tl, OW}), tf(l[a], {B, NH, Tl}), tf(q[a], {B, Tl, W}), rows(r, jq),
                                     tf(q[b], {B, Tl, W}), rows(src, jk), NH, h.NKV, !(s == 0 && jk == 1));
            else
              attention_part_backward(tf(dq[a], {B, Tl, W}), tf(dkv_of(src), {B, Tl, W}), tf(dO[a], {B, Tl, OW}),
                                      tf(q[a], {B, Tl, W}), tf(o[a], {B, Tl, OW}), tf(l[a], {B, NH, Tl}), rows(r, jq),
                                      tf(q[b], {B, Tl, W}), rows(src, jk), NH, h.NKV);
          }
      }
  if (!local) return {o[0], l[0], dq[0]};
  RingResult res{VecF(B * T * OW), VecF(B * NH * T), VecF(B * T * W)};
  for (int r = 0; r < cp; ++r) {
    copy_rows(res.out, o[r], B, OW, r, false, 0, OW), copy_rows(res.lse, l[r], B * NH, 1, r, false, 0, 1);
    copy_rows(res.dqkv, dq[r], B, W, r, false, 0, OW), copy_rows(res.dqkv, dkv[r], B, W, r, false, OW, W);
  }
  return res;
}

}  // namespace

// The CPU's fused attention reads fp32 only: attention_fused_reads_16bit is false for a
// 16-bit qkv there, even under the matching scope (the model then hands it fp32), and the ops
// refuse a 16-bit qkv with a message naming f32.
TEST(Ops, AttentionFusedReadsSixteenBitsOnlyOnTheGpu) {
  std::vector<uint16_t> q16(12, 0);
  VecF a(4, 0.0f), b(4, 0.0f), c(12, 0.0f);
  const Tensor qkv16 = Tensor::wrap(q16.data(), {1, 1, 12}, DType::bf16);
  Autocast scope(DType::bf16);
  EXPECT_FALSE(attention_fused_reads_16bit(qkv16, 2, 2));
  EXPECT_FALSE(attention_fused_reads_16bit(tf(c, {1, 1, 12}), 2, 2));
  try {
    attention_fused_forward(tf(a, {1, 1, 4}), tf(b, {1, 2, 1}), qkv16, 2, 2);
    ADD_FAILURE() << "a bf16 qkv on the CPU was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
  }
}

// Single parts against the float64 reference, in every geometry: the diagonal (off = 0)
// away from the buffers' first rows, all keys visible, none, and partial overlaps either
// way (rows that see some keys, rows that see none); tiny, and crossing the kernel's 64-row
// and 256-key blocks; D = 16 in place, other D through padded copies. Forward writes rows q
// and nothing else, and merged onto rows with lse = -inf (out NaN) gives the part's bits,
// leaving rows that see no key as they were. Backward adds into the query columns of rows
// q and the key/value columns of rows k only (every other element keeps its bits); its
// gradient is checked against the float64 reference's (analytic), and on the small cases
// against central differences of the reference forward. Tolerances as elsewhere in this
// file.
TEST(Ops, AttentionPart) {
  std::mt19937 g(29);
  struct Case {
    Heads h;
    int Tq;
    AttentionRows q;
    int Tk;  // 0: qkv_kv (and dqkv_kv) is qkv_q (dqkv_q)
    AttentionRows k;
  };
  const Case cases[] = {
      {{2, 4, 2, 5}, 6, {2, 2, 10}, 5, {1, 2, 10}},              // a 2-row diagonal
      {{2, 4, 2, 5}, 4, {0, 3, 20}, 5, {1, 4, 5}},               // all keys visible
      {{2, 4, 2, 5}, 4, {1, 3, 0}, 5, {0, 4, 3}},                // no key visible
      {{1, 4, 1, 5}, 7, {1, 6, 4}, 5, {0, 5, 2}},                // off = 2: the first rows see some keys
      {{1, 4, 4, 3}, 6, {0, 6, 0}, 5, {0, 5, 3}},                // off = -3: the first 3 rows see none
      {{1, 4, 2, 8}, 40, {20, 20, 20}, 0, {0, 30, 0}},           // one buffer, overlapping rows
      {{1, 4, 2, 16}, 80, {5, 70, 300}, 310, {2, 300, 20}},      // off = 280: two key blocks, D in place
      {{1, 4, 2, 8}, 70, {0, 70, 30}, 200, {0, 200, 0}},         // off = 30: keys 100.. seen by none
      {{2, 2, 1, 8}, 130, {0, 130, 100}, 300, {0, 300, 150}}};   // off = -50 inside the first query block
  for (const Case& cs : cases) {
    const Heads& h = cs.h;
    const int B = h.B, NH = h.NH, NKV = h.NKV, W = (NH + 2 * NKV) * h.D, OW = NH * h.D, Tq = cs.Tq;
    const bool one = cs.Tk == 0;
    const int Tk = one ? Tq : cs.Tk;
    SCOPED_TRACE(testing::Message() << "B=" << B << " NKV=" << NKV << " D=" << h.D << " q={" << cs.q.first << ", "
                                    << cs.q.count << ", " << cs.q.position << "} of " << Tq << ", k={" << cs.k.first
                                    << ", " << cs.k.count << ", " << cs.k.position << "} of " << Tk);
    VecF qkvq = randv(B * Tq * W, g, -2, 2), qkvk_own = randv(one ? 0 : B * Tk * W, g, -2, 2);
    VecF R = randv(B * Tq * OW, g);
    VecF& qkvk = one ? qkvq : qkvk_own;
    auto fwd = [&](VecF& out, VecF& lse, bool merge) {
      attention_part_forward(tf(out, {B, Tq, OW}), tf(lse, {B, NH, Tq}), tf(qkvq, {B, Tq, W}), cs.q,
                             tf(qkvk, {B, Tk, W}), cs.k, NH, NKV, merge);
    };
    VecF out(B * Tq * OW, kNaN), lse(B * NH * Tq, kNaN), out_m(out.size(), kNaN), lse_m(lse.size(), -INFINITY);
    fwd(out, lse, false);
    fwd(out_m, lse_m, true);
    const VecD Rd = to_d(R), qd = to_d(qkvq), kd = to_d(qkvk);
    VecD outd(out.size(), 0.0), lsed(lse.size(), 0.0), dqd(qkvq.size(), 0.0), dkvd_own(qkvk_own.size(), 0.0);
    VecD& dkvd = one ? dqd : dkvd_own;
    part_ref(h, qd, Tq, cs.q, kd, Tk, cs.k, outd, lsed, &Rd, &dqd, &dkvd);
    VecF out_c = out, lse_c = lse;  // rows outside q: untouched (NaN), compared as 0
    for (size_t i = 0; i < out.size(); ++i) {
      const int64_t b = i / OW / Tq, t = i / OW % Tq, head = i % OW / h.D;
      const bool row = in_rows(cs.q, t), seen = row && lse[(b * NH + head) * Tq + t] > -INFINITY;
      ASSERT_EQ(row, !std::isnan(out[i])) << "out[" << i << "]";
      EXPECT_TRUE(seen ? out_m[i] == out[i] : std::isnan(out_m[i])) << "out merged onto lse = -inf [" << i << "]";
      if (!row) out_c[i] = 0.0f;
    }
    for (size_t i = 0; i < lse.size(); ++i) {
      ASSERT_EQ(in_rows(cs.q, i % Tq), !std::isnan(lse[i])) << "lse[" << i << "]";
      EXPECT_EQ(lse_m[i], in_rows(cs.q, i % Tq) ? lse[i] : -INFINITY) << "lse merged onto -inf [" << i << "]";
      if (!in_rows(cs.q, i % Tq)) lse_c[i] = 0.0f;
    }
    expect_close(out_c, outd, "out");
    expect_close_lse(lse_c, lsed, "lse");

    const float bq = 0.25f, bkv = one ? bq : -0.5f;  // what the gradients hold before
    VecF dq(qkvq.size(), bq), dkv_own(qkvk_own.size(), bkv);
    VecF& dkv = one ? dq : dkv_own;
    attention_part_backward(tf(dq, {B, Tq, W}), tf(dkv, {B, Tk, W}), tf(R, {B, Tq, OW}), tf(qkvq, {B, Tq, W}),
                            tf(out, {B, Tq, OW}), tf(lse, {B, NH, Tq}), cs.q, tf(qkvk, {B, Tk, W}), cs.k, NH, NKV);
    auto untouched = [&](const VecF& d, float base, int T, bool q_part, bool kv_part) {
      for (size_t i = 0; i < d.size(); ++i) {
        const int64_t row = i / W % T, col = i % W;
        const bool written = (q_part && col < OW && in_rows(cs.q, row)) || (kv_part && col >= OW && in_rows(cs.k, row));
        if (!written) ASSERT_EQ(d[i], base) << "element " << i << " (row " << row << ", column " << col << ")";
      }
    };
    untouched(dq, bq, Tq, true, one);
    if (!one) untouched(dkv, bkv, Tk, false, true);
    expect_close(dq, dqd, "dqkv_q", {}, bq);
    if (!one) expect_close(dkv, dkvd, "dqkv_kv", {}, bkv);
    if ((int64_t)cs.q.count * cs.k.count > 600) continue;
    auto L = [&](const VecD& a, const VecD& b) {
      VecD o(out.size()), l(lse.size());
      part_ref(h, a, Tq, cs.q, one ? a : b, Tk, cs.k, o, l);
      return dot(o, Rd);
    };
    expect_close(dq, fd_grad([&](const VecD& v) { return L(v, kd); }, qd), "dqkv_q (finite differences)", {}, bq);
    if (!one)
      expect_close(dkv, fd_grad([&](const VecD& v) { return L(qd, v); }, kd), "dqkv_kv (finite differences)", {}, bkv);
  }
}

// The ring (ring_attention) for cp = 1, 2 and 4, against the float64 reference of the
// whole sequence and against the fused kernel. T = 16 makes chunks of 8, 4 and 2 rows;
// T = 600 of 300, 150 and 75 (they cross the 64-row and 256-key blocks), T = 200 of 100,
// 50, 25. Tolerances as elsewhere in this file (rtol 1e-4, atol 1e-5 of the largest):
// float32 results with a unit roundoff of 6e-8 and sums of at most T terms; the parts sum
// in another order than the fused kernel, and each merge adds a few roundings (an exp, a
// log1p, two products) for at most 2 cp = 8 parts per row, so the results differ from both
// by some 1e-6 relative, while a wrong mask or merge is off by O(1) (measured: at most 2%
// of the tolerance, errors up to 4e-7 of the largest element, as the fused kernel's own
// against float64). Also: the same calls on local (rank) buffers and in place on
// whole-sequence ones give the same bits, so do 1, 2 and 3 threads, and at T = 16 the
// gradient matches central differences.
TEST(Ops, AttentionPartRing) {
  std::mt19937 g(31);
  for (auto [h, T] : {std::pair{Heads{2, 4, 2, 5}, 16}, {Heads{1, 4, 1, 16}, 600}, {Heads{2, 6, 3, 12}, 200}}) {
    const int B = h.B, NH = h.NH, NKV = h.NKV, W = (NH + 2 * NKV) * h.D, OW = NH * h.D;
    VecF qkv = randv(B * T * W, g, -2, 2), dout = randv(B * T * OW, g);
    const VecD qd = to_d(qkv), doutd = to_d(dout);
    VecD outd(B * T * OW), lsed(B * NH * T), dqkvd(qkv.size(), 0.0);
    const AttentionRows all{0, T, 0};
    part_ref(h, qd, T, all, qd, T, all, outd, lsed, &doutd, &dqkvd, &dqkvd);
    VecF out_f(B * T * OW), lse_f(B * NH * T), dqkv_f(qkv.size());
    attention_fused_forward(tf(out_f, {B, T, OW}), tf(lse_f, {B, NH, T}), tf(qkv, {B, T, W}), NH, NKV);
    attention_fused_backward(tf(dqkv_f, {B, T, W}), tf(dout, {B, T, OW}), tf(qkv, {B, T, W}), tf(out_f, {B, T, OW}),
                             tf(lse_f, {B, NH, T}), NH, NKV);
    for (int cp : {1, 2, 4}) {
      SCOPED_TRACE(testing::Message() << "T=" << T << " cp=" << cp << " D=" << h.D << " NKV=" << NKV);
      const RingResult r = ring_attention(h, T, cp, qkv, dout, true), rg = ring_attention(h, T, cp, qkv, dout, false);
      expect_close(r.out, outd, "out");
      expect_close(r.lse, lsed, "lse");
      expect_close(r.dqkv, dqkvd, "dqkv");
      expect_close(r.out, to_d(out_f), "out (vs fused)");
      expect_close(r.lse, to_d(lse_f), "lse (vs fused)");
      expect_close(r.dqkv, to_d(dqkv_f), "dqkv (vs fused)");
      EXPECT_TRUE(same_bits(r.out, rg.out) && same_bits(r.lse, rg.lse) && same_bits(r.dqkv, rg.dqkv))
          << "local and whole-sequence buffers give different bits";
      auto L = [&](const VecD& v) { return dot(attention_ref(v, B, T, NH, NKV, h.D), doutd); };
      if (T == 16) expect_close(r.dqkv, fd_grad(L, qd), "dqkv (finite differences)");
      if (T == 200 && cp == 2)
        expect_thread_invariant([&] {
          const RingResult t = ring_attention(h, T, cp, qkv, dout, true);
          return std::vector<VecF>{t.out, t.lse, t.dqkv};
        }, "attention parts");
    }
  }
}

// The whole sequence is the part of all rows against all rows, and the fused functions run
// exactly that: a part call with q = k = {first, T, P} gives the fused kernel's bits, for
// any position P (only q.position - k.position matters) and rows anywhere in a longer
// buffer; its backward added into zeros gives the fused backward's bits.
TEST(Ops, AttentionPartWholeSequenceIsFused) {
  std::mt19937 g(37);
  struct Case { int B, T, NH, NKV, D; };
  for (Case cs : {Case{1, 1, 4, 4, 8}, {2, 5, 4, 1, 5}, {2, 13, 4, 2, 4}, {1, 67, 4, 4, 3}, {1, 70, 4, 2, 16},
                  {1, 300, 4, 1, 4}, {2, 300, 4, 2, 64}}) {
    const int B = cs.B, T = cs.T, NH = cs.NH, W = (NH + 2 * cs.NKV) * cs.D, OW = NH * cs.D, first = 2, Tb = T + 3;
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " NKV=" << cs.NKV << " D=" << cs.D);
    VecF qkv = randv(B * T * W, g, -2, 2), dout = randv(B * T * OW, g);
    VecF out_f(B * T * OW), lse_f(B * NH * T), dqkv_f(qkv.size());
    attention_fused_forward(tf(out_f, {B, T, OW}), tf(lse_f, {B, NH, T}), tf(qkv, {B, T, W}), NH, cs.NKV);
    attention_fused_backward(tf(dqkv_f, {B, T, W}), tf(dout, {B, T, OW}), tf(qkv, {B, T, W}), tf(out_f, {B, T, OW}),
                             tf(lse_f, {B, NH, T}), NH, cs.NKV);
    // [N, T, width] placed at rows first.. of [N, Tb, width], and back.
    auto place = [&](const VecF& x, int N, int width) {
      VecF y(N * Tb * width, 0.0f);
      for (int n = 0; n < N; ++n)
        std::copy_n(&x[n * T * width], T * width, &y[(n * Tb + first) * width]);
      return y;
    };
    auto take = [&](const VecF& y, int N, int width) {
      VecF x(N * T * width);
      for (int n = 0; n < N; ++n) std::copy_n(&y[(n * Tb + first) * width], T * width, &x[n * T * width]);
      return x;
    };
    for (auto [rows, Tbuf] : {std::pair{AttentionRows{0, T, 0}, T}, {AttentionRows{first, T, 1000}, Tb}}) {
      const bool placed = Tbuf != T;
      VecF q = placed ? place(qkv, B, W) : qkv, dO = placed ? place(dout, B, OW) : dout;
      VecF out(B * Tbuf * OW), lse(B * NH * Tbuf), dqkv(q.size(), 0.0f);
      attention_part_forward(tf(out, {B, Tbuf, OW}), tf(lse, {B, NH, Tbuf}), tf(q, {B, Tbuf, W}), rows,
                             tf(q, {B, Tbuf, W}), rows, NH, cs.NKV, false);
      attention_part_backward(tf(dqkv, {B, Tbuf, W}), tf(dqkv, {B, Tbuf, W}), tf(dO, {B, Tbuf, OW}),
                              tf(q, {B, Tbuf, W}), tf(out, {B, Tbuf, OW}), tf(lse, {B, NH, Tbuf}), rows,
                              tf(q, {B, Tbuf, W}), rows, NH, cs.NKV);
      EXPECT_TRUE(same_bits(placed ? take(out, B, OW) : out, out_f)) << "out, rows at " << rows.first;
      EXPECT_TRUE(same_bits(placed ? take(lse, B * NH, 1) : lse, lse_f)) << "lse, rows at " << rows.first;
      EXPECT_TRUE(same_bits(placed ? take(dqkv, B, W) : dqkv, dqkv_f)) << "dqkv, rows at " << rows.first;
    }
  }
}

// A key/value cache's attention (attention_kv_forward) is the part of the new query rows
// against the rows held, with the keys and values apart from the queries: the same bits as
// attention_part_forward over fused rows, for grouped-query heads, head dims that are not
// whole vectors, one or several new rows. The held buffer's rows past the part are NaN, so
// reading one shows. A kv of the fused width is refused, naming the shape it wants.
TEST(Ops, AttentionKvIsThePartWithKeysAndValuesApart) {
  std::mt19937 g(41);
  struct Case { int B, T, n, NH, NKV, D; };
  for (Case cs : {Case{1, 1, 1, 2, 2, 4}, {2, 9, 1, 4, 1, 5}, {2, 13, 4, 4, 2, 16}, {1, 70, 3, 4, 4, 3}}) {
    const int B = cs.B, T = cs.T, n = cs.n, NH = cs.NH, W = (NH + 2 * cs.NKV) * cs.D, KW = 2 * cs.NKV * cs.D;
    const int OW = NH * cs.D, Tcap = T + 5, held = T - n;  // new rows at positions held .. T - 1
    SCOPED_TRACE(testing::Message() << "B=" << B << " T=" << T << " n=" << n << " NKV=" << cs.NKV << " D=" << cs.D);
    const VecF qkv = randv(B * T * W, g, -2, 2);  // [B, T, W]: every row, fused
    VecF out_p(B * n * OW), lse_p(B * NH * n), qnew(B * n * W), kv(B * Tcap * KW, std::nanf(""));
    for (int b = 0; b < B; ++b) {
      std::copy_n(&qkv[(b * T + held) * W], n * W, &qnew[b * n * W]);
      for (int t = 0; t < T; ++t) std::copy_n(&qkv[(b * T + t) * W + NH * cs.D], KW, &kv[(b * Tcap + t) * KW]);
    }
    VecF q_in = qnew, all = qkv;
    attention_part_forward(tf(out_p, {B, n, OW}), tf(lse_p, {B, NH, n}), tf(q_in, {B, n, W}), {0, n, held},
                           tf(all, {B, T, W}), {0, T, 0}, NH, cs.NKV, false);
    VecF out(B * n * OW), lse(B * NH * n);
    attention_kv_forward(tf(out, {B, n, OW}), tf(lse, {B, NH, n}), tf(q_in, {B, n, W}), {0, n, held},
                         tf(kv, {B, Tcap, KW}), {0, T, 0}, NH, cs.NKV);
    EXPECT_TRUE(same_bits(out, out_p)) << "out";
    EXPECT_TRUE(same_bits(lse, lse_p)) << "lse";
    const std::string m = error_message([&] {
      attention_kv_forward(tf(out, {B, n, OW}), tf(lse, {B, NH, n}), tf(q_in, {B, n, W}), {0, n, held},
                           tf(all, {B, T, W}), {0, T, 0}, NH, cs.NKV);
    });
    const std::string says = "attention_kv_forward: qkv_kv has shape [" + std::to_string(B) + ", " +
                             std::to_string(T) + ", " + std::to_string(W) + "], expected [B, Tk, 2 NKV D] = [" +
                             std::to_string(B) + ", Tk, " + std::to_string(KW) + "]";
    EXPECT_NE(m.find(says), std::string::npos) << m;
  }
}

// A part call's errors say which argument is wrong and what it should be.
TEST(Ops, AttentionPartShapeErrorsNameTheProblem) {
  VecF a(128, 0.0f), b(128, 0.0f), c(128, 0.0f), d(128, 0.0f), e(128, 0.0f), f(128, 0.0f);
  // Valid: qkv_q [1, 4, 12], qkv_kv [1, 3, 12] (NH = NKV = 2, D = 2), out [1, 4, 4], lse [1, 2, 4].
  const AttentionRows q{0, 4, 3}, k{0, 3, 0};
  auto fwd = [&](AttentionRows qr, AttentionRows kr, const Shape& kv, const Shape& out, const Shape& lse) {
    return [=, &a, &b, &c, &d] {
      attention_part_forward(tf(a, out), tf(b, lse), tf(c, {1, 4, 12}), qr, tf(d, kv), kr, 2, 2, true);
    };
  };
  auto bwd = [&](AttentionRows qr, AttentionRows kr, const Shape& dkv, const Shape& dout) {
    return [=, &a, &b, &c, &d, &e, &f] {
      attention_part_backward(tf(e, {1, 4, 12}), tf(f, dkv), tf(a, dout), tf(c, {1, 4, 12}), tf(a, {1, 4, 4}),
                              tf(b, {1, 2, 4}), qr, tf(d, {1, 3, 12}), kr, 2, 2);
    };
  };
  const Shape kv{1, 3, 12}, out{1, 4, 4}, lse{1, 2, 4};
  const struct {
    std::function<void()> fn;
    const char* says;
  } cases[] = {
      {fwd({1, 4, 0}, k, kv, out, lse), "attention_part_forward: q rows [1, 5) are not inside the 4 rows of qkv_q"},
      {fwd({0, -1, 0}, k, kv, out, lse), "attention_part_forward: q rows [0, -1) are not inside"},
      {fwd(q, {2, 2, 0}, kv, out, lse), "attention_part_forward: k rows [2, 4) are not inside the 3 rows of qkv_kv"},
      {fwd(q, {-1, 2, 0}, kv, out, lse), "attention_part_forward: k rows [-1, 1) are not inside"},
      {fwd({0, 4, -2}, k, kv, out, lse), "attention_part_forward: q rows at position -2, expected >= 0"},
      {fwd(q, k, {1, 3, 18}, out, lse),
       "attention_part_forward: qkv_kv has shape [1, 3, 18], expected [B, Tk, W] = [1, Tk, 12] like qkv_q [1, 4, 12]"},
      {fwd(q, k, {2, 3, 12}, out, lse), "qkv_kv has shape [2, 3, 12], expected [B, Tk, W] = [1, Tk, 12]"},
      {fwd(q, k, kv, {1, 3, 4}, lse), "attention_part_forward: out ([B, Tq, NH * D], Tq = qkv_q's rows) has 12"},
      {fwd(q, k, kv, out, {1, 2, 3}), "attention_part_forward: lse ([B, NH, Tq]) has 6 elements"},
      {bwd({3, 2, 0}, k, kv, out), "attention_part_backward: q rows [3, 5) are not inside the 4 rows of qkv_q"},
      {bwd(q, k, {1, 4, 12}, out), "attention_part_backward: dqkv_kv (must match qkv_kv) has 48 elements"},
      {bwd(q, k, kv, {1, 4, 5}), "attention_part_backward: dout ([B, Tq, NH * D]) has 20 elements"},
  };
  for (const auto& cs : cases) {
    const std::string m = error_message(cs.fn);
    EXPECT_NE(m.find(cs.says), std::string::npos) << "message: " << m << "\nexpected it to contain: " << cs.says;
  }
  fwd(q, k, kv, out, lse)();  // and the valid call runs
}
