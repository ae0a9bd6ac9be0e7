// Context parallelism in whole training runs: each sequence split over cp ranks (two chunks
// each, one early and one late), attention as a ring, trains what one process trains, alone
// and with every other axis; validation through it; a checkpoint written at cp 2 x dp 2
// resumes elsewhere; layouts it cannot split are refused; a stuck ring peer is named.
// The attention parts themselves are checked against a float64 reference in test_attention.cpp.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.h"
#include "nn/cp.h"
#include "ops/embedding.h"
#include "ops/rope.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

// Rank r holds chunks r and 2 cp - 1 - r: every position exactly once, in two runs.
TEST(ContextParallel, PositionsCoverTheSequenceOnce) {
  EXPECT_EQ(cp_positions(8, {2, 0}), (std::vector<int32_t>{0, 1, 6, 7}));
  EXPECT_EQ(cp_positions(8, {2, 1}), (std::vector<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(cp_positions(8, {4, 3}), (std::vector<int32_t>{3, 4}));
  std::vector<int> seen(48, 0);
  for (int r = 0; r < 3; ++r)
    for (int32_t p : cp_positions(48, {3, r})) ++seen[p];
  EXPECT_EQ(seen, std::vector<int>(48, 1));
  EXPECT_THROW(cp_positions(12, {4, 0}), Error);  // 12 does not split into 8 chunks
}

// RoPE and learned positions at a rank's positions: bit-identical to the whole sequence's
// rows at those positions (the same float32 angle for the same position).
TEST(ContextParallel, PositionsOfRopeAndLearnedEmbedding) {
  const int64_t B = 2, T = 16, H = 3, D = 8, C = 5;
  std::vector<float> whole(B * T * H * D), wpe(T * C);
  for (size_t i = 0; i < whole.size(); ++i) whole[i] = std::sin(0.37f * i);
  for (size_t i = 0; i < wpe.size(); ++i) wpe[i] = std::cos(0.11f * i);
  const std::vector<int32_t> pos = cp_positions(T, {4, 1});  // 2, 3, 12, 13
  const int64_t Tl = pos.size();
  std::vector<float> part(B * Tl * H * D), rows(B * Tl * C, 0.0f), whole_rows(B * T * C, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i)
      std::copy_n(&whole[(b * T + pos[i]) * H * D], H * D, &part[(b * Tl + i) * H * D]);
  rope_forward(Tensor::wrap(whole.data(), {B, T, H, D}, DType::f32), 2, 10000.0f);
  rope_forward(Tensor::wrap(part.data(), {B, Tl, H, D}, DType::f32), 2, 10000.0f, pos.data());
  position_forward(Tensor::wrap(whole_rows.data(), {B, T, C}, DType::f32), Tensor::wrap(wpe.data(), {T, C}, DType::f32));
  position_forward(Tensor::wrap(rows.data(), {B, Tl, C}, DType::f32), Tensor::wrap(wpe.data(), {T, C}, DType::f32),
                   pos.data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Tl; ++i) {
      for (int64_t e = 0; e < H * D; ++e)
        ASSERT_EQ(part[(b * Tl + i) * H * D + e], whole[(b * T + pos[i]) * H * D + e]) << b << " " << i;
      for (int64_t e = 0; e < C; ++e) ASSERT_EQ(rows[(b * Tl + i) * C + e], whole_rows[(b * T + pos[i]) * C + e]);
    }
  // backward: each position's row of the gradient gets the sum over the batch
  std::vector<float> dwpe(T * C, 0.0f);
  position_backward(Tensor::wrap(dwpe.data(), {T, C}, DType::f32), Tensor::wrap(rows.data(), {B, Tl, C}, DType::f32),
                    pos.data());
  for (int64_t t = 0, i = 0; t < T; ++t) {
    const bool mine = i < Tl && pos[i] == t;
    for (int64_t e = 0; e < C; ++e)
      ASSERT_EQ(dwpe[t * C + e], mine ? rows[i * C + e] + rows[(Tl + i) * C + e] : 0.0f) << t;
    i += mine;
  }
  const int32_t outside[4] = {0, 1, 2, 16};
  EXPECT_THROW(position_forward(Tensor::wrap(rows.data(), {B, Tl, C}, DType::f32),
                                Tensor::wrap(wpe.data(), {T, C}, DType::f32), outside),
               Error);
}

class CpFamily : public ::testing::TestWithParam<std::string> {};

// Every step's bytes sent around the ring are the predicted ones (cp_bytes_per_step in the
// trainer): keys/values cp - 1 times each way (forward twice with recomputation), their
// gradients cp times, nothing more.
void expect_cp_bytes_as_predicted(const TempDir& d, const std::string& name) {
  expect_comm_bytes_as_predicted(d, name, "cp", 0, 0);  // exactly
}

// cp alone at 2 and 4 (Llama with grouped-query heads: 4 query heads on 2 key/value heads),
// and with each other axis. Tolerances are expect_equivalent's (train_runs.h): the ring
// changes only the order in which each query row's softmax parts are summed (merged by
// their log-sum-exp) and, with dp x cp, the order of the gradient reduction.
TEST_P(CpFamily, LayoutsMatchSingleRank) {
  TempDir d;
  const std::string fam = GetParam(), data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const std::string o = options(fam, 8, 0) + " --model.n_layer=4 --optim.grad_clip=0.05" + data;
  const RunResult one = train_run(d, "one", 1, o + " --training.micro_batch=2");
  // {name, ranks, layout}
  const std::vector<std::tuple<std::string, int, std::string>> layouts = {
      {fam + "_cp2", 2, " --parallel.cp=2 --training.micro_batch=2"},
      {fam + "_cp4", 4, " --parallel.cp=4 --training.micro_batch=2"},
      {fam + "_cp2_dp2_zero1", 4, " --parallel.cp=2 --parallel.zero=1"},
      {fam + "_cp2_dp2_zero3", 4, " --parallel.cp=2 --parallel.zero=3"},
      {fam + "_tp2_cp2_sp", 4, " --parallel.cp=2 --parallel.tp=2 --parallel.sequence_parallel=true"},
      {fam + "_pp2_cp2_zb", 4, " --parallel.cp=2 --parallel.pp=2 --parallel.pp_schedule=zb-h1 --training.micro_batch=1"},
      {fam + "_cp2_recompute", 2, " --parallel.cp=2 --training.recompute=true --training.micro_batch=2"},
  };
  for (const auto& [name, ranks, layout] : layouts) {
    const RunResult r = train_run(d, name, ranks, o + layout);
    expect_equivalent(one, r, name);
    expect_activations_as_predicted(r, name);
    expect_cp_bytes_as_predicted(d, name);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CpFamily, ::testing::Values("gpt2", "llama"));

// All four axes at once on 8 ranks: tp 2 x cp 2 x pp 2 (dp 1), and tp 2 x cp 2 x dp 2 (ZeRO 1).
TEST(ContextParallel, WithEveryAxis) {
  TempDir d;
  const std::string o = options("llama", 8, 0) + " --model.n_layer=4 --optim.grad_clip=0.05 --training.steps=4" +
                        " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const RunResult one = train_run(d, "one", 1, o + " --training.micro_batch=1");
  expect_equivalent(one, train_run(d, "llama_tp2_cp2_pp2", 8, o + " --parallel.tp=2 --parallel.cp=2 --parallel.pp=2 "
                                                                    "--training.micro_batch=1"),
                    "tp2 cp2 pp2");
  expect_equivalent(one, train_run(d, "llama_tp2_cp2_dp2", 8, o + " --parallel.tp=2 --parallel.cp=2 --parallel.zero=1"),
                    "tp2 cp2 dp2");
}

// Validation runs through the ring too, and through dp (each rank its sequences, the sums
// over the data group) and pp (the loss on the last stage, summed over the pipeline): the
// same validation losses as one rank, to the training's drift between layouts.
TEST(ContextParallel, ValidationMatchesSingleRank) {
  TempDir d;
  const std::string o = options("gpt2", 4, 0) + " --training.val_every=2 --data.val_fraction=0.2 --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  auto val_losses = [&](const std::string& name, int ranks, const std::string& layout) {
    train_run(d, name, ranks, o + layout);
    std::vector<double> v;
    for (const std::string& l : read_lines(d / (name + ".jsonl"))) {
      const auto j = nlohmann::json::parse(l);
      if (j.value("event", "") == "val") v.push_back(j["val_loss"]);
    }
    return v;
  };
  const std::vector<double> one = val_losses("one", 1, "");
  ASSERT_GE(one.size(), 2u);
  for (const std::string axis : {"cp", "dp", "pp"}) {
    const std::string layout = " --parallel." + axis + "=2";
    const std::vector<double> v = val_losses(axis + "2", 2, layout);
    ASSERT_EQ(v.size(), one.size()) << layout;
    for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(v[i], one[i], 1e-5 * one[i]) << layout << " " << i;
  }
}

// A checkpoint written at cp 2 x dp 2 holds whole units like any other: it resumes at one
// rank and at tp 2 x cp 2, continuing the uninterrupted run.
TEST(ContextParallel, CheckpointResumesAtAnotherLayout) {
  TempDir d;
  const std::string o = options("llama", 8, 2) + " --optim.schedule=constant --data.path=" +
                        write_tokens(d, "t.bin", 3000, 37);
  expect_resumes_at_other_layouts(d, o, " --parallel.cp=2 --parallel.zero=1",
                                  {{1, ""}, {4, " --parallel.cp=2 --parallel.tp=2"}});
}

// Sequences that do not split into 2 cp equal chunks, and the materialized attention, are
// refused before any work with one message naming the keys and values to use.
TEST(ContextParallel, LayoutsThatCannotSplitAreRefused) {
  TempDir d;
  const std::string o = options("llama", 4, 0) + " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {" --parallel.cp=2 --model.seq_len=18", "use seq_len 16 or 20"},
      {" --parallel.cp=2 --parallel.tp=2 --parallel.sequence_parallel=true --model.seq_len=20",
       "use seq_len 16 or 24"},
      {" --parallel.cp=2 --training.attention=materialized", "needs training.attention = fused"},
      {" --parallel.cp=3", "use seq_len 12 or 18"},
  };
  expect_refused(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + o, bad);
}

// A ring peer that stops answering: its neighbour's watchdog names the wait and the peer,
// and the job ends instead of hanging.
TEST(ContextParallel, StuckPeerIsNamed) {
  TempDir d;
  std::string out;
  const int rc = run_command(std::string(MESHTRAIN_BIN) + " launch -n 2 train " + options("gpt2", 4, 0) +
                                 " --data.path=" + write_tokens(d, "t.bin", 3000, 37) +
                                 " --parallel.cp=2 --parallel.test_fault=hang:1 --parallel.timeout_s=3"
                                 " --logging.progress=off",
                             &out);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("context-parallel rank 0 has waited 3 s for keys and values from rank 1"), std::string::npos)
      << out;
}

}  // namespace
