// ZeRO stages 1-3 with training.device = cuda and two ranks sharing the GPU (collectives
// through host memory) against one rank on the GPU; a ZeRO-3 checkpoint written on the GPU
// that resumes bit-exactly on the GPU and carries on on the CPU at dp 1; SGD, LAMB and
// LARS on the GPU against the CPU and across layouts; 16-bit gradients; hierarchical
// reductions; and the shards' accumulation on the device against the host's, bit for bit.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/cuda.h"
#include "core/half.h"
#include "train_runs.h"

using namespace mt;

#if MESHTRAIN_CUDA

namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"

double rel_diff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double d = 0, m = 0;
  for (size_t u = 0; u < a.size() && u < b.size(); ++u)
    for (size_t i = 0; i < a[u].size() && i < b[u].size(); ++i)
      d = std::max(d, std::fabs((double)a[u][i] - b[u][i])), m = std::max(m, std::fabs((double)a[u][i]));
  return d / m;
}

// max over steps of |a - b| / |a|
double loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s) d = std::max(d, std::fabs(a[s] - b[s]) / std::fabs(a[s]));
  return d;
}

Tensor host_values(CpuAllocator& a, int64_t n, DType dt, int seed) {
  Tensor t = Tensor::empty({n}, dt, a, MemTag::grads);
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::sin(0.71f * i + seed) * static_cast<float>(1 + (i * 5 + seed) % 11);
    if (dt == DType::f32) t.f32()[i] = v;
    else t.data<uint16_t>()[i] = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
  return t;
}

// ZeRO's gradient shards add each micro-step's reduced gradient on the device (stages 2-3):
// the same rounding as the host's accumulate, bit for bit, for every pair of dtypes it takes.
TEST(CudaZero, AccumulateMatchesTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  CpuAllocator a;
  CudaAllocator g;
  const int64_t n = 70001;  // more than one block of the host's 16-bit path, not a multiple of it
  const std::pair<DType, DType> pairs[] = {{DType::f32, DType::f32},   {DType::bf16, DType::bf16},
                                           {DType::bf16, DType::f32},  {DType::f16, DType::f16},
                                           {DType::f16, DType::f32}};
  for (const auto& [to, from] : pairs) {
    const Tensor hd = host_values(a, n, to, 1), hs = host_values(a, n, from, 2);
    const Tensor dd = Tensor::empty({n}, to, g, MemTag::grads), ds = Tensor::empty({n}, from, g, MemTag::grads);
    dd.copy_from(hd);
    ds.copy_from(hs);
    accumulate(hd, hs);
    accumulate(dd, ds);
    const Tensor back = Tensor::empty({n}, to, a, MemTag::grads);
    back.copy_from(dd);
    EXPECT_EQ(std::memcmp(back.raw(), hd.raw(), hd.nbytes()), 0) << dtype_name(from) << " into " << dtype_name(to);
  }
}

class CudaZeroFamily : public ::testing::TestWithParam<std::string> {};

const std::string kClip = " --optim.grad_clip=0.05";  // small enough to clip: norms over shards matter

