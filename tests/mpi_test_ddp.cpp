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
#include "parallel/powersgd.h"
#include "parallel/zero.h"

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

// int8 for ZeRO 1 (Int8Reduction::Mode::reduce_scatter) on 3000 elements: each rank's range
// is ZeRO's chunk, ceil(3000 / P) (not a multiple of 1024: a partial scale chunk). Each
// rank's contribution is quantized with its own scale, max |x| / 127 <= 1.1 (r + 1) / 127
// (the residual inside x), and rounding errs by half a step: per step the owner's float sum
// is within 1.1 c / 254 of the true sum (c = P (P + 1) / 2; bound used: 1.1 c / 127). No
// requantization: summed over the steps, the residuals telescope and the total is within the
// last step's, 1.1 c / 254 (bound 1.1 c / 127), of the true total; the small elements' true
// total, 40 x 0.001 x c, is 4.6 times that. Elements outside the rank's range are left as
// they were. Bytes: one all-to-all of a block per rank, (P - 1) x block_bytes().
TEST(Int8Reduction, ReduceScatterKeepsTheSumInTheOwnersRange) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int P = w.size(), r = w.rank();
  const int64_t n = 3000, m = (n + P - 1) / P;
  Int8Reduction red(n, w, alloc, Int8Reduction::Mode::reduce_scatter);
  ASSERT_EQ(red.range(), m);
  EXPECT_EQ(red.block_bytes(), 4 * ((m + 1023) / 1024) + (m + 3) / 4 * 4);
  auto v = [](int64_t i) { return i % 700 == 0 ? 1.0f : 0.001f * (1 + i % 3); };
  const double c = P * (P + 1) / 2.0, bound = 1.1 * c / 127;
  std::vector<float> g(n);
  std::vector<double> total(n, 0.0);
  const int steps = 40;
  const uint64_t before = w.bytes_sent();
  for (int t = 0; t < steps; ++t) {
    for (int64_t i = 0; i < n; ++i) g[i] = (r + 1) * v(i);
    red.reduce_scatter(g.data());
    for (int64_t i = 0; i < n; ++i) {
      if (i / m != r) {
        ASSERT_EQ(g[i], (r + 1) * v(i)) << "outside the range, element " << i;
        continue;
      }
      ASSERT_NEAR(g[i], c * v(i), bound) << "step " << t << " element " << i;
      total[i] += g[i];
    }
  }
  for (int64_t i = r * m; i < std::min(n, (r + 1) * m); ++i) ASSERT_NEAR(total[i], steps * c * v(i), bound) << i;
  EXPECT_EQ(w.bytes_sent() - before, uint64_t(steps) * (P - 1) * red.block_bytes()) << "one all-to-all per step";
}

