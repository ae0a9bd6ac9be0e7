// Pipeline parallelism on the GPU: whole training runs (meshtrain launch) with the pipeline
// ranks sharing one GPU (activations and gradients between stages through host memory),
// against one rank on the GPU reading the same global batch. Llama (untied head): 1f1b,
// zb-h1 (split backward), interleaved (two chunks per rank) in fp32, 1f1b in bf16, and
// pp 2 x dp 2 (DDP); GPT-2 (tied head): 1f1b (the embedding's two copies on two ranks) and
// zbv (both on one rank, with the activation passed between its own chunks). Skipped
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/cuda.h"
#include "train_runs.h"

using namespace mt;

#if MESHTRAIN_CUDA

namespace {

// Runs of 4 blocks (pp 2 with two chunks per rank has a block per stage), 4 sequences of 16
// per step, micro-batches of 1 (m = 4 per pipeline), gradient clipping active (the norm must
// count each element once over the stages), on the GPU.
std::string gpu_options(const std::string& family, const std::string& data, const std::string& precision) {
  return test::options(family, 4, 1) + " --model.n_layer=4 --optim.grad_clip=0.05 --training.device=cuda" +
         " --training.precision=" + precision + " --data.path=" + data;
}

// A run of `ranks` processes sharing the GPU, checked to have run on it with the schedule asked.
test::RunResult gpu_run(const test::TempDir& d, const std::string& name, int ranks, const std::string& opts,
                        const std::string& schedule) {
  test::RunResult r = test::train_run(d, name, ranks, opts);
  EXPECT_NE(r.output.find("(training.device = cuda)"), std::string::npos) << name << "\n" << r.output;
  if (!schedule.empty())
    EXPECT_NE(r.output.find("pipeline: " + schedule + ", 2 ranks"), std::string::npos) << name << "\n" << r.output;
  return r;
}

// max over steps of |a - b| / |a|
double loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s) d = std::max(d, std::fabs(a[s] - b[s]) / std::fabs(a[s]));
  return d;
}

// max |a - b| over all parameters / max |a|
double param_diff(const test::RunResult& a, const test::RunResult& b) {
  double d = 0, m = 0;
  for (size_t u = 0; u < a.units.size() && u < b.units.size(); ++u)
    for (size_t i = 0; i < a.units[u].size() && i < b.units[u].size(); ++i) {
      d = std::max(d, std::fabs(double(a.units[u][i]) - b.units[u][i]));
      m = std::max(m, std::fabs(double(a.units[u][i])));
    }
  return d / m;
}

// A layout that sums some terms in another order than one rank: the bounds of the DDP test
// on the GPU (test_cuda_model.cpp, TwoRanksSharingTheGpuMatchOneRank): fp32 1e-5 in loss
// and parameters; bf16 the CPU layouts' bounds (test_precision.cpp: a master weight that
// lands on the other side of a bf16 rounding boundary moves its working copy by 2^-8), 1e-4
// and 3e-3.
void expect_close(const test::RunResult& one, const test::RunResult& r, bool fp32, const std::string& what) {
  ASSERT_EQ(r.loss.size(), one.loss.size()) << what << "\n" << r.output;
  ASSERT_EQ(r.units.size(), one.units.size()) << what;
  EXPECT_LT(loss_diff(one.loss, r.loss), fp32 ? 1e-5 : 1e-4) << what;
  EXPECT_LT(param_diff(one, r), fp32 ? 1e-5 : 3e-3) << what;
}

}  // namespace

// An untied model's pipeline changes no sum (as on the CPU, tests/test_pipeline.cpp): each
// micro-batch's forward and backward runs the same kernels on the same shapes as one rank,
// every unit's gradient accumulates the micro-batches in the same order, the gradient norm
// adds the units' fixed-grid sums of squares in unit order, and the loss adds the same
// per-micro-batch sums in the same order. The matrix products run the same cuBLASLt
// algorithms too: the algorithm is chosen by shape and pointer alignment (ops/cuda/linear.cu),
// and every tensor here starts 256-byte aligned in every layout (separate allocations, and
// this Llama's units are multiples of 64 floats: blocks 12352, head 1216, embedding 1184
// last in the gradient buffer). So the runs are one rank's, bit for bit; in bf16 too (the
// same 16-bit roundings of the same values).
TEST(CudaPipeline, UntiedPipelinesEqualOneRankBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  test::TempDir d;
  const std::string data = test::write_tokens(d, "t.bin", 3000, 37);
  const std::string fp32 = gpu_options("llama", data, "fp32"), bf16 = gpu_options("llama", data, "bf16");
  const test::RunResult one = gpu_run(d, "one", 1, fp32, "");
  const std::vector<Unit> units = model_layout(one.model);  // the alignment the bits rely on
  for (size_t u = 1; u < units.size(); ++u) ASSERT_EQ(units[u].global_numel % 64, 0) << units[u].name;
  for (const std::string schedule : {"1f1b", "zb-h1", "interleaved"}) {
    const test::RunResult r =
        gpu_run(d, "pp2_" + schedule, 2, fp32 + " --parallel.pp=2 --parallel.pp_schedule=" + schedule, schedule);
    test::expect_bit_identical(one, r, "llama fp32 pp 2 " + schedule);
  }
  const test::RunResult one_bf16 = gpu_run(d, "one_bf16", 1, bf16, "");
  const test::RunResult pp_bf16 = gpu_run(d, "pp2_bf16", 2, bf16 + " --parallel.pp=2 --parallel.pp_schedule=1f1b", "1f1b");
  test::expect_bit_identical(one_bf16, pp_bf16, "llama bf16 pp 2 1f1b");

  // pp 2 x dp 2 (DDP, 4 ranks): each data-parallel rank accumulates its two micro-batches,
  // then the ranks add each other's sums through host memory: another order.
  const test::RunResult ddp = gpu_run(d, "pp2dp2", 4, fp32 + " --parallel.pp=2 --parallel.pp_schedule=1f1b", "1f1b");
  expect_close(one, ddp, true, "llama fp32 pp 2 x dp 2");
}

// A tied head: the embedding's gradient on one rank adds the head's and the lookup's terms
// micro-batch by micro-batch; at 1f1b over two ranks the first stage sums the lookup's terms,
// the last the head's, and the pair adds the two sums (host memory); at zbv both copies are
// rank 0's, accumulated in zbv's order of backwards. Another order in both: expect_close.
// The last stage's copy is not counted in the gradient norm again (its replicated range).
TEST(CudaPipeline, TiedPipelinesTrackOneRank) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  test::TempDir d;
  const std::string fp32 = gpu_options("gpt2", test::write_tokens(d, "t.bin", 3000, 37), "fp32");
  const test::RunResult one = gpu_run(d, "one", 1, fp32, "");
  for (const std::string schedule : {"1f1b", "zbv"}) {
    const test::RunResult r =
        gpu_run(d, "pp2_" + schedule, 2, fp32 + " --parallel.pp=2 --parallel.pp_schedule=" + schedule, schedule);
    expect_close(one, r, true, "gpt2 fp32 pp 2 " + schedule);
    ASSERT_EQ(r.grad_norm.size(), one.grad_norm.size()) << schedule;
    for (size_t s = 0; s < one.grad_norm.size(); ++s)  // expect_equivalent's bound (train_runs.h)
      EXPECT_NEAR(r.grad_norm[s], one.grad_norm[s], 1e-4 * one.grad_norm[s]) << schedule << " step " << s;
  }
}

#else

TEST(CudaPipeline, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
