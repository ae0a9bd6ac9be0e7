// parallel.gpu_comm (comm/nccl_comm.h), what can be checked without a GPU: the choice each
// group makes from its ranks' GPUs (NCCL only when every rank has its own and NCCL loads;
// under `nccl` anything else is an error naming the ranks and what to change), and the
// configuration's refusals, and bench comm --device cuda. The NCCL collectives themselves
// are tested on GPUs (test_cuda_nccl.cpp, mpi_test_cuda_nccl.cpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "comm/nccl_comm.h"
#include "core/cuda.h"
#include "core/error.h"
#include "test_util.h"
#include "train/config.h"

using namespace mt;
using mt::test::error_of;

namespace {

TEST(GpuComm, NcclOnlyWhenEveryRankHasItsOwnGpu) {
  const std::vector<std::string> own{"GPU-aa", "GPU-bb", "GPU-cc", "GPU-dd"};
  for (const char* mode : {"auto", "nccl"}) {
    const GpuCommChoice c = choose_gpu_comm(mode, "dp", own, "2.28.9");
    EXPECT_TRUE(c.nccl) << mode;
    EXPECT_EQ(c.why, "NCCL 2.28.9");
  }

  const std::vector<std::string> shared{"GPU-aa", "GPU-bb", "GPU-cc", "GPU-bb"};
  const GpuCommChoice c = choose_gpu_comm("auto", "dp", shared, "2.28.9");
  EXPECT_FALSE(c.nccl);
  EXPECT_EQ(c.why, "through host memory: ranks 1 and 3 share one GPU (NCCL needs a GPU per rank)");
  const std::string e = error_of([&] { choose_gpu_comm("nccl", "dp", shared, "2.28.9"); });
  EXPECT_NE(e.find("parallel.gpu_comm = nccl, but in group 'dp' ranks 1 and 3 share one GPU"), std::string::npos) << e;
  EXPECT_NE(e.find("or set parallel.gpu_comm = auto"), std::string::npos) << e;

  // A rank that cannot load NCCL decides for the group (every rank sees the same list).
  const std::vector<std::string> missing{"GPU-aa", "!cannot load libnccl.so.2 (not found)"};
  const GpuCommChoice m = choose_gpu_comm("auto", "tp", missing, "2.28.9");
  EXPECT_FALSE(m.nccl);
  EXPECT_EQ(m.why, "through host memory: rank 1 cannot use NCCL: cannot load libnccl.so.2 (not found)");
  EXPECT_NE(error_of([&] { choose_gpu_comm("nccl", "tp", missing, "2.28.9"); })
                .find("in group 'tp' rank 1 cannot use NCCL: cannot load libnccl.so.2"),
            std::string::npos);
}

// The library loads without a GPU: the status is its version, or why it cannot be used.
TEST(GpuComm, NcclStatusIsAVersionOrAReason) {
  const std::string s = nccl_status();
  if (s.rfind('!', 0) == 0) {
    EXPECT_GT(s.size(), 10u) << s;
    if (!nccl_built()) EXPECT_NE(s.find("built without"), std::string::npos) << s;
    GTEST_SKIP() << "NCCL cannot be used here: " << s.substr(1);
  }
  EXPECT_TRUE(nccl_built());
  EXPECT_TRUE(std::regex_match(s, std::regex("2\\.[0-9]+\\.[0-9]+"))) << s;
}

TEST(GpuComm, ConfigurationRefusesWhatCannotRun) {
  Config c;
  c.parallel.gpu_comm = "nccl";  // on the CPU there are no GPU tensors to carry
  const std::string e = error_of([&] { c.validate(); });
  EXPECT_NE(e.find("parallel.gpu_comm = nccl carries GPU tensors between ranks, but training.device = cpu"),
            std::string::npos)
      << e;
  Config d;
  const std::string bad = error_of([&] { config_set(d, "parallel.gpu_comm", "mpi"); });
  EXPECT_NE(bad.find("parallel.gpu_comm"), std::string::npos) << bad;
  EXPECT_NE(bad.find("expected one of auto nccl host"), std::string::npos) << bad;
  config_set(d, "parallel.gpu_comm", "host");
  EXPECT_EQ(d.parallel.gpu_comm, "host");
}

// bench comm --device cuda carries GPU buffers as training does: two ranks on one GPU go
// through host memory and say so; without a GPU the command says what to use instead.
TEST(GpuComm, BenchCommOnGpuBuffersSaysHowTheyTravel) {
  std::string out;
  const int rc = mt::test::run_command(std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN +
                                           " launch -n 2 bench comm --device cuda --max-bytes 4K --iters 2",
                                       &out);
  if (cuda_device_count() == 0) {
    EXPECT_NE(rc, 0);
    EXPECT_NE(out.find("bench comm --device cuda: no GPU is visible here"), std::string::npos) << out;
    EXPECT_NE(out.find("use --device cpu"), std::string::npos) << out;
    return;
  }
  ASSERT_EQ(rc, 0) << out;
  if (!nccl_built())
    EXPECT_NE(out.find("dp (2 ranks) through host memory: rank 0 cannot use NCCL: this meshtrain was built without"),
              std::string::npos)
        << out;
  else if (cuda_device_count() == 1)
    EXPECT_NE(out.find("dp (2 ranks) through host memory: ranks 0 and 1 share one GPU"), std::string::npos) << out;
  EXPECT_NE(out.find("reduce_scatter"), std::string::npos) << out;
}

// training.device = cuda where a rank sees no GPU: every rank stops, said once (each rank
// said it inside Open MPI's MPI_ABORT banner, after the output directories were made).
TEST(GpuComm, TrainingOnCudaWithoutAGpuStopsOnceBeforeAnyFile) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible";
  mt::test::TempDir d;
  std::string out;
  EXPECT_EQ(mt::test::run_command(std::string("OMP_NUM_THREADS=1 ") + MESHTRAIN_BIN + " launch -n 2 train " +
                                      "--training.device=cuda --training.steps=1 --logging.metrics=" + d / "m/m.jsonl",
                                  &out), 1) << out;
  const bool built = cuda_built();
  EXPECT_NE(out.find(built ? "error: training.device = cuda, but no GPU is visible" : "built without CUDA"),
            std::string::npos) << out;
  EXPECT_EQ(out.find("error:"), out.rfind("error:")) << out;
  EXPECT_EQ(out.find("MPI_ABORT"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(d / "m")) << out;
}

}  // namespace