// ZeRO `stage` with int8 over `micro` micro-steps per step (each unit's gradients set on
// every rank r to value(r, u, i) between its before_ and after_backward), `steps` steps: every
// rank's chunk holds micro x the sum over ranks within micro x the bound of one compressed
// sum, 1.1 c / 127 with c = P (P + 1) / 2; bytes per step and unit of n: micro all-to-alls,
// (P - 1) x block, and the parameters' all-gather, (P - 1) x 4 ceil(n / P); after an update
// of the chunks every rank holds identical parameters. The strategy describes itself with
// `described` in its line.
void expect_int8_zero_sums(int stage, int micro, int steps, const std::string& described) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int P = w.size();
  Model model(tiny(), alloc, 1, Recompute{}, /*allocate_state=*/false);
  ParallelConfig pc;
  pc.zero = stage, pc.shard_group = P, pc.grad_compression = "int8";
  ZeRO zero(model, w, alloc, pc, [](const std::vector<ParamSlice>& ranges) {
    for (const ParamSlice& p : ranges)
      for (int64_t i = p.begin; i < p.end; ++i) p.params[i - p.begin] = 0.01f * static_cast<float>(i % 17);
  });
  EXPECT_NE(zero.describe().find(described), std::string::npos) << zero.describe();
  if (stage > 1) EXPECT_TRUE(zero.compression_state().empty()) << "no error feedback: nothing to keep";
  auto value = [](int r, size_t u, int64_t i) { return (r + 1) * (i % 5 == 0 ? 1.0f : 0.01f * static_cast<float>(u + i % 7)); };
  const double c = P * (P + 1) / 2.0, bound = micro * 1.1 * c / 127;
  const std::vector<OptimSegment> segs = zero.optim_segments();
  const std::vector<ParamSlice> own = zero.owned();
  uint64_t want_bytes = 0;
  for (const Unit& u : model.units()) {
    const int64_t chunk = (u.numel + P - 1) / P;
    want_bytes += micro * (P - 1) * (4 * ((chunk + 1023) / 1024) + (chunk + 3) / 4 * 4) + (P - 1) * 4 * chunk;
  }
  const int units = static_cast<int>(model.units().size());
  for (int step = 0; step < steps; ++step) {
    zero.zero_grad();
    const uint64_t before = zero.bytes_sent();
    for (int m = 0; m < micro; ++m) {
      zero.set_sync(m == micro - 1);
      for (int u = units - 1; u >= 0; --u) {
        zero.before_backward(u);
        for (int64_t i = 0; i < model.units()[u].numel; ++i) model.units()[u].g.f32()[i] = value(w.rank(), u, i);
        zero.after_backward(u);
      }
    }
    zero.finish();
    for (size_t u = 0; u < segs.size(); ++u)
      for (int64_t i = 0; i < own[u].end - own[u].begin; ++i) {
        const int64_t at = own[u].begin + i;
        double want = 0;
        for (int r = 0; r < P; ++r) want += micro * value(r, u, at);
        ASSERT_NEAR(segs[u].g.f32()[i], want, bound) << "unit " << u << " element " << at;
        segs[u].w.f32()[i] -= 0.01f * segs[u].g.f32()[i];  // an update of this rank's chunk
      }
    zero.after_step();
    EXPECT_EQ(zero.bytes_sent() - before, want_bytes) << "step " << step;
    zero.check_same_parameters();  // throws naming the rank that differs
  }
}

// ZeRO 1 with int8 (error feedback, reduced in finish()): one micro-step, 3 steps.
TEST(Int8Zero1, ChunksHoldTheSumAndEveryRankEndsIdentical) {
  expect_int8_zero_sums(1, 1, 3, "int8-compressed reduce-scatter (error feedback)");
}

// int8 for ZeRO 2-3 (reduce_scatter without error feedback) on the elements above: no state,
// each step's sum within the same bound of the true sum, and nothing carried: the small
// elements (0.127 to 0.381 of a quantization step on every rank) arrive as 0 every step, where
// error feedback would deliver their total. Bytes as with error feedback.
TEST(Int8Reduction, WithoutErrorFeedbackKeepsNoStateAndCarriesNothing) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int P = w.size(), r = w.rank();
  const int64_t n = 3000, m = (n + P - 1) / P;
  Int8Reduction red(n, w, alloc, Int8Reduction::Mode::reduce_scatter, /*error_feedback=*/false);
  EXPECT_TRUE(red.state().empty());
  const size_t comm = static_cast<size_t>(MemTag::comm);
  EXPECT_EQ(alloc.stats().live[comm], 0u) << "no residual, no blocks kept between calls";
  auto v = [](int64_t i) { return i % 700 == 0 ? 1.0f : 0.001f * (1 + i % 3); };
  const double c = P * (P + 1) / 2.0, bound = 1.1 * c / 127;
  std::vector<float> g(n);
  const int steps = 40;
  const uint64_t before = w.bytes_sent();
  for (int t = 0; t < steps; ++t) {
    for (int64_t i = 0; i < n; ++i) g[i] = (r + 1) * v(i);
    red.reduce_scatter(g.data());
    for (int64_t i = r * m; i < std::min(n, (r + 1) * m); ++i) {
      ASSERT_NEAR(g[i], c * v(i), bound) << "step " << t << " element " << i;
      if (i % 700 != 0) ASSERT_EQ(g[i], 0.0f) << "a small element carried over, step " << t << " element " << i;
    }
  }
  EXPECT_EQ(alloc.stats().live[comm], 0u) << "the blocks freed after each call";
  EXPECT_EQ(alloc.stats().peak[comm], 2u * P * red.block_bytes()) << "only the call's send and receive blocks";
  EXPECT_EQ(w.bytes_sent() - before, uint64_t(steps) * (P - 1) * red.block_bytes()) << "one all-to-all per step";
}

