// Never hang, always say why: faults injected into 2-rank jobs (parallel.test_fault) end
// the whole job with a non-zero exit and a message naming the rank, well within the
// watchdog timeout, and leave no process behind.
#include <gtest/gtest.h>

#include <chrono>

#include "test_util.h"

using namespace mt;

namespace {

struct Outcome {
  int rc;
  double seconds;
  std::string out;
};

// Runs a 2-rank job whose checkpoint.dir is unique to it, so leftover processes can be found.
// Only the hang test shortens the watchdog (a loaded machine must not trip it elsewhere).
Outcome run_job(const test::TempDir& d, const std::string& extra, int ranks = 2) {
  const std::string cmd = "OMP_NUM_THREADS=1 timeout -k 5 90 " + std::string(MESHTRAIN_BIN) + " launch -n " +
                          std::to_string(ranks) + " train --model.n_layer=1 --model.d_model=16 --model.n_head=2 " +
                          "--model.seq_len=8 --model.vocab_size=37 --training.steps=5 --training.global_batch=4 " +
                          "--logging.progress=off --data.path=" + d / "t.bin" +
                          " --checkpoint.dir=" + d / "ck" + " " + extra;
  const auto t0 = std::chrono::steady_clock::now();
  Outcome o;
  o.rc = test::run_command(cmd, &o.out);
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

bool processes_left(const test::TempDir& d) {
  std::string out;
  // the bracket keeps the pattern from matching the shell that runs pgrep
  return test::run_command("pgrep -f -- '[-]-checkpoint.dir=" + d / "ck" + "'", &out) == 0;
}

class Faults : public ::testing::Test {
 protected:
  void SetUp() override { test::write_tokens(d, "t.bin", 2000, 37); }
  void expect_clean_failure(const Outcome& o, const std::string& must_say) {
    EXPECT_NE(o.rc, 0) << o.out;
    EXPECT_NE(o.rc, 124) << "the job had to be killed by the test's timeout:\n" << o.out;
    EXPECT_LT(o.seconds, 30) << o.out;
    EXPECT_NE(o.out.find(must_say), std::string::npos) << "expected \"" << must_say << "\" in:\n" << o.out;
    EXPECT_FALSE(processes_left(d)) << "ranks are still running";
  }
  test::TempDir d;
};

TEST_F(Faults, KilledRankEndsTheJob) {
  expect_clean_failure(run_job(d, "--parallel.test_fault=die:1"), "rank 1");
}

TEST_F(Faults, ExceptionOnOneRankEndsTheJob) {
  expect_clean_failure(run_job(d, "--parallel.test_fault=throw:1"), "rank 1: error: injected failure");
}

TEST_F(Faults, HungRankTripsTheWatchdog) {
  Outcome o = run_job(d, "--parallel.test_fault=hang:1 --parallel.timeout_s=3");
  expect_clean_failure(o, "has not finished after 3 s");
  // the rank whose part never came is named (its receive is the one still pending)
  EXPECT_NE(o.out.find("nothing has come yet from rank 1 of the group: that rank is stuck, dead"), std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("flight recorder of rank 0, group 'dp'"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("allreduce f32 x 4032 (running)"), std::string::npos) << o.out;
}

TEST_F(Faults, MismatchedCollectiveIsNamedInDebugMode) {
  Outcome o = run_job(d, "--parallel.test_fault=mismatch:1 --parallel.debug_collectives=true");
  expect_clean_failure(o, "collective mismatch on group 'dp' (2 ranks)");
  EXPECT_NE(o.out.find("rank 1: #3 allreduce f32 x 3"), std::string::npos) << o.out;
}

TEST_F(Faults, BadLayoutIsRejectedOnceBeforeAnyWork) {
  Outcome o = run_job(d, "--parallel.dp=2", 3);
  EXPECT_EQ(o.rc, 1) << o.out;
  const std::string msg = "the job has 3 ranks but parallel.dp x parallel.pp x parallel.cp x parallel.tp = 2 x 1 x 1 x 1";
  size_t first = o.out.find(msg);
  ASSERT_NE(first, std::string::npos) << o.out;
  EXPECT_EQ(o.out.find(msg, first + 1), std::string::npos) << "printed more than once:\n" << o.out;
  EXPECT_EQ(o.out.find("step 1/"), std::string::npos) << "training started:\n" << o.out;
  Outcome b = run_job(d, "--training.global_batch=6 --training.micro_batch=2");
  EXPECT_EQ(b.rc, 1) << b.out;
  EXPECT_NE(b.out.find("not divisible by parallel.dp x training.micro_batch = 2 x 2 = 4"), std::string::npos) << b.out;
}

}  // namespace