// Two ranks sharing the GPU at ZeRO stage s against one rank on the GPU, same global batch
// of 8: one rank accumulates four micro-batches of 2; each ZeRO rank four of 1, so stages
// 2-3 reduce-scatter on every micro-step and stage 3 gathers (and prefetches) every unit
// for each forward and backward. Every gradient element is then the same terms summed in
// another order. Tolerances, as for DDP on the GPU (tests/test_cuda_model.cpp,
// TwoRanksSharingTheGpuMatchOneRank): fp32, losses and parameters within 1e-5; bf16, 1e-4
// in loss and 3e-3 in parameters (a master weight that lands on the other side of a bf16
// rounding boundary moves its working copy by 2^-8, the bound tests/test_precision.cpp
// states for the CPU's layouts). fp32 also meets what tests/test_zero.cpp demands on the
// CPU (expect_equivalent: losses 1e-6, norms 1e-4, parameters by its first-order bound on
// rounding-level gradient differences), whose derivation does not depend on the device.
// gpt2 runs all three stages; llama stage 3 (the one that gathers parameters). Each run's
// memory per tag is the formulas' (activations kept in 16 bits under bf16, as on the CPU).
TEST_P(CudaZeroFamily, TwoRanksSharingTheGpuMatchOneRank) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string fam = GetParam();
  const std::string data = " --training.device=cuda --data.path=" + test::write_tokens(d, "t.bin", 3000, 37) + kClip;
  const std::vector<int> stages = fam == "gpt2" ? std::vector<int>{1, 2, 3} : std::vector<int>{3};
  for (const std::string precision : {"fp32", "bf16"}) {
    const std::string p = " --training.precision=" + precision;
    const test::RunResult one = test::train_run(d, "one_" + precision, 1, test::options(fam, 8, 2) + data + p);
    test::expect_memory_as_predicted(one, fam + " one rank " + precision);
    const bool fp32 = precision == "fp32";
    for (int stage : stages) {
      const std::string name = "z" + std::to_string(stage) + "_" + precision;
      const test::RunResult z =
          test::train_run(d, name, 2, test::options(fam, 8, 1) + data + p + " --parallel.dp=2 --parallel.zero=" +
                                          std::to_string(stage));
      ASSERT_EQ(z.loss.size(), one.loss.size()) << name << "\n" << z.output;
      EXPECT_LT(loss_diff(one.loss, z.loss), fp32 ? 1e-5 : 1e-4) << fam << " " << name;
      EXPECT_LT(rel_diff(one.units, z.units), fp32 ? 1e-5 : 3e-3) << fam << " " << name;
      if (fp32) test::expect_equivalent(one, z, fam + " " + name);
      test::expect_memory_as_predicted(z, fam + " " + name);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaZeroFamily, ::testing::Values("gpt2", "llama"));

// SGD, LAMB and LARS on the GPU (the kernels of ops/cuda/loss_optim.cu): one rank on the GPU
// against one on the CPU (the bound of the GPU-against-CPU runs of tests/test_cuda_model.cpp,
// 1e-4: the same updates with float sums in other orders), and LAMB / LARS at dp 2 with
// ZeRO 3 and tp 2 sharing the GPU against one rank on it, where each tensor's trust ratio
// needs the norms summed over the ranks holding its pieces (1e-4, the bound the same layouts
// meet on the CPU, tests/test_lamb_lars.cpp). LAMB
// at lr 0.02 moves each matrix by ~2% of its norm per step, LARS at lr 0.5 with trust_coef
// 0.02 by ~1% (tests/test_lamb_lars.cpp): a missing or misordered sum is far outside.
TEST(CudaZero, SgdLambLarsMatchTheCpuAndOneRank) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string data = " --data.path=" + test::write_tokens(d, "t.bin", 3000, 37) + kClip;
  for (const std::string name : {"sgd", "lamb", "lars"}) {
    const std::string fam = name == "lars" ? "llama" : "gpt2";
    std::string o = data + " --optim.name=" + name;
    o += name == "lars"  ? " --optim.lr=0.5 --optim.trust_coef=0.02"
         : name == "sgd" ? " --optim.lr=0.1"
                         : " --optim.lr=0.02";
    const std::string gpu = o + " --training.device=cuda";
    const test::RunResult cpu = test::train_run(d, name + "_cpu", 1, test::options(fam, 8, 2) + o);
    const test::RunResult one = test::train_run(d, name + "_one", 1, test::options(fam, 8, 2) + gpu);
    ASSERT_EQ(one.loss.size(), cpu.loss.size()) << name << "\n" << one.output;
    EXPECT_LT(loss_diff(cpu.loss, one.loss), 1e-4) << name << " on the GPU against the CPU";
    EXPECT_LT(rel_diff(cpu.units, one.units), 1e-4) << name << " on the GPU against the CPU";
    if (name == "sgd") continue;
    for (const std::string layout : {" --parallel.dp=2 --parallel.zero=3", " --parallel.tp=2"}) {
      const test::RunResult r = test::train_run(d, name + "_layout", 2, test::options(fam, 8, 1) + gpu + layout);
      ASSERT_EQ(r.loss.size(), one.loss.size()) << name << layout << "\n" << r.output;
      EXPECT_LT(loss_diff(one.loss, r.loss), 1e-4) << name << layout;
      EXPECT_LT(rel_diff(one.units, r.units), 1e-4) << name << layout;
      std::filesystem::remove_all(d / (name + "_layout"));
      std::filesystem::remove(d / (name + "_layout.jsonl"));
    }
  }
}

// parallel.hierarchical with four ranks sharing the GPU as two nodes of two: the by-node
// all-reduce (DDP) and reduce-scatter (ZeRO 2) stage the GPU tensors through host memory
// as the flat ones do and sum every element in rank order, so the runs equal their flat
// twins bit for bit, as on the CPU (tests/test_comm_reduce.cpp).
TEST(CudaZero, HierarchicalTrainsTheFlatRunBitForBit) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string o = test::options("llama", 8, 1) + " --training.device=cuda --parallel.ranks_per_node=2" +
                        " --parallel.bucket_mb=0.02 --data.path=" + test::write_tokens(d, "t.bin", 3000, 37);
  for (const std::string zero : {"0", "2"}) {
    const std::string c = o + " --parallel.zero=" + zero;
    const test::RunResult flat = test::train_run(d, "flat" + zero, 4, c);
    const test::RunResult hier = test::train_run(d, "hier" + zero, 4, c + " --parallel.hierarchical=true");
    test::expect_bit_identical(flat, hier, "hierarchical on the GPU, zero " + zero);
  }
}