// ZeRO 2 with int8: over 2 micro-steps (each unit reduced right after its backward) every
// rank's gradient shard holds the sum of both micro-steps' compressed sums, within twice the
// bound; 2 all-to-alls per unit and step.
TEST(Int8Zero2, ShardsAccumulateTheMicroStepsAndEveryRankEndsIdentical) {
  expect_int8_zero_sums(2, 2, 2, "int8-compressed reduce-scatter (no error feedback)");
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

// PowerSGD (parallel/powersgd.h), rank 3, on a bucket of a 1-D tensor (5), a 24 x 16
// matrix, a 3 x 10 matrix (rank 3 >= 3 rows: sent uncompressed) and a tail (7). Rank k's
// matrix is U C_k V^T with U, V shared and C_k its own: every rank's matrix, its residual
// and their sum lie in U's column space, which P spans, so the approximation is the true
// sum up to float rounding: within 1e-5 of the sum's largest element (measured: below 1e-6;
// the products run in float over 16 to 24 terms, the orthonormalization in double). The
// uncompressed elements are the plain all-reduce: summed in rank order, bit for bit. Every
// rank gets the same values; the bytes are the two all-reduces'.
TEST(PowerSGD, LowRankMatricesArriveExactlyAndEveryRankAgrees) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int D = w.size(), r = 3;
  const int64_t rows = 24, cols = 16, n = 5 + rows * cols + 30 + 7;
  PowerSGDReduction red(n, {{5, rows, cols}, {5 + rows * cols, 3, 10}}, r, w, alloc);
  EXPECT_EQ(red.compressed_matrices(), 1);
  EXPECT_EQ(red.p_elements(), rows * r + 5 + 30 + 7);
  EXPECT_EQ(red.q_elements(), cols * r);
  const Philox rng{11};
  auto value = [&](int k, int t, int64_t i) {  // rank k's gradient at step t
    if (i < 5 || i >= 5 + rows * cols) return static_cast<float>(rng.normal(100 * t + k, i));
    const int64_t a = (i - 5) / cols, b = (i - 5) % cols;
    double v = 0;
    for (int x = 0; x < r; ++x)
      for (int y = 0; y < r; ++y) v += rng.normal(1, a * r + x) * rng.normal(1000 + 100 * t + k, x * r + y) * rng.normal(2, b * r + y);
    return static_cast<float>(v);
  };
  std::vector<float> g(n);
  uint64_t bytes = 0;
  double worst = 0;
  for (int t = 0; t < 3; ++t) {
    for (int64_t i = 0; i < n; ++i) g[i] = value(w.rank(), t, i);
    const uint64_t before = w.bytes_sent();
    red.reduce(g.data());
    bytes += w.bytes_sent() - before;
    check_same_hash(w, params_hash(g.data(), n), "the PowerSGD-reduced gradients");
    double scale = 0;
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) {
      float s = value(0, t, i);
      for (int k = 1; k < D; ++k) s += value(k, t, i);
      want[i] = s;
      if (i >= 5 && i < 5 + rows * cols) scale = std::max(scale, std::fabs(want[i]));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i >= 5 && i < 5 + rows * cols) {
        worst = std::max(worst, std::fabs(g[i] - want[i]) / scale);
        ASSERT_NEAR(g[i], want[i], 1e-5 * scale) << "step " << t << " matrix element " << i - 5;
      } else {
        ASSERT_EQ(g[i], static_cast<float>(want[i])) << "step " << t << " uncompressed element " << i;
      }
    }
  }
  if (w.rank() == 0) std::printf("PowerSGD on a rank-%d matrix: largest error %.2e of the largest element\n", r, worst);
  const auto allreduce_bytes = [&](int64_t count) { return static_cast<uint64_t>(2.0 * (D - 1) / D * 4 * count); };
  EXPECT_EQ(bytes, 3 * (allreduce_bytes(red.p_elements()) + allreduce_bytes(red.q_elements())));
}

