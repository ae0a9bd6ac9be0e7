// Tensor parallelism at the model level, under mpirun: a model split over a tp group holds,
// element for element, the single-rank model's parameters (initialised by global index) and
// computes the same loss and gradients, for both families, grouped-query and multi-query
// heads, tied and untied heads, a vocabulary tp does not divide, and recomputation, with
// and without sequence parallelism. Run with 2 ranks (tp 2) and 4 (tp 4, and tp 2 twice
// side by side).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "comm/mesh.h"
#include "core/rng.h"
#include "mpi_main.h"
#include "nn/model.h"
#include "parallel/tensor.h"

using namespace mt;

namespace {

Communicator* g_world = nullptr;

struct Case {
  const char* name;
  ModelConfig model;
  Recompute recompute;
};

ModelConfig base(const char* family) {
  ModelConfig m;
  m.family = family;
  m.n_layer = 2, m.n_head = 4, m.d_model = 32, m.seq_len = 16;
  m.vocab_size = 37;  // 37 = 2 x 18 + 1 = 4 x 9 + 1: padded at tp 2 and 4
  return m;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"gpt2_tied", base("gpt2")});
  ModelConfig g = base("gpt2");
  g.tie_embeddings = 0, g.vocab_size = 40;
  c.push_back({"gpt2_untied_divisible_vocab", g});
  ModelConfig l = base("llama");
  l.n_kv_head = 2;
  c.push_back({"llama_gqa_kv2", l});
  l.n_kv_head = 1, l.tie_embeddings = 1;
  c.push_back({"llama_mqa_tied", l});
  ModelConfig r = base("llama");
  c.push_back({"llama_recompute", r, {Recompute::kAll}});
  c.push_back({"llama_recompute_first", r, {1}});  // the first of the 2 blocks
  ModelConfig m = base("gpt2");
  m.attention = "materialized";
  c.push_back({"gpt2_materialized_attention", m});
  return c;
}

// Loss and gradients of one forward/backward over fixed tokens.
struct Result {
  double loss = 0;
  std::vector<std::vector<float>> grads;  // per unit, local layout
};

// The greedy predictions of the last forward, and the logits over the whole vocabulary of
// a single-rank model (to judge a disagreement).
void expect_same_predictions(Model& whole, Model& part, int B, int T) {
  std::vector<int32_t> a(B * T), b(B * T);
  whole.predictions(a.data());
  part.predictions(b.data());
  const int64_t V = whole.config().vocab_size;
  const float* lg = whole.logits().f32();
  for (int i = 0; i < B * T; ++i) {
    if (a[i] == b[i]) continue;
    // only a near tie may differ: tp rounds the logits differently
    ASSERT_TRUE(b[i] >= 0 && b[i] < V) << "position " << i << ": prediction " << b[i];
    EXPECT_NEAR(lg[i * V + a[i]], lg[i * V + b[i]], 1e-5f) << "position " << i;
  }
}

Result run(Model& m, int B, int T) {
  const ModelConfig& c = m.config();
  std::vector<int32_t> tokens(B * T), targets(B * T);
  Philox rng{11};
  for (int i = 0; i < B * T; ++i) {
    tokens[i] = static_cast<int32_t>(rng.uniform(1, i) * c.vocab_size) % c.vocab_size;
    targets[i] = static_cast<int32_t>(rng.uniform(2, i) * c.vocab_size) % c.vocab_size;
  }
  targets[3] = -1;  // an ignored position
  targets[5] = c.vocab_size - 1;  // the last rank's last real vocabulary row
  m.zero_grad();
  Result r;
  r.loss = m.forward(tokens.data(), targets.data(), B, T);
  m.backward(1.0f / (B * T));
  for (const Unit& u : m.units()) r.grads.emplace_back(u.g.f32(), u.g.f32() + u.numel);
  return r;
}

// The tp group of this rank: consecutive world ranks, tp of them.
std::unique_ptr<Communicator> tp_group(int tp) {
  Communicator& w = *g_world;
  return w.split(w.rank() / tp, w.rank(), "tp");
}

