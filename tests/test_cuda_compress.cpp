// Gradient compression (parallel.grad_compression) with training.device = cuda: int8's and
// PowerSGD's arithmetic runs on the host, over gradients copied there and back, with the
// buffers, residuals and factors in host memory (compression_alloc, parallel/compress.h).
// - Each layout tracks its uncompressed twin on the GPU within the bands the CPU runs meet
//   (tests/test_comm_reduce.cpp, tests/test_compress_zero.cpp: int8 1e-2, PowerSGD 0.2
//   relative in loss over 40 steps of the built-in tasks), learns, and differs somewhere;
// - stopped after 3 of 6 steps and resumed, a compressed GPU run continues bit for bit (the
//   residuals and warm-start factors, host tensors on a GPU run, go through the checkpoint).
// Ranks share the GPU; skipped without one.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "train_runs.h"

using namespace mt;

#if MESHTRAIN_CUDA

TEST(CudaCompress, TracksTheUncompressedRunOnTheGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  test::TempDir d;
  const std::string o = test::compression_tasks(40) + " --training.device=cuda";
  struct Case {
    std::string name;  // of the layout
    int ranks;
    std::string layout, kind;
  };
  const std::vector<Case> cases = {
      {"ddp", 2, " --parallel.dp=2", "int8"},
      {"ddp", 2, " --parallel.dp=2", "powersgd"},
      {"zero1", 2, " --parallel.dp=2 --parallel.zero=1", "int8"},
      {"zero3", 2, " --parallel.dp=2 --parallel.zero=3", "powersgd"},
      {"zero2_bf16_grads", 2,
       " --parallel.dp=2 --parallel.zero=2 --training.precision=bf16 --training.grad_dtype=bf16", "int8"},
      {"hybrid_zero2", 4, " --parallel.dp=4 --parallel.zero=2 --parallel.shard_group=2 --parallel.ranks_per_node=2",
       "int8"},
      {"ddp_by_node", 4, " --parallel.dp=4 --parallel.ranks_per_node=2 --parallel.hierarchical=true", "int8"},
  };
  std::map<std::string, test::RunResult> plain;  // the uncompressed run of each layout
  for (const Case& c : cases) {
    SCOPED_TRACE(c.kind + " " + c.name);
    if (!plain.count(c.name)) plain[c.name] = test::train_run(d, c.name + "_plain", c.ranks, o + c.layout);
    const test::RunResult run =
        test::train_run(d, c.name + "_" + c.kind, c.ranks, o + c.layout + " --parallel.grad_compression=" + c.kind);
    test::expect_tracks_uncompressed(plain[c.name], run, 40, c.kind == "int8" ? 1e-2 : 0.2,
                                     c.kind + " " + c.name + " on the GPU");
  }
}

TEST(CudaCompress, ResumedRunContinuesBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  for (const std::string layout : {" --parallel.grad_compression=int8",
                                   " --parallel.grad_compression=powersgd --parallel.zero=1"}) {
    SCOPED_TRACE(layout);
    test::TempDir d;
    const std::string o = test::compression_tasks(6) + " --training.device=cuda --parallel.dp=2" + layout;
    const test::RunResult straight = test::train_run(d, "straight", 2, o);
    ASSERT_EQ(straight.loss.size(), 6u) << straight.output;
    test::train_run(d, "split", 2, o + " --training.steps=3");
    std::filesystem::remove(d / "split.jsonl");
    const test::RunResult resumed = test::train_run(d, "split", 2, o + " --checkpoint.resume=true");
    ASSERT_EQ(resumed.loss.size(), 3u) << resumed.output;
    EXPECT_EQ(resumed.loss, std::vector<double>(straight.loss.begin() + 3, straight.loss.end()));
    EXPECT_EQ(resumed.units, straight.units);
  }
}

#else
TEST(CudaCompress, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif
