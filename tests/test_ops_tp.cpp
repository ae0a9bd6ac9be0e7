// The ops tensor parallelism adds, in the op harness (tests/op_harness.h: float64
// references, finite differences, the same tolerances as tests/test_ops.cpp): linear layers
// with weights stored [in, out], the vocabulary-parallel embedding and loss (shards that
// combine to the whole op, padding that never counts), learned positions added on their
// own, and a bias added after a reduction.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "core/error.h"
#include "op_harness.h"
#include "ops/activation.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"

using namespace mt;
using namespace mt::test;

namespace {

// w[O, I] (the reference's layout) from w_io[I, O].
VecD transpose(const VecF& w_io, int I, int O) {
  VecD w(O * I);
  for (int i = 0; i < I; ++i)
    for (int o = 0; o < O; ++o) w[o * I + i] = w_io[i * O + o];
  return w;
}

TEST(OpsTp, LinearStoredInOut) {
  std::mt19937 g(21);
  for (auto [N, I, O] : {std::array{1, 5, 3}, {7, 17, 33}, {33, 64, 5}})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(testing::Message() << "N=" << N << " I=" << I << " O=" << O << " bias=" << bias);
      VecF x = randv(N * I, g), w = randv(I * O, g), b = randv(O, g), R = randv(N * O, g), y(N * O, kNaN);
      Tensor bt = tf(b, {O});
      linear_io_forward(tf(y, {N, O}), tf(x, {N, I}), tf(w, {I, O}), bias ? &bt : nullptr);
      VecD bd = to_d(b);
      expect_close(y, linear_ref(to_d(x), transpose(w, I, O), bias ? &bd : nullptr, N, I, O), "y");
      VecF dx(N * I, kNaN), dxa(N * I, 0.5f), dw(I * O, 0.25f), db(O, -0.5f);
      linear_io_backward_input(tf(dx, {N, I}), tf(R, {N, O}), tf(w, {I, O}), false);
      linear_io_backward_input(tf(dxa, {N, I}), tf(R, {N, O}), tf(w, {I, O}), true);
      Tensor dbt = tf(db, {O});
      linear_io_backward_weight(tf(dw, {I, O}), bias ? &dbt : nullptr, tf(R, {N, O}), tf(x, {N, I}));
      const VecD Rd = to_d(R);
      // L as a function of w stored [in, out]
      auto L = [&](const VecD& xx, const VecD& w_io, const VecD& bb) {
        VecD w_oi(O * I);
        for (int i = 0; i < I; ++i)
          for (int o = 0; o < O; ++o) w_oi[o * I + i] = w_io[i * O + o];
        return dot(linear_ref(xx, w_oi, bias ? &bb : nullptr, N, I, O), Rd);
      };
      expect_close(dx, fd_grad([&](const VecD& v) { return L(v, to_d(w), bd); }, to_d(x)), "dx");
      expect_close(dxa, fd_grad([&](const VecD& v) { return L(v, to_d(w), bd); }, to_d(x)), "dx (accumulate)", {},
                   0.5);
      expect_close(dw, fd_grad([&](const VecD& v) { return L(to_d(x), v, bd); }, to_d(w)), "dw", {}, 0.25);
      if (bias) expect_close(db, fd_grad([&](const VecD& v) { return L(to_d(x), to_d(w), v); }, bd), "db", {}, -0.5);
    }
}

TEST(OpsTp, AddBiasAndItsBackward) {
  std::mt19937 g(22);
  const int N = 7, O = 13;
  VecF y = randv(N * O, g), b = randv(O, g);
  VecD want(N * O);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < O; ++o) want[n * O + o] = double(y[n * O + o]) + b[o];
  add_bias(tf(y, {N, O}), tf(b, {O}));
  expect_close(y, want, "y + b");
  // its backward alone: db += column sums of dy
  VecF dy = randv(N * O, g), db(O, 0.5f);
  bias_backward(tf(db, {O}), tf(dy, {N, O}));
  VecD want_db(O);
  for (int o = 0; o < O; ++o)
    for (int n = 0; n < N; ++n) want_db[o] += dy[n * O + o];
  expect_close(db, want_db, "db", {}, 0.5);
}