void check_case(const Case& k, int tp, bool sp, int B) {
  SCOPED_TRACE(std::string(k.name) + " at tp " + std::to_string(tp) + (sp ? " with sequence parallelism" : "") +
               ", batch " + std::to_string(B));
  const int T = k.model.seq_len;
  CpuAllocator alloc;
  auto group = tp_group(tp);
  TensorParallel mappings(*group, alloc, sp);
  Model whole(k.model, alloc, B, k.recompute);
  Model part(k.model, alloc, B, k.recompute, true, &mappings);
  whole.init(7);
  part.init(7);

  // Parameters: every element this rank holds is the single-rank model's (bit for bit),
  // padding rows are zero.
  for (size_t u = 0; u < part.units().size(); ++u) {
    const Unit& pu = part.units()[u];
    const float* wp = whole.units()[u].w.f32();
    int64_t covered = 0;
    for (const UnitPiece& piece : pu.pieces()) {
      covered += piece.n;
      for (int64_t i = 0; i < piece.n; ++i)
        ASSERT_EQ(pu.w.f32()[piece.local + i], wp[piece.global + i]) << pu.name << " local " << piece.local + i;
    }
    for (const ParamSpec& p : pu.params)
      for (int64_t i = 0; i < p.numel(); ++i)
        if (p.global_index(i) < 0) ASSERT_EQ(pu.w.f32()[p.offset + i], 0.0f) << p.name << " padding " << i;
    ASSERT_LE(covered, pu.numel);
  }

  // greedy predictions over the whole vocabulary, from a forward without targets
  {
    std::vector<int32_t> tokens(B * T);
    for (int i = 0; i < B * T; ++i) tokens[i] = (7 * i + 3) % k.model.vocab_size;
    whole.forward(tokens.data(), nullptr, B, T);
    part.forward(tokens.data(), nullptr, B, T);
    expect_same_predictions(whole, part, B, T);
  }
  const Result a = run(whole, B, T), b = run(part, B, T);
  // The loss and gradients differ from one rank's only in the rounding of sums that tp
  // splits (row-parallel products over d_model / tp or F / tp inputs, added over ranks; the
  // loss's row statistics): float32 sums of at most 128 terms through two blocks, a few
  // ulps relative to the largest terms. 1e-5 relative to each tensor's largest gradient
  // (about 100 ulps) bounds that with room; a wrong split or a missing reduction changes
  // gradients by O(1) of that scale.
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(a.loss));
  for (size_t u = 0; u < part.units().size(); ++u) {
    const Unit& pu = part.units()[u];
    for (const ParamSpec& p : pu.params) {
      float scale = 0;
      const float* ga = a.grads[u].data();
      const int64_t rn = p.row_numel();
      for (int64_t i = 0; i < shape_numel(p.global_shape); ++i)
        scale = std::max(scale, std::abs(ga[p.global_offset + i]));
      for (int64_t i = 0; i < p.numel(); ++i) {
        const int64_t g = p.global_index(i);
        const float got = b.grads[u][p.offset + i];
        if (g < 0) {
          ASSERT_EQ(got, 0.0f) << p.name << " padding gradient " << i;
          continue;
        }
        ASSERT_NEAR(got, ga[p.global_offset + g], 1e-5f * scale + 1e-9f)
            << p.name << " element " << g << " (row " << g / rn << ")";
      }
    }
  }
}

TEST(TensorParallel, ModelMatchesOneRank) {
  const int n = g_world->size();
  for (bool sp : {false, true})
    for (const Case& k : cases()) {
      check_case(k, n, sp, 2);
      if (n == 4) check_case(k, 2, sp, 2);  // two tp-2 groups side by side
    }
  // one sequence: the sequence pieces need no reordering around the collectives
  check_case(cases()[0], n, true, 1);
  check_case(cases()[2], n, true, 1);
}

// The tp collectives run on the tp group only: a 2 x 2 split of 4 ranks leaves the other
// axis's group without traffic.
TEST(TensorParallel, CollectivesStayInTheTpGroup) {
  Communicator& w = *g_world;
  if (w.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  CpuAllocator alloc;
  Mesh mesh(w, 2, 1, 2);
  TensorParallel mappings(mesh.tp(), alloc);
  Model part(base("llama"), alloc, 2, Recompute{}, true, &mappings);
  part.init(3);
  run(part, 2, 8);
  EXPECT_FALSE(mesh.tp().flight_record().empty());
  EXPECT_TRUE(mesh.dp().flight_record().empty()) << mesh.dp().flight_dump();
}

}  // namespace

int main(int argc, char** argv) { return mt::test::mpi_test_main(argc, argv, {}, &g_world); }