// Error feedback, rank 2 on a 32 x 20 matrix: rank k's gradient at step t is G + 0.1 N_kt,
// G fixed and of full rank, so a rank-2 approximation drops most of G every step. Summed
// over the steps, the outputs equal the true sums minus the residuals the ranks hold (the
// residuals telescope), which stay bounded: checked every 20 steps up to 120, the running
// sums differ by at most 10 times one step's true sum (its largest element; measured 4.7
// to 6.7 at 2 and 4 ranks, flat from step 20 to 240). Without error feedback the dropped
// part of G accumulates, about 0.8 steps' worth per step (measured 16 at step 20, 95 at
// 120): the same bound fails.
TEST(PowerSGD, ErrorFeedbackKeepsTheRunningSum) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  const int D = w.size(), steps = 120;
  const int64_t rows = 32, cols = 20, n = rows * cols;
  const Philox rng{12};
  double drift[2] = {0, 0};  // the largest difference seen, in steps' worth: with and without feedback
  for (bool feedback : {true, false}) {
    PowerSGDReduction red(n, {{0, rows, cols}}, 2, w, alloc);
    red.set_error_feedback(feedback);
    std::vector<double> out_total(n, 0.0), true_total(n, 0.0);
    std::vector<float> g(n);
    double step_scale = 0;
    for (int t = 0; t < steps; ++t) {
      for (int64_t i = 0; i < n; ++i) {
        g[i] = static_cast<float>(rng.normal(0, i) + 0.1 * rng.normal(1 + t * D + w.rank(), i));
        double s = 0;
        for (int k = 0; k < D; ++k) s += rng.normal(0, i) + 0.1 * rng.normal(1 + t * D + k, i);
        true_total[i] += s;
        step_scale = std::max(step_scale, std::fabs(s));
      }
      red.reduce(g.data());
      check_same_hash(w, params_hash(g.data(), n), "the PowerSGD-reduced gradients");
      for (int64_t i = 0; i < n; ++i) out_total[i] += g[i];
      if ((t + 1) % 20 != 0) continue;
      double worst = 0;
      for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(out_total[i] - true_total[i]));
      drift[feedback ? 0 : 1] = std::max(drift[feedback ? 0 : 1], worst / step_scale);
    }
  }
  if (w.rank() == 0)
    std::printf("running sums over %d steps differ by at most %.3g steps' worth with error feedback, %.3g without\n",
                steps, drift[0], drift[1]);
  EXPECT_LT(drift[0], 10.0) << "with error feedback";
  EXPECT_GT(drift[1], 10.0) << "without error feedback the bound would not hold";
}

// PowerSGD inside DDP on the tiny model (rank 2): the 2-D parameters are compressed, every
// rank ends with the same gradients; a step with an inf on one rank arrives as NaN on every
// rank, and the next step is finite again (residuals and Q restarted).
TEST(PowerSGD, DdpGradientsAreIdenticalOnEveryRankAndRecoverFromInf) {
  Communicator& w = *g_world;
  CpuAllocator alloc;
  Mesh mesh(w, w.size(), 1, 1);
  Model model(tiny(), alloc, 1);
  ParallelConfig pc;
  pc.grad_compression = "powersgd";
  pc.powersgd_rank = 2;
  pc.bucket_mb = 0.001;  // several buckets
  DDP ddp(model, mesh.dp(), alloc, pc);
  if (w.size() == 1) return;
  int compressed = 0;
  for (int b = 0; b < ddp.num_buckets(); ++b) compressed += ddp.powersgd(b)->compressed_matrices();
  EXPECT_GT(compressed, 3);
  EXPECT_NE(ddp.describe().find("powersgd-compressed (rank 2"), std::string::npos) << ddp.describe();
  Philox rng{6};
  for (int step = 0; step < 3; ++step) {
    for (size_t u = 0; u < model.units().size(); ++u)
      for (int64_t i = 0; i < model.units()[u].numel; ++i)
        model.units()[u].g.f32()[i] =
            step == 1 && w.rank() == 0 ? INFINITY : static_cast<float>(rng.normal(1000 * w.rank() + 10 * step + u, i));
    ddp.set_sync(true);
    for (int u = static_cast<int>(model.units().size()) - 1; u >= 0; --u) ddp.after_backward(u);
    ddp.finish();
    bool finite = true;
    for (const Unit& u : model.units())
      for (int64_t i = 0; i < u.numel; ++i) finite = finite && std::isfinite(u.g.f32()[i]);
    EXPECT_EQ(finite, step != 1) << "step " << step;
    uint64_t h = params_hash(nullptr, 0);
    for (const Unit& u : model.units()) h = params_hash(u.g.f32(), u.numel, h);
    if (finite) check_same_hash(mesh.dp(), h, "the PowerSGD-reduced DDP gradients");
  }
}

}  // namespace

int main(int argc, char** argv) {
  // debug: any mismatch fails loudly
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{true, 60, nullptr}, &g_world);
}