// The vocabulary split into `parts` shards of ceil(V / parts) rows (padded): the sum over
// shards of each lookup is the whole lookup (bit for bit: one shard holds each id), and each
// shard's gradient rows are the whole gradient's.
TEST(OpsTp, EmbeddingShardsMakeTheWholeLookup) {
  std::mt19937 g(23);
  const int B = 3, T = 5, C = 8, V = 37;
  VecF wte = randv(V * C, g), dout = randv(B * T * C, g);
  std::vector<int32_t> tok(B * T);
  for (auto& t : tok) t = std::uniform_int_distribution<int>(0, V - 1)(g);
  tok[0] = V - 1, tok[1] = 0;
  VecF whole(B * T * C, kNaN), dwhole(V * C, 0.0f);
  embedding_forward(tf(whole, {B, T, C}), ti(tok, {B, T}), tf(wte, {V, C}), nullptr);
  embedding_backward(tf(dwhole, {V, C}), nullptr, tf(dout, {B, T, C}), ti(tok, {B, T}));
  for (int parts : {2, 4}) {
    const int rows = (V + parts - 1) / parts;
    VecF sum(B * T * C, 0.0f);
    for (int r = 0; r < parts; ++r) {
      const int begin = std::min(V, r * rows), valid = std::min(V, (r + 1) * rows) - begin;
      VecF shard(rows * C, 99.0f);  // padding rows hold garbage: never read
      std::copy(wte.begin() + begin * C, wte.begin() + (begin + valid) * C, shard.begin());
      VecF out(B * T * C, kNaN), dshard(rows * C, 0.0f);
      embedding_shard_forward(tf(out, {B, T, C}), ti(tok, {B, T}), tf(shard, {rows, C}), begin, valid, V);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += out[i];
      embedding_shard_backward(tf(dshard, {rows, C}), tf(dout, {B, T, C}), ti(tok, {B, T}), begin, valid, V);
      for (int i = 0; i < valid * C; ++i) ASSERT_EQ(dshard[i], dwhole[begin * C + i]) << parts << " parts, shard " << r;
      for (int i = valid * C; i < rows * C; ++i) ASSERT_EQ(dshard[i], 0.0f) << "padding row gradient";
    }
    EXPECT_EQ(0, std::memcmp(sum.data(), whole.data(), sum.size() * sizeof(float))) << parts << " parts";
  }
  std::vector<int32_t> bad = tok;
  bad[2] = V;
  VecF out(B * T * C), shard(10 * C);
  EXPECT_THROW(embedding_shard_forward(tf(out, {B, T, C}), ti(bad, {B, T}), tf(shard, {10, C}), 0, 10, V), Error);
}

TEST(OpsTp, PositionEmbedding) {
  std::mt19937 g(24);
  const int B = 3, T = 5, C = 8, maxT = 7;
  VecF x = randv(B * T * C, g), wpe = randv(maxT * C, g), R = randv(B * T * C, g), dwpe(maxT * C, 0.5f);
  VecD want(B * T * C);
  for (int i = 0; i < B * T * C; ++i) want[i] = double(x[i]) + wpe[(i / C % T) * C + i % C];
  position_forward(tf(x, {B, T, C}), tf(wpe, {maxT, C}));
  expect_close(x, want, "x + wpe");
  position_backward(tf(dwpe, {maxT, C}), tf(R, {B, T, C}));
  auto L = [&](const VecD& p) {
    double s = 0;
    for (int i = 0; i < B * T * C; ++i) s += p[(i / C % T) * C + i % C] * R[i];
    return s;
  };
  expect_close(dwpe, fd_grad(L, to_d(wpe)), "dwpe", {}, 0.5);
}

