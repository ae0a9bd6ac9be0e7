// DDP's reductions under mpirun: they sum over the dp group and nothing else (on a 2 x 2
// mesh the tp neighbours' gradients must not leak in, and the tp group sees no traffic),
// in buckets that are launched as units finish, for every gradient dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "comm/mesh.h"
#include "mpi_main.h"
#include "core/half.h"
#include "core/rng.h"
#include "nn/model.h"
#include "parallel/compress.h"
#include "parallel/ddp.h"

using namespace mt;

namespace {

Communicator* g_world = nullptr;

ModelConfig tiny() {
  ModelConfig m;
  m.n_layer = 3, m.n_head = 2, m.d_model = 8, m.vocab_size = 11, m.seq_len = 4;
  return m;
}

class DDPGroups : public ::testing::TestWithParam<std::string> {};

TEST_P(DDPGroups, SumOverTheDpGroupOnly) {
  Communicator& w = *g_world;
  const int tp = w.size() == 4 ? 2 : 1, dp = w.size() / tp;
  CpuAllocator alloc;
  Mesh mesh(w, dp, 1, tp);
  Model model(tiny(), alloc, 1);
  ParallelConfig pc;
  pc.grad_comm_dtype = GetParam();
  pc.bucket_mb = 0.001;  // several buckets
  DDP ddp(model, mesh.dp(), alloc, pc);
  ASSERT_GT(ddp.num_buckets(), 1);
  // gradient element i of unit u on world rank r: r + 1 + small offsets, exactly representable
  auto value = [](int r, size_t u, int64_t i) { return static_cast<float>(r + 1) + 0.25f * (u % 3) + 0.5f * (i % 2); };
  const int t = w.rank() % tp;  // this rank's dp peers: world ranks t, t + tp, ...
  for (bool overlap : {true, false}) {  // buckets launched as units finish, or all in finish()
    ddp.set_overlap(overlap);
    for (size_t u = 0; u < model.units().size(); ++u)
      for (int64_t i = 0; i < model.units()[u].numel; ++i) model.units()[u].g.f32()[i] = value(w.rank(), u, i);
    ddp.set_sync(true);
    for (int u = static_cast<int>(model.units().size()) - 1; u >= 0; --u) ddp.after_backward(u);
    ddp.finish();
    for (size_t u = 0; u < model.units().size(); ++u)
      for (int64_t i = 0; i < model.units()[u].numel; ++i) {
        float want = 0;
        for (int d = 0; d < dp; ++d) want += value(d * tp + t, u, i);
        ASSERT_EQ(model.units()[u].g.f32()[i], want) << "unit " << u << " element " << i << " overlap " << overlap;
      }
  }
  EXPECT_TRUE(mesh.tp().flight_record().empty()) << mesh.tp().flight_dump();
  int reductions = 0;
  for (const CommRecord& r : mesh.dp().flight_record()) reductions += r.op == CommOp::allreduce;
  EXPECT_EQ(reductions, dp > 1 ? 2 * ddp.num_buckets() : 0) << mesh.dp().flight_dump();
}

// Overlapped or not, bucketed or not, the reduced gradients are bit-identical: every
// element is summed in rank order. Gradients here are arbitrary floats.
TEST(DDP, OverlapAndBucketingAreBitExact) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  Mesh mesh(w, w.size(), 1, 1);
  Model model(tiny(), alloc, 1);
  std::vector<std::vector<float>> results;
  for (double mb : {0.0005, 1000.0}) {
    for (bool overlap : {true, false}) {
      ParallelConfig pc;
      pc.bucket_mb = mb;
      DDP ddp(model, mesh.dp(), alloc, pc);
      ddp.set_overlap(overlap);
      Philox rng{5};
      std::vector<float> all;
      for (size_t u = 0; u < model.units().size(); ++u)
        for (int64_t i = 0; i < model.units()[u].numel; ++i)
          model.units()[u].g.f32()[i] = static_cast<float>(rng.normal(1000 * w.rank() + u, i));
      ddp.set_sync(true);
      for (int u = static_cast<int>(model.units().size()) - 1; u >= 0; --u) ddp.after_backward(u);
      ddp.finish();
      for (const Unit& u : model.units()) all.insert(all.end(), u.g.f32(), u.g.f32() + u.numel);
      results.push_back(std::move(all));
    }
  }
  for (size_t k = 1; k < results.size(); ++k)
    EXPECT_EQ(0, std::memcmp(results[0].data(), results[k].data(), results[0].size() * 4)) << "variant " << k;
}

