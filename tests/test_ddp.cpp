// Data parallelism against the single-rank run, through the command (meshtrain launch ->
// mpirun): dp 1, 2, 4, with and without gradient accumulation, both families; bucketing
// and overlap bit-exact; bf16 reduction close; checkpoints that resume at another dp.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "nn/model.h"
#include "train/checkpoint.h"
#include "test_util.h"

using namespace mt;

namespace {

struct RunResult {
  std::vector<double> loss, grad_norm;
  std::vector<std::vector<float>> units;  // final parameters per unit
  ModelConfig model;
};

// Trains with `ranks` ranks (1: a plain process) and reads back metrics and the final checkpoint.
RunResult train_run(const test::TempDir& d, const std::string& name, int ranks, const std::string& opts) {
  const std::string bin = MESHTRAIN_BIN;
  const std::string cmd = "OMP_NUM_THREADS=1 " + bin + (ranks > 1 ? " launch -n " + std::to_string(ranks) : "") +
                          " train " + opts + " --logging.progress=off --logging.metrics=" + d / (name + ".jsonl") +
                          " --checkpoint.dir=" + d / name;
  std::string out;
  int rc = test::run_command(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  RunResult r;
  for (const std::string& l : test::read_lines(d / (name + ".jsonl"))) {
    auto j = nlohmann::json::parse(l);
    if (j.contains("event")) continue;
    r.loss.push_back(j["loss"]);
    r.grad_norm.push_back(j["grad_norm"]);
  }
  const std::string dir = checkpoint_latest(d / name);
  if (dir.empty()) return r;
  r.model = checkpoint_config(dir).model;
  std::vector<Unit> units = model_layout(r.model);
  CpuAllocator alloc;
  for (Unit& u : units) u.w = Tensor::empty({u.numel}, DType::f32, alloc, MemTag::params);
  checkpoint_load(dir, r.model, checkpoint_param_slices(units));
  for (Unit& u : units) r.units.emplace_back(u.w.f32(), u.w.f32() + u.numel);
  return r;
}

std::string options(const std::string& family, int global, int micro) {
  std::string o = "--model.family=" + family + " --model.n_layer=2 --model.n_head=4 --model.d_model=32 " +
                  "--model.vocab_size=37 --model.seq_len=16 --training.steps=6 --training.val_every=0 " +
                  "--optim.warmup_steps=0 --optim.lr=3e-3 --training.global_batch=" + std::to_string(global);
  if (family == "llama") o += " --model.n_kv_head=2";
  if (micro) o += " --training.micro_batch=" + std::to_string(micro);
  return o;
}

// Tolerances against the single-rank run. The ranks' gradients are summed in another
// order than one process accumulates them (different micro-batch rows per GEMM), so they
// agree to float rounding (~1e-7 relative), which Adam's normalised steps carry into the
// parameters at about lr x 1e-4 after a few steps. Losses: 1e-6 relative. Parameters:
// 1e-4 of each unit's largest magnitude. (GPT-2's key bias has an exactly-zero true
// gradient, so Adam turns its rounding noise into +-lr steps in any two runs that round
// differently; it gets the bound 3 lr steps.)
void expect_equivalent(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.loss.size(), b.loss.size()) << what;
  for (size_t s = 0; s < a.loss.size(); ++s) {
    EXPECT_NEAR(a.loss[s], b.loss[s], 1e-6 * std::fabs(a.loss[s])) << what << " step " << s;
    EXPECT_NEAR(a.grad_norm[s], b.grad_norm[s], 1e-4 * std::fabs(a.grad_norm[s])) << what << " step " << s;
  }
  ASSERT_EQ(a.units.size(), b.units.size()) << what;
  std::vector<Unit> layout = model_layout(a.model);
  for (size_t u = 0; u < a.units.size(); ++u) {
    float scale = 0;
    for (float x : a.units[u]) scale = std::max(scale, std::fabs(x));
    for (const ParamSpec& p : layout[u].params) {
      const bool key_bias = p.name.find("c_attn.bias") != std::string::npos;
      const int64_t C = a.model.d_model;
      for (int64_t i = 0; i < p.numel(); ++i) {
        const float x = a.units[u][p.offset + i], y = b.units[u][p.offset + i];
        const float tol = key_bias && i >= C && i < 2 * C ? 3 * 3e-3f * 6 : 1e-4f * scale;
        ASSERT_NEAR(x, y, tol) << what << " " << p.name << "[" << i << "]";
      }
    }
  }
}

void expect_bit_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  EXPECT_EQ(a.units, b.units) << what;
}

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
    RunResult small = train_run(d, "small", dp, o + " --parallel.bucket_mb=0.0001");
    RunResult big = train_run(d, "big", dp, o + " --parallel.bucket_mb=1000");
    RunResult late = train_run(d, "late", dp, o + " --parallel.overlap=false");
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