// Cross-entropy over column shards of the vocabulary, statistics combined as the tp
// reductions combine them (max, then sums), against the whole-vocabulary op and a float64
// reference; padding columns hold huge values that must never count.
TEST(OpsTp, CrossEntropyOverVocabularyShards) {
  std::mt19937 g(25);
  const int N = 9, V = 37;
  VecF logits = randv(N * V, g, -3, 3);
  for (int v = 0; v < V; ++v) logits[v] += 60.0f;  // a row far from 0
  std::vector<int32_t> tg(N);
  for (int n = 0; n < N; ++n) tg[n] = n % 4 == 3 ? -1 : std::uniform_int_distribution<int>(0, V - 1)(g);
  tg[0] = V - 1;
  VecD ref(N);
  for (int n = 0; n < N; ++n) {
    double m = -1e300, s = 0;
    for (int v = 0; v < V; ++v) m = std::max(m, double(logits[n * V + v]));
    for (int v = 0; v < V; ++v) s += std::exp(logits[n * V + v] - m);
    ref[n] = tg[n] < 0 ? 0.0 : m + std::log(s) - logits[n * V + tg[n]];
  }
  const float scale = 0.125f;
  for (int parts : {1, 2, 4}) {
    SCOPED_TRACE(testing::Message() << parts << " shards");
    const int cols = (V + parts - 1) / parts;
    std::vector<VecF> shard(parts, VecF(N * cols, 1e4f));  // padding: 1e4 would dominate any sum
    std::vector<int> begin(parts), valid(parts);
    for (int r = 0; r < parts; ++r) {
      begin[r] = std::min(V, r * cols), valid[r] = std::min(V, (r + 1) * cols) - begin[r];
      for (int n = 0; n < N; ++n)
        for (int c = 0; c < valid[r]; ++c) shard[r][n * cols + c] = logits[n * V + begin[r] + c];
    }
    VecF m(N, -INFINITY), s(N, 0.0f), t(N, 0.0f);
    for (int r = 0; r < parts; ++r) {
      VecF mr(N, kNaN);
      cross_entropy_row_max(tf(mr, {N}), tf(shard[r], {N, cols}), valid[r]);
      for (int n = 0; n < N; ++n) m[n] = std::max(m[n], mr[n]);
    }
    for (int r = 0; r < parts; ++r) {
      VecF sr(N, kNaN), tr(N, kNaN);
      cross_entropy_row_stats(tf(sr, {N}), tf(tr, {N}), tf(shard[r], {N, cols}), ti(tg, {N}), begin[r], valid[r],
                              tf(m, {N}));
      for (int n = 0; n < N; ++n) s[n] += sr[n], t[n] += tr[n];
    }
    VecF losses(N, kNaN), lse(N, kNaN);
    const double total = cross_entropy_finish(tf(losses, {N}), tf(lse, {N}), tf(m, {N}), tf(s, {N}), tf(t, {N}),
                                              ti(tg, {N}));
    expect_close(losses, ref, "losses");
    double ref_total = 0;
    for (double l : ref) ref_total += l;
    EXPECT_NEAR(total, ref_total, 1e-5 * ref_total);
    // backward: each shard's columns are the whole gradient's; padding gets zero
    VecF whole_lse(N), whole_losses(N), dwhole(N * V);
    cross_entropy_forward(tf(whole_losses, {N}), tf(whole_lse, {N}), tf(logits, {N, V}), ti(tg, {N}));
    cross_entropy_backward(tf(dwhole, {N, V}), tf(logits, {N, V}), tf(whole_lse, {N}), ti(tg, {N}), scale);
    for (int r = 0; r < parts; ++r) {
      VecF d(N * cols, kNaN);
      cross_entropy_backward_shard(tf(d, {N, cols}), tf(shard[r], {N, cols}), tf(lse, {N}), ti(tg, {N}), scale,
                                   begin[r], valid[r]);
      for (int n = 0; n < N; ++n) {
        for (int c = 0; c < valid[r]; ++c)
          ASSERT_NEAR(d[n * cols + c], dwhole[n * V + begin[r] + c], 1e-6f) << "row " << n << " column " << begin[r] + c;
        for (int c = valid[r]; c < cols; ++c) ASSERT_EQ(d[n * cols + c], 0.0f) << "padding column";
      }
    }
  }
}

}  // namespace