// The decision to overlap: across machines, or with a core left for every rank's
// communication thread.
TEST(DDP, OverlapPaysAcrossMachinesOrWithAFreeCorePerRank) {
  EXPECT_FALSE(overlap_pays(2, 2, 1, false));   // this machine: two ranks of one thread on two cores
  EXPECT_FALSE(overlap_pays(16, 2, 8, false));  // meshtrain launch's default: cores / ranks threads each
  EXPECT_FALSE(overlap_pays(1, 2, 1, false));   // ranks bound to a core each
  EXPECT_TRUE(overlap_pays(4, 2, 1, false));
  EXPECT_TRUE(overlap_pays(16, 2, 7, false));
  EXPECT_TRUE(overlap_pays(16, 1, 16, true));   // one rank per machine, all cores computing
  // The run's ddp line says what DDP decided.
  Communicator& w = *g_world;
  CpuAllocator alloc;
  Mesh mesh(w, w.size(), 1, 1);
  Model model(tiny(), alloc, 1);
  DDP ddp(model, mesh.dp(), alloc, ParallelConfig{});
  if (w.size() > 1) {
    const std::string line = ddp.describe();
    EXPECT_EQ(line.find("overlapped with backward") != std::string::npos, ddp.overlapping()) << line;
    EXPECT_EQ(line.find("steps aside") != std::string::npos, !ddp.overlapping()) << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DDPGroups, ::testing::Values("fp32", "bf16", "fp16"));

// Micro-steps before the last do not communicate.
TEST(DDP, AccumulationStepsDoNotCommunicate) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  Mesh mesh(w, w.size(), 1, 1);
  Model model(tiny(), alloc, 1);
  DDP ddp(model, mesh.dp(), alloc, ParallelConfig{});
  ddp.set_sync(false);
  for (int u = static_cast<int>(model.units().size()) - 1; u >= 0; --u) ddp.after_backward(u);
  EXPECT_TRUE(mesh.dp().flight_record().empty());
}

// int8 compression with error feedback (parallel/compress.h). Rank r's gradient is
// (r + 1) v every step: each chunk's first element is 1, the others 0.001 to 0.003, below
// half a quantization step (1/254 of the chunk's largest), so that without error feedback
// they would be sent as 0 forever. Checked over 40 steps, with c = P (P + 1) / 2 the true
// sum's scale:
// - every rank gets the same values;
// - a step's output is the true sum c v plus the residuals carried in minus those kept,
//   each at most half its chunk's step (the ranks' (r + 1) / 127 add up to c / 127, the
//   owner's is c / 127): within 2 c / 127 (x 1.1 for the residuals inside the scales);
// - summed over the steps the residuals telescope: the total output is within the last
//   step's residuals, 1.1 c / 127, of the true total. The small elements' true total,
//   40 x 0.001 x c = 0.04 c, is 4.6 times that: lost without error feedback;
// - the bytes: an all-to-all and an all-gather of a range's block per rank.
TEST(Int8Reduction, ErrorFeedbackKeepsTheSumAndEveryRankAgrees) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int P = w.size();
  const int64_t n = 3000;  // not a multiple of the chunk: ranges of 0 to 1024 elements
  Int8Reduction red(n, w, alloc);
  auto v = [](int64_t i) { return i % Int8Reduction::kChunk == 0 ? 1.0f : 0.001f * (1 + i % 3); };
  const double c = P * (P + 1) / 2.0, per_step = 2.2 * c / 127, bound = 1.1 * c / 127;
  std::vector<float> g(n);
  std::vector<double> total(n, 0.0);
  const int steps = 40;
  uint64_t bytes = 0;
  for (int t = 0; t < steps; ++t) {
    for (int64_t i = 0; i < n; ++i) g[i] = (w.rank() + 1) * v(i);
    const uint64_t before = w.bytes_sent();
    red.reduce(g.data());
    bytes += w.bytes_sent() - before;
    check_same_hash(w, params_hash(g.data(), n), "the int8-reduced gradients");
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(g[i], c * v(i), per_step) << "step " << t << " element " << i;
      total[i] += g[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(total[i], steps * c * v(i), bound) << "element " << i;
  EXPECT_EQ(red.range(), (n + P * 1024 - 1) / (P * 1024) * 1024);
  EXPECT_EQ(bytes, uint64_t(steps) * 2 * (P - 1) * red.block_bytes())
      << "an all-to-all and an all-gather of one block per rank";
}

// A chunk holding an inf or NaN arrives as NaN on every rank (fp16 loss scaling then skips
// the step), and its residual does not poison the next step.
TEST(Int8Reduction, NonFiniteChunksArriveAsNaNAndAreForgotten) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int64_t n = 2048;
  Int8Reduction red(n, w, alloc);
  std::vector<float> g(n, 1.0f);
  if (w.rank() == 0) g[5] = INFINITY;
  red.reduce(g.data());
  EXPECT_TRUE(std::isnan(g[0]) && std::isnan(g[1023]));
  EXPECT_NEAR(g[1024], w.size(), 1e-5 * w.size());  // 1 is 127 steps of 1/127, up to rounding
  std::fill(g.begin(), g.end(), 1.0f);
  red.reduce(g.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(g[i], w.size(), 1e-5 * w.size()) << i;
}

}  // namespace

int main(int argc, char** argv) {
  // debug: any mismatch fails loudly
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{true, 60, nullptr}, &g_world);
}