// training.grad_dtype = bf16 on the GPU: each unit's fp32 gradient added into the bf16 one
// on the device (cuda_accumulate, bit for bit the host's rounding), the optimizer widening
// them into its GPU scratch, the norm read from 16 bits. The CPU's bounds
// (tests/test_precision.cpp): against fp32 gradients 1e-3 in loss; dp 2 (DDP with a bf16
// all-reduce, ZeRO 2) against one rank with bf16 gradients 1e-4 in loss and 1e-2 in
// parameters; the model state the formula's 2 + 2 + 12 bytes per parameter.
TEST(CudaZero, Bf16GradientsTrainWhatOneRankTrains) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string rest = " --training.device=cuda --training.precision=bf16 --data.path=" +
                           test::write_tokens(d, "t.bin", 3000, 37) + kClip;
  const std::string g16 = " --training.grad_dtype=bf16";
  const test::RunResult f32g = test::train_run(d, "f32g", 1, test::options("gpt2", 8, 2) + rest);
  const test::RunResult one = test::train_run(d, "g16", 1, test::options("gpt2", 8, 2) + rest + g16);
  ASSERT_EQ(one.loss.size(), f32g.loss.size()) << one.output;
  EXPECT_LT(loss_diff(f32g.loss, one.loss), 1e-3);
  EXPECT_EQ(2 * one.summary["mem_grads"].get<double>(), f32g.summary["mem_grads"].get<double>());
  EXPECT_EQ(one.summary["mem_model_state"].get<double>(), one.summary["mem_model_state_predicted"].get<double>());
  EXPECT_NE(one.output.find("2 + 2 + 12 bytes per parameter"), std::string::npos) << one.output;
  for (const std::string layout : {" --parallel.grad_comm_dtype=bf16", " --parallel.zero=2"}) {
    const test::RunResult r =
        test::train_run(d, "g16_dp2", 2, test::options("gpt2", 8, 1) + rest + g16 + " --parallel.dp=2" + layout);
    ASSERT_EQ(r.loss.size(), one.loss.size()) << layout << "\n" << r.output;
    EXPECT_LT(loss_diff(one.loss, r.loss), 1e-4) << layout;
    EXPECT_LT(rel_diff(one.units, r.units), 1e-2) << layout;
    EXPECT_EQ(r.summary["mem_model_state"].get<double>(), r.summary["mem_model_state_predicted"].get<double>())
        << layout;
    std::filesystem::remove_all(d / "g16_dp2");
    std::filesystem::remove(d / "g16_dp2.jsonl");
  }
}

// fp32 gradients reduced in bf16 under ZeRO on the GPU (parallel.grad_comm_dtype): each
// unit's gradient rounded on the device, the reduced 16-bit chunk widened into the fp32
// shard there (cuda_accumulate). The CPU's bounds (tests/test_precision.cpp,
// ZeroReducesFp32GradientsIn16Bits): 1e-4 in loss and 1e-2 in parameters against one rank.
TEST(CudaZero, Fp32GradientsReducedInBf16TrainWhatOneRankTrains) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string rest = " --training.device=cuda --training.precision=bf16 --data.path=" +
                           test::write_tokens(d, "t.bin", 3000, 37) + kClip;
  const test::RunResult one = test::train_run(d, "one", 1, test::options("gpt2", 8, 2) + rest);
  for (const std::string zero : {"1", "2", "3"}) {
    const test::RunResult r = test::train_run(d, "c16_zero" + zero, 2, test::options("gpt2", 8, 1) + rest +
                                                   " --parallel.dp=2 --parallel.grad_comm_dtype=bf16 --parallel.zero=" + zero);
    ASSERT_EQ(r.loss.size(), one.loss.size()) << zero << "\n" << r.output;
    EXPECT_NE(r.output.find("fp32 gradients reduced in bf16"), std::string::npos) << r.output;
    EXPECT_LT(loss_diff(one.loss, r.loss), 1e-4) << "zero " << zero;
    EXPECT_LT(rel_diff(one.units, r.units), 1e-2) << "zero " << zero;
    EXPECT_EQ(r.summary["mem_model_state"].get<double>(), r.summary["mem_model_state_predicted"].get<double>()) << zero;
  }
}

