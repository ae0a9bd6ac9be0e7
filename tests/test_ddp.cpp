// Data parallelism against the single-rank run, through the command (meshtrain launch ->
// mpirun): dp 1, 2, 4, with and without gradient accumulation, both families; bucketing
// and overlap bit-exact; bf16 reduction close; checkpoints that resume at another dp.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

class DDPFamily : public ::testing::TestWithParam<std::string> {};

// The equivalence matrix: dp 2 and 4, without accumulation (micro = global / dp) and with
// it (micro 1: 4 or 2 micro-steps per rank), against dp 1.
TEST_P(DDPFamily, MatchesSingleRank) {
  test::TempDir d;
  const std::string fam = GetParam(), data = " --data.path=" + test::write_tokens(d, "t.bin", 3000, 37);
  RunResult one = train_run(d, "dp1", 1, options(fam, 8, 0) + data);
  RunResult one_acc = train_run(d, "dp1acc", 1, options(fam, 8, 2) + data);
  expect_equivalent(one, one_acc, fam + " dp1 accumulation");
  for (int dp : {2, 4}) {
    for (int micro : {0, 1}) {
      const std::string name = "dp" + std::to_string(dp) + "m" + std::to_string(micro);
      expect_equivalent(one, train_run(d, name, dp, options(fam, 8, micro) + data), fam + " " + name);
    }
  }
}

// The sum adds ranks in rank order elementwise: one bucket per unit, one bucket for all,
// and reducing after backward instead of during it give bit-identical training.
TEST_P(DDPFamily, BucketingAndOverlapAreBitExact) {
  test::TempDir d;
  const std::string fam = GetParam();
  const std::string o = options(fam, 8, 1) + " --data.path=" + test::write_tokens(d, "t.bin", 3000, 37);
  for (int dp : {2, 4}) {
    const std::string n = std::to_string(dp);
    RunResult small = train_run(d, "small" + n, dp, o + " --parallel.bucket_mb=0.0001");
    RunResult big = train_run(d, "big" + n, dp, o + " --parallel.bucket_mb=1000");
    RunResult late = train_run(d, "late" + n, dp, o + " --parallel.overlap=false");
    expect_bit_identical(small, big, fam + " buckets dp" + std::to_string(dp));
    expect_bit_identical(small, late, fam + " overlap dp" + std::to_string(dp));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, DDPFamily, ::testing::Values("gpt2", "llama"));

// bf16 / fp16 reductions round each gradient to 8 / 11 bits: the run stays close
// (1e-2 relative on losses over 6 steps) but is not the fp32 run.
TEST(DDP, HalfPrecisionReductionStaysClose) {
  test::TempDir d;
  const std::string o = options("gpt2", 8, 0) + " --data.path=" + test::write_tokens(d, "t.bin", 3000, 37);
  RunResult fp32 = train_run(d, "fp32", 2, o);
  for (const char* dt : {"bf16", "fp16"}) {
    RunResult half = train_run(d, dt, 2, o + " --parallel.grad_comm_dtype=" + dt);
    ASSERT_EQ(half.loss.size(), fp32.loss.size());
    for (size_t s = 0; s < fp32.loss.size(); ++s) EXPECT_NEAR(half.loss[s], fp32.loss[s], 1e-2 * fp32.loss[s]) << dt;
    EXPECT_NE(half.loss.back(), fp32.loss.back()) << dt << " reduction did not change anything";
  }
}

// A checkpoint written at dp 2 resumes at dp 1 and dp 4 with the losses of the
// uninterrupted run (constant schedule, so stopping early does not change it).
TEST(DDP, CheckpointResumesAtAnotherDp) {
  test::TempDir d;
  const std::string o = options("llama", 8, 0) + " --optim.schedule=constant --data.path=" +
                        test::write_tokens(d, "t.bin", 3000, 37);
  RunResult straight = train_run(d, "straight", 2, o);
  for (int dp : {1, 4}) {
    const std::string name = "resume" + std::to_string(dp);
    train_run(d, name, 2, o + " --training.steps=3");
    std::filesystem::remove(d / (name + ".jsonl"));
    RunResult resumed = train_run(d, name, dp, o + " --checkpoint.resume=true");
    ASSERT_EQ(resumed.loss.size(), 3u);
    for (int s = 0; s < 3; ++s) EXPECT_NEAR(resumed.loss[s], straight.loss[3 + s], 1e-6 * straight.loss[3 + s]) << dp;
  }
}

}  // namespace
