// The loss-spike and NaN guard (training.skip_spikes, train/spike_guard.h):
// - the guard's arithmetic: nothing judged before its history fills, a value more than Z
//   deviations above the mean is a spike, a non-finite one always is, skips in a row counted;
// - in training on two data-parallel ranks, a gradient spike or a NaN loss injected on one
//   rank (parallel.test_fault) is skipped at exactly that step on every rank, the skipped
//   step changes nothing, and skips in a row up to training.max_skips stop the run with a
//   message naming the key; without the guard, a non-finite loss or non-finite gradients
//   (fp16 reduction past its range) stop the run before the update and its checkpoint;
// - across a resume: the checkpoint keeps the guard's history and its skips in a row, so a
//   resumed run skips what the uninterrupted one skips and trains it bit for bit; a
//   checkpoint written without them still loads (the guard starts empty).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "train/spike_guard.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

TEST(SpikeGuard, JudgesAgainstTheRecentMeanOnceItHasAHistory) {
  SpikeGuard g(4, 3);
  EXPECT_FALSE(SpikeGuard(0, 3).enabled());
  EXPECT_NE(g.check(NAN, 1), "") << "a non-finite loss is always a spike";
  EXPECT_NE(g.check(1, INFINITY), "");
  for (int i = 0; i < SpikeGuard::kMinHistory - 1; ++i) {
    EXPECT_EQ(g.check(100, 100), "") << "nothing is judged before the history fills";
    g.applied(2.0 + 0.1 * (i % 2), 1.0 + 0.1 * (i % 2));
  }
  g.applied(2.0, 1.0);
  // Losses 2.0 and 2.1 alternate: mean ~2.05, deviation ~0.05; 4 deviations above is ~2.25.
  EXPECT_EQ(g.check(2.2, 1.05), "");
  EXPECT_NE(g.check(2.3, 1.05).find("the loss 2.3"), std::string::npos) << g.check(2.3, 1.05);
  EXPECT_NE(g.check(2.0, 1.5).find("the gradient norm 1.5"), std::string::npos);
  EXPECT_EQ(g.check(1.0, 0.5), "") << "below the mean is never a spike";
  g.skipped();
  g.skipped();
  EXPECT_FALSE(g.too_many());
  g.skipped();
  EXPECT_TRUE(g.too_many()) << "max_skips = 3 in a row";
  g.applied(2.0, 1.0);
  EXPECT_EQ(g.skips_in_a_row(), 0);
}

TEST(SpikeGuard, StateRestoresTheSameVerdicts) {
  SpikeGuard g(4, 3), h(4, 3);
  for (int i = 0; i < SpikeGuard::kWindow + 5; ++i) g.applied(2.0 + 0.1 * (i % 3), 1.0 + 0.01 * i);
  g.skipped();
  g.skipped();
  const SpikeGuard::State s = g.state();
  EXPECT_EQ(s.loss.size(), size_t{SpikeGuard::kWindow});
  EXPECT_EQ(s.norm.back(), 1.0 + 0.01 * (SpikeGuard::kWindow + 4)) << "newest last";
  h.restore(s);
  EXPECT_EQ(h.state().loss, s.loss);
  EXPECT_EQ(h.state().norm, s.norm);
  EXPECT_EQ(h.skips_in_a_row(), 2);
  for (double x : {2.1, 2.25, 2.3, 2.5}) EXPECT_EQ(h.check(x, 1.5), g.check(x, 1.5)) << x;
  h.skipped();
  EXPECT_TRUE(h.too_many()) << "the skips in a row go on from the saved count";
}

namespace {

// GPT-2 on random tokens, 20 steps, dp 2 with ZeRO 2 (gradients reduce-scattered during
// backward, so a spike on one rank reaches the other through the reduction).
std::string spike_options(const TempDir& d) {
  return options("gpt2", 8, 2) + " --training.steps=20 --parallel.dp=2 --parallel.zero=2 --training.skip_spikes=6" +
         " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
}

}  // namespace

TEST(SpikeGuard, SkipsExactlyTheInjectedStepsOnEveryRank) {
  TempDir d;
  const RunResult clean = train_run(d, "clean", 2, spike_options(d));
  for (const nlohmann::json& j : steps_of(d, "clean")) EXPECT_FALSE(j["skipped"].get<bool>()) << j.dump();

  const RunResult r = train_run(d, "spiked", 2, spike_options(d) + " --parallel.test_fault=spike:1:12,15");
  const std::vector<nlohmann::json> st = steps_of(d, "spiked");
  ASSERT_EQ(st.size(), 20u);
  for (int s = 0; s < 20; ++s) EXPECT_EQ(st[s]["skipped"].get<bool>(), s == 12 || s == 15) << "step " << s;
  EXPECT_GT(r.grad_norm[12], 100 * clean.grad_norm[12]) << "the injected spike is in the reported norm";
  EXPECT_NE(r.output.find("step 12: skipped as a spike: the gradient norm"), std::string::npos) << r.output;
  // Skipping changes nothing: bit-identical to the clean run up to step 12 (its loss is the
  // one before the update), different from step 13 on (the clean run applied step 12).
  for (int s = 0; s <= 12; ++s) EXPECT_EQ(r.loss[s], clean.loss[s]) << "step " << s;
  EXPECT_NE(r.loss[13], clean.loss[13]);

  const RunResult n = train_run(d, "nan", 2, spike_options(d) + " --parallel.test_fault=nan:0:14");
  const std::vector<nlohmann::json> sn = steps_of(d, "nan");
  ASSERT_EQ(sn.size(), 20u);
  for (int s = 0; s < 20; ++s) EXPECT_EQ(sn[s]["skipped"].get<bool>(), s == 14) << "step " << s;
  EXPECT_TRUE(sn[14]["loss"].is_null());
  EXPECT_NE(n.output.find("step 14: skipped as a spike: the loss is"), std::string::npos) << n.output;
  for (int s = 0; s <= 14; ++s) EXPECT_EQ(n.grad_norm[s], clean.grad_norm[s]) << "step " << s;
}