// fp16 gradients on the GPU keep fp16's range: exactly the steps with an injected overflow
// (rank 1 of dp 2, DDP reducing fp16 in place) are skipped on both ranks, the scale halving
// at each and doubling after 3 clean steps (tests/test_precision.cpp on the CPU).
TEST(CudaZero, Fp16GradientsSkipExactlyTheOverflowingSteps) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string o = test::options("gpt2", 8, 1) + " --training.device=cuda --training.precision=fp16" +
                        " --training.grad_dtype=fp16 --parallel.grad_comm_dtype=fp16 --training.steps=8" +
                        " --parallel.dp=2 --optim.loss_scale=4096 --optim.loss_scale_window=3 --data.path=" +
                        test::write_tokens(d, "t.bin", 3000, 37);
  const test::RunResult r = test::train_run(d, "injected", 2, o + " --parallel.test_fault=overflow:1:2,5");
  const std::vector<nlohmann::json> st = test::steps_of(d, "injected");
  ASSERT_EQ(st.size(), 8u) << r.output;
  test::expect_skips_the_injected_overflows(r, st);
}

// ZeRO composed with the other axes, four ranks sharing the GPU, against one rank on the
// GPU (llama, fp32): tp 2 x dp 2 at ZeRO 1, pp 2 x dp 2 at ZeRO 3 (1f1b: each unit gathered
// once per step) and cp 2 x dp 2 at ZeRO 2 (the shard group spans dp x cp). The same terms
// summed in other orders: the bounds of the dp-only runs above.
TEST(CudaZero, ComposedLayoutsMatchOneRank) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string dev = " --training.device=cuda --data.path=" + test::write_tokens(d, "t.bin", 3000, 37) + kClip;
  const std::string o = test::options("llama", 8, 1) + dev;
  const test::RunResult one = test::train_run(d, "one", 1, test::options("llama", 8, 2) + dev);
  for (const std::string layout : {" --parallel.tp=2 --parallel.zero=1", " --parallel.pp=2 --parallel.zero=3",
                                   " --parallel.cp=2 --parallel.zero=2"}) {
    const test::RunResult r = test::train_run(d, "composed", 4, o + " --parallel.dp=2" + layout);
    ASSERT_EQ(r.loss.size(), one.loss.size()) << layout << "\n" << r.output;
    EXPECT_LT(loss_diff(one.loss, r.loss), 1e-5) << layout;
    EXPECT_LT(rel_diff(one.units, r.units), 1e-5) << layout;
    test::expect_equivalent(one, r, "llama" + layout);
    std::filesystem::remove_all(d / "composed");
    std::filesystem::remove(d / "composed.jsonl");
  }
}

// A ZeRO-3 checkpoint written by two ranks sharing the GPU (each saving its chunks from
// device memory through host copies): resumed at the same layout it continues bit for bit
// as the uninterrupted run (the GPU run is deterministic and the checkpoint holds every
// shard's exact state); resumed on the CPU by one rank without ZeRO, the losses follow the
// uninterrupted GPU run's within 1e-4 (the bound the GPU-against-CPU runs of
// tests/test_cuda_model.cpp meet: the same model, float sums in other orders).
TEST(CudaZero, Stage3CheckpointResumesOnTheGpuAndOnTheCpu) {
  SKIP_WITHOUT_GPU();
  test::TempDir d;
  const std::string o = test::options("llama", 8, 0) + " --optim.schedule=constant --data.path=" +
                        test::write_tokens(d, "t.bin", 3000, 37);
  const std::string z3 = " --training.device=cuda --parallel.dp=2 --parallel.zero=3";
  const test::RunResult straight = test::train_run(d, "straight", 2, o + z3);
  ASSERT_EQ(straight.loss.size(), 6u) << straight.output;
  test::train_run(d, "split", 2, o + z3 + " --training.steps=3");
  std::filesystem::copy(d / "split", d / "to_cpu", std::filesystem::copy_options::recursive);

  const test::RunResult same = test::train_run(d, "split", 2, o + z3 + " --checkpoint.resume=true");
  test::expect_bit_identical(straight, same, "resumed at ZeRO 3, dp 2, on the GPU");

  const test::RunResult cpu = test::train_run(d, "to_cpu", 1, o + " --checkpoint.resume=true");
  ASSERT_EQ(cpu.loss.size(), 3u) << cpu.output;  // to_cpu.jsonl holds the resumed steps alone
  const std::vector<double> tail(straight.loss.begin() + 3, straight.loss.end());
  EXPECT_LT(loss_diff(tail, cpu.loss), 1e-4);
}

}  // namespace

#else

TEST(CudaZero, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
