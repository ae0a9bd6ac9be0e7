// Whole training runs are bit-identical for any number of OpenMP threads: every op, the
// matrix products' fixed tile grid (768 rows per micro-batch: two row tiles, and K cut in
// three for the weight gradients), the optimizer. CTest runs this program under other
// OpenBLAS kernel sets too (tests/CMakeLists.txt).
#include "train_runs.h"

using namespace mt;
using namespace mt::test;

namespace {

class ThreadCounts : public ::testing::TestWithParam<std::string> {};

TEST_P(ThreadCounts, TrainingIsBitIdentical) {
  TempDir d;
  const std::string fam = GetParam();
  const std::string o = options(fam, 24, 12) + " --training.steps=3 --model.seq_len=64 --data.path=" +
                        write_tokens(d, "t.bin", 8000, 37);
  RunResult one = train_run(d, "t1", 1, o + " --training.threads=1");
  for (int threads : {2, 3}) {
    const std::string name = "t" + std::to_string(threads);
    expect_bit_identical(one, train_run(d, name, 1, o + " --training.threads=" + std::to_string(threads)),
                         fam + ": " + std::to_string(threads) + " threads against 1");
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ThreadCounts, ::testing::Values("gpt2", "llama"));

}  // namespace