TEST(SpikeGuard, StopsTheRunAfterMaxSkipsInARow) {
  TempDir d;
  const std::string cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 2 train " + spike_options(d) +
                          " --training.max_skips=2 --parallel.test_fault=spike:0:12,13,14 --logging.progress=off";
  std::string out;
  EXPECT_NE(run_command(cmd, &out), 0) << out;
  EXPECT_NE(out.find("2 steps in a row were skipped as spikes, the last at step 13"), std::string::npos) << out;
  EXPECT_NE(out.find("training.max_skips = 2"), std::string::npos) << out;
  EXPECT_EQ(out.find("step 14"), std::string::npos) << "no rank went on past the stop\n" << out;
  // Said once, and the metrics file ends with the reason; the same for a non-finite loss
  // without the guard (it printed "-nan" and asked to set the grad_clip that was set).
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  const std::string nan_cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 2 train " +
                              spike_options(d) + " --training.skip_spikes=0 --parallel.test_fault=nan:1:3" +
                              " --logging.progress=off --logging.metrics=" + d / "nan.jsonl";
  EXPECT_NE(run_command(nan_cmd, &out), 0) << out;
  EXPECT_NE(out.find("the loss became NaN at step 3; lower optim.lr, tighten optim.grad_clip"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  const nlohmann::json last = nlohmann::json::parse(read_lines(d / "nan.jsonl").back());
  EXPECT_EQ(last["event"], "error") << last;
  EXPECT_EQ(last["step"], 3) << last;
  // Under tensor parallelism a loss only one tp rank sees as NaN stops its partner too (it
  // was left waiting in the gradient norm's sum); a spike only rank 1 judges is named so.
  const std::string tp = std::string("OMP_NUM_THREADS=1 timeout 300 ") + MESHTRAIN_BIN + " launch -n 2 train " +
                         options("gpt2", 8, 2) + " --parallel.tp=2 --logging.progress=off --data.path=" + d / "t.bin";
  EXPECT_NE(run_command(tp + " --training.steps=6 --parallel.test_fault=nan:1:3", &out), 0) << out;
  EXPECT_NE(out.find("the loss became NaN at step 3"), std::string::npos) << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  EXPECT_NE(run_command(tp + " --training.steps=16 --training.skip_spikes=6 --training.max_skips=2" +
                            " --parallel.test_fault=nan:1:12,13",
                        &out),
            0)
      << out;
  EXPECT_NE(out.find("step 12: skipped as a spike: rank 1: the loss is nan"), std::string::npos) << out;
  EXPECT_NE(out.find("the last at step 13 (rank 1: the loss is nan)"), std::string::npos) << out;
  // Gradients that overflow fp16's range in the reduction under a finite loss (fp32 training,
  // parallel.grad_comm_dtype = fp16) were applied: every parameter became NaN, the step's
  // checkpoint took them in, and the run stopped only at the next step's NaN loss. Now it
  // stops before the update and the save: the newest checkpoint is the step before.
  const std::string ck = d / "inf_ck";
  const std::string inf_cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 2 train " +
                              spike_options(d) + " --training.skip_spikes=0 --parallel.zero=0 --parallel.grad_comm_dtype=fp16" +
                              " --parallel.test_fault=overflow:1:3 --checkpoint.every=1 --checkpoint.keep=0" +
                              " --checkpoint.dir=" + ck + " --logging.progress=off --logging.metrics=" + d / "inf.jsonl";
  EXPECT_NE(run_command(inf_cmd, &out), 0) << out;
  EXPECT_NE(out.find("the gradients became infinite at step 3 (the loss is finite); the step was not applied. "
                     "parallel.grad_comm_dtype = fp16 sums them in fp16"),
            std::string::npos) << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  const nlohmann::json inf_last = nlohmann::json::parse(read_lines(d / "inf.jsonl").back());
  EXPECT_EQ(inf_last["event"], "error") << inf_last;
  EXPECT_EQ(inf_last["step"], 3) << inf_last;
  EXPECT_EQ(checkpoint_latest(ck), ck + "/step_00000003");
  std::string bad;
  EXPECT_NE(run_command(std::string(MESHTRAIN_BIN) + " train " + spike_options(d) + " --training.skip_spikes=-1", &bad), 0);
  EXPECT_NE(bad.find("training.skip_spikes = -1 must not be negative"), std::string::npos) << bad;
}

namespace {

// The audit's case on one rank: 18 steps, a gradient spike at step 14, checkpoints every 12.
std::string resume_options(const TempDir& d) {
  return options("gpt2", 8, 2) + " --training.steps=18 --training.skip_spikes=6 --checkpoint.every=12" +
         " --parallel.test_fault=spike:0:14 --data.path=" + write_tokens(d, "t.bin", 3000, 37);
}

// Copies run `from`'s checkpoints to run `to`'s, without its last (step 18): as if it had
// been stopped after step 12.
void copy_stopped_at_12(const TempDir& d, const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  fs::copy(d / from, d / to, fs::copy_options::recursive);
  ASSERT_TRUE(fs::exists(d / to + "/step_00000012/meta.json"));
  fs::remove_all(d / to + "/step_00000018");
}

}  // namespace

// Resumed from step 12, the guard has the uninterrupted run's history: step 14 is skipped
// in both and steps 12-17 and the final parameters are bit-identical. (Without the saved
// history the resumed guard has 2 applied steps at step 14, judges nothing, and applies
// the spike.)
TEST(SpikeGuard, ResumedRunSkipsAndTrainsAsTheUninterruptedOne) {
  TempDir d;
  const RunResult straight = train_run(d, "straight", 1, resume_options(d));
  ASSERT_EQ(straight.loss.size(), 18u);
  for (const nlohmann::json& j : steps_of(d, "straight")) EXPECT_EQ(j["skipped"].get<bool>(), j["step"] == 14) << j;
  const nlohmann::json meta = checkpoint_meta(d / "straight/step_00000012");
  ASSERT_TRUE(meta["optimizer"].contains("spike_guard")) << meta["optimizer"];
  EXPECT_EQ(meta["optimizer"]["spike_guard"]["loss"].size(), 12u) << "the applied steps 0-11";

  copy_stopped_at_12(d, "straight", "resumed");
  const RunResult resumed = train_run(d, "resumed", 1, resume_options(d) + " --checkpoint.resume=true");
  const std::vector<nlohmann::json> st = steps_of(d, "resumed");
  ASSERT_EQ(st.size(), 6u) << resumed.output;
  for (const nlohmann::json& j : st) EXPECT_EQ(j["skipped"].get<bool>(), j["step"] == 14) << j;
  EXPECT_NE(resumed.output.find("step 14: skipped as a spike: the gradient norm"), std::string::npos) << resumed.output;
  RunResult last6 = straight;
  last6.loss.erase(last6.loss.begin(), last6.loss.begin() + 12);
  last6.grad_norm.erase(last6.grad_norm.begin(), last6.grad_norm.begin() + 12);
  expect_bit_identical(last6, resumed, "resumed at step 12");
}

// A checkpoint written before the guard's state was saved (no optimizer.spike_guard; no
// meta_crc32 either, as such older ones have none to check) still resumes, the guard
// starting empty: too short a history at step 14 to judge it.
TEST(SpikeGuard, CheckpointWithoutTheGuardsStateStillResumes) {
  TempDir d;
  train_run(d, "straight", 1, resume_options(d));
  copy_stopped_at_12(d, "straight", "old");
  const std::string path = d / "old/step_00000012/meta.json";
  nlohmann::json meta = checkpoint_meta(d / "old/step_00000012");
  meta["optimizer"].erase("spike_guard");
  meta.erase("meta_crc32");
  std::ofstream(path) << meta.dump(1) << "\n";
  train_run(d, "old", 1, resume_options(d) + " --checkpoint.resume=true");
  const std::vector<nlohmann::json> st = steps_of(d, "old");
  ASSERT_EQ(st.size(), 6u);
  for (const nlohmann::json& j : st) EXPECT_FALSE(j["skipped"].get<bool>()) << j;
}

// The skips in a row carry across too: spikes at steps 11, 12 and 13 with
// training.max_skips=3 stop the run at step 13 whether it resumed from step 12 (after one
// skip) or not.
TEST(SpikeGuard, SkipsInARowCarryAcrossAResume) {
  TempDir d;
  const std::string cmd = std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " train " + resume_options(d) +
                          " --parallel.test_fault=spike:0:11,12,13 --training.max_skips=3 --logging.progress=off" +
                          " --checkpoint.dir=" + d / "ck";
  const std::string want = "3 steps in a row were skipped as spikes, the last at step 13";
  std::string out;
  EXPECT_NE(run_command(cmd, &out), 0) << out;
  EXPECT_NE(out.find(want), std::string::npos) << out;
  ASSERT_TRUE(std::filesystem::exists(d / "ck/step_00000012/meta.json")) << out;
  EXPECT_NE(run_command(cmd + " --checkpoint.resume=true", &out), 0) << out;
  EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
  EXPECT_NE(out.find(want), std::string::npos) << out;
}
