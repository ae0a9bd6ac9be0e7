// Training as a whole: configuration errors, data loading, optimizer formulas, schedules,
// resume bit-exactness and checkpoint integrity (the command's own: test_command.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/train_data.h"
#include "train/trainer.h"
#include "test_util.h"
#include "train_runs.h"

using namespace mt;
using test::error_of;
namespace fs = std::filesystem;

namespace {

TEST(Config, DefaultsValidateAndRoundTripThroughJson) {
  Config c = config_load("", {});
  Config back = config_from_json(config_to_json(c));
  EXPECT_EQ(config_to_json(back), config_to_json(c));
  EXPECT_TRUE(c.model.tied());
  config_set(c, "model.family", "llama");
  EXPECT_FALSE(c.model.tied());
}

TEST(Config, TomlThenOverrides) {
  test::TempDir d;
  std::ofstream(d / "c.toml") << "[model]\nfamily = \"llama\"\nn_layer = 3\nnorm_eps = 1e-6\n"
                                 "[training]\nsteps = 7\nrecompute = true\n[optim]\nlr = 0.5\n";
  Config c = config_load(d / "c.toml", {"training.steps=9", "optim.schedule=linear"});
  EXPECT_EQ(c.model.family, "llama");
  EXPECT_EQ(c.model.n_layer, 3);
  EXPECT_FLOAT_EQ(c.model.norm_eps, 1e-6f);
  EXPECT_EQ(c.training.steps, 9);
  EXPECT_TRUE(c.training.recompute);
  EXPECT_EQ(c.training.recomputed(), Recompute{Recompute::kAll});
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.5);
  EXPECT_EQ(c.optim.schedule, "linear");
}

// The list-valued keys take TOML arrays as well as "a,b" strings; other arrays are refused,
// naming the key and the forms it takes.
TEST(Config, ListKeysTakeTomlArrays) {
  test::TempDir d;
  std::ofstream(d / "c.toml") << "[parallel]\npp = 2\npp_layers = [3, 1]\n"
                                 "[checkpoint]\nallow_change = [\"optim.lr\", \"data.path\"]\n";
  Config c = config_load(d / "c.toml", {});
  EXPECT_EQ(c.parallel.pp_layers, "3,1");
  EXPECT_EQ(c.checkpoint.allow_change, "optim.lr,data.path");
  const auto refused = [&](const std::string& toml) {
    std::ofstream(d / "bad.toml") << toml;
    return error_of([&] { config_load(d / "bad.toml", {}); });
  };
  EXPECT_NE(refused("[parallel]\npp_layers = [1.5, 2]\n")
                .find("bad value for parallel.pp_layers in the config file: a list of strings or integers, e.g. [2, 1]"),
            std::string::npos);
  EXPECT_NE(refused("[parallel]\npp_layers = [[1], [2]]\n").find("a list of strings or integers"), std::string::npos);
  EXPECT_NE(refused("[model]\nn_layer = [1, 2]\n")
                .find("bad value for model.n_layer in the config file: expected a string, number or boolean"),
            std::string::npos);
  EXPECT_NE(refused("[parallel]\npp_layers = {a = 1}\n").find("or a list of strings or integers"), std::string::npos);
}

// training.recompute_blocks picks the first blocks of each chunk; alone, or negative, or with
// a split backward, it is refused by name.
TEST(Config, RecomputeBlocks) {
  EXPECT_EQ(config_load("", {}).training.recomputed(), Recompute{});
  EXPECT_EQ(config_load("", {"training.recompute=true", "training.recompute_blocks=2"}).training.recomputed(),
            Recompute{2});
  EXPECT_NE(error_of([] { config_load("", {"training.recompute_blocks=2"}); })
                .find("training.recompute_blocks = 2 names the blocks that recompute, but training.recompute is "
                      "false; set recompute = true too, or recompute_blocks = 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"training.recompute=true", "training.recompute_blocks=-1"}); })
                .find("training.recompute_blocks = -1 must not be negative (0: every block)"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              config_load("", {"training.recompute=true", "training.recompute_blocks=1", "parallel.pp=2",
                               "parallel.pp_schedule=zbv"});
            }).find("use 1f1b or interleaved, or recompute=false"),
            std::string::npos);
}

TEST(Config, ErrorsNameTheKeyAndTheFix) {
  EXPECT_NE(error_of([] { config_load("", {"training.stpes=3"}); }).find("did you mean training.steps"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"model.family=bert"}); }).find("gpt2 llama"), std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"training.steps=many"}); }).find("an integer"), std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"data.shuffle=maybe"}); }).find("true or false"), std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"training.global_batch=10", "training.micro_batch=4"}); })
                .find("not a multiple of training.micro_batch"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("", {"model.d_model=130"}); }).find("not divisible by model.n_head"),
            std::string::npos);
  EXPECT_NE(error_of([] { config_load("/nonexistent.toml", {}); }).find("/nonexistent.toml"), std::string::npos);
  test::TempDir d;
  std::ofstream(d / "bad.toml") << "[model]\nfamly = \"gpt2\"\n";
  EXPECT_NE(error_of([&] { config_load(d / "bad.toml", {}); }).find("model.family"), std::string::npos);
}

// Integers outside the field's type are refused with the range (not wrapped: 4294967297
// layers was 1), numbers must be finite, a --config that is a directory is no config, and
// d_model = 0 is named as too small rather than as indivisible.
TEST(Config, RangesFiniteNumbersAndConfigFile) {
  auto err = [](std::vector<std::string> o) { return error_of([&] { config_load("", o); }); };
  std::string e = err({"model.n_layer=4294967297"});
  EXPECT_NE(e.find("value 4294967297 for model.n_layer is out of range: it must be an integer from -2147483648 to "
                   "2147483647"), std::string::npos) << e;
  EXPECT_NE(err({"model.n_layer=2147483648"}).find("out of range"), std::string::npos);
  EXPECT_NE(err({"training.steps=99999999999999999999"}).find("for training.steps is out of range"), std::string::npos);
  EXPECT_NE(err({"training.seed=-1"}).find("training.seed is out of range: it must be an integer from 0 to "
                                           "18446744073709551615"), std::string::npos);
  EXPECT_EQ(config_load("", {"training.seed=18446744073709551615", "model.n_layer=+3"}).training.seed,
            18446744073709551615ull);
  EXPECT_NE(err({"model.n_layer=3x"}).find("expected an integer"), std::string::npos);
  for (const char* o : {"optim.lr=nan", "optim.lr=inf", "optim.grad_clip=-inf", "parallel.timeout_s=nan",
                        "model.norm_eps=1e300"}) {
    e = err({o});
    EXPECT_NE(e.find("expected a finite number"), std::string::npos) << o << ": " << e;
  }
  e = err({"model.d_model=0"});
  EXPECT_NE(e.find("model.d_model = 0 must be from 1 to 1048576"), std::string::npos) << e;
  // Past any model trained: the pipeline's loop over 2^31 layers ran for minutes, 100000
  // OpenMP threads overflowed the stack.
  for (const auto& [o, want] : std::vector<std::pair<std::string, std::string>>{
           {"model.n_layer=2147483647", "model.n_layer = 2147483647 must be from 1 to 65536"},
           {"model.seq_len=16777217", "model.seq_len = 16777217 must be from 1 to 16777216"},
           {"training.threads=100000", "training.threads = 100000 must be from 0 (all cores) to 4096"}}) {
    e = err({o});
    EXPECT_NE(e.find(want), std::string::npos) << o << ": " << e;
  }
  test::TempDir d;
  e = error_of([&] { config_load(d.path, {}); });
  EXPECT_NE(e.find("--config " + d.path + " is not a regular file"), std::string::npos) << e;
  std::ofstream(d / "c.toml") << "[optim]\nlr = nan\n";
  EXPECT_NE(error_of([&] { config_load(d / "c.toml", {}); }).find("optim.lr: expected a finite"), std::string::npos);
}

// The validation file's errors name data.val_path (they all said data.path); data too short
// for one sequence of seq_len + 1 tokens, for training or validation, is refused by key
// with the count (it trained, or silently ran no validation); val_fraction beside a
// val_path, or without a data.path, is refused.
TEST(DataLoad, UnusableDataIsRefusedByKey) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 400, 37));  // seq_len 9
  std::string e;
  auto expect = [&](const std::string& want) { EXPECT_NE(e.find(want), std::string::npos) << want << "\n" << e; };
  c.data.val_fraction = 0;
  c.data.val_path = d / "missing.bin";
  e = error_of([&] { data_load(c); });
  expect("set data.val_path to an existing file");
  std::ofstream(d / "junk.bin") << "not a token file";
  c.data.val_path = d / "junk.bin";
  e = error_of([&] { data_load(c); });
  expect("data.val_path: " + d / "junk.bin" + " is not a token file");
  c.data.val_path = test::write_tokens(d, "v0.bin", 0, 37);
  e = error_of([&] { data_load(c); });
  expect("data.val_path " + d / "v0.bin" + " has 0 tokens; one validation sequence needs model.seq_len + 1 = 10");
  c.data.val_path = test::write_tokens(d, "v1.bin", 1, 37);
  e = error_of([&] { data_load(c); });
  expect("data.val_path " + d / "v1.bin" + " has 1 token; one validation sequence needs");
  c.data.val_path = test::write_tokens(d, "v10.bin", 10, 37);
  EXPECT_EQ(data_load(c).val.size(), 10u);
  c.data.val_path = "";
  c.data.path = test::write_tokens(d, "t9.bin", 9, 37);
  e = error_of([&] { data_load(c); });
  expect("data.path " + d / "t9.bin" + " has 9 tokens; one training sequence needs model.seq_len + 1 = 10");
  c.data.path = d / "t.bin";
  c.data.val_fraction = 0.02;  // 8 of 400 tokens: no whole sequence
  e = error_of([&] { data_load(c); });
  expect("data.val_fraction = 0.02 holds out 8 of the 400 tokens of data.path " + c.data.path);
  c.data.val_fraction = 0.98;  // the training part is the short one
  e = error_of([&] { data_load(c); });
  expect("has 8 tokens besides those data.val_fraction holds out");
  c.data.val_fraction = 0.1;
  EXPECT_EQ(data_load(c).val.size(), 40u);
  e = error_of([&] { config_load("", {"data.path=t.bin", "data.val_path=v.bin", "data.val_fraction=0.1"}); });
  expect("data.val_fraction = 0.1 and data.val_path = v.bin both choose the validation tokens; set only one");
  e = error_of([&] { config_load("", {"data.val_fraction=0.1"}); });
  expect("data.val_fraction = 0.1 holds out the tail of data.path, but data.path is not set");
}

// Validation reads each whole sequence of its tokens once, never one around the end: with
// 3 sequences of seq_len + 1 = 17 tokens in the file (sequence j reads tokens 16j .. 16j + 16)
// and a global batch of 4, the loss is the same whether the file ends after token 48 or
// token 59 (the 4th position used to read tokens 48 .. 64 around the end), and the header
// says how many sequences it reads; at dp 2 the same.
TEST(DataLoad, ValidationReadsNoSequenceAroundTheEnd) {
  test::TempDir d;
  const std::string o =
      test::options("gpt2", 4, 1) + " --training.steps=2 --training.val_batches=1 --data.path=" + test::write_tokens(d, "t.bin", 800, 37);
  const test::RunResult a = test::train_run(d, "a", 1, o + " --data.val_path=" + test::write_tokens(d, "v49.bin", 49, 37, 5));
  const test::RunResult b = test::train_run(d, "b", 1, o + " --data.val_path=" + test::write_tokens(d, "v60.bin", 60, 37, 5));
  ASSERT_TRUE(a.summary["val_loss"].is_number()) << a.output;
  EXPECT_EQ(a.summary["val_loss"], b.summary["val_loss"]) << a.output << b.output;
  // At dp 2 rank 1's second sequence is the one left out (to the layouts' drift in training)
  const test::RunResult c = test::train_run(d, "c", 2, o + " --data.val_path=" + d / "v49.bin");
  EXPECT_NEAR(c.summary["val_loss"].get<double>(), a.summary["val_loss"].get<double>(),
              1e-5 * a.summary["val_loss"].get<double>())
      << c.output;
  EXPECT_NE(a.output.find("note: validation reads 3 sequences, all the validation tokens hold, not "
                          "training.val_batches x training.global_batch = 4"),
            std::string::npos)
      << a.output;
  // A val_batches past any file reads all of it, and only its micro-batches: the same loss
  // (these 2^62 asked-for sequences would take years, and their count overflowed).
  const test::RunResult e = test::train_run(d, "e", 2, o + " --data.val_path=" + d / "v49.bin" +
                                                           " --training.val_batches=1152921504606846976");
  EXPECT_EQ(e.summary["val_loss"], c.summary["val_loss"]) << e.output;
  EXPECT_NE(e.output.find("note: validation reads 3 sequences, all the validation tokens hold, not "
                          "training.val_batches x training.global_batch = 4611686018427387904"),
            std::string::npos)
      << e.output;
}

// training.attention: fused by default, materialized on request, anything else is an error
// that lists the choices.
TEST(Config, AttentionKey) {
  EXPECT_EQ(config_load("", {}).model.attention, "fused");
  test::TempDir d;
  std::ofstream(d / "c.toml") << "[training]\nattention = \"materialized\"\n";
  EXPECT_EQ(config_load(d / "c.toml", {}).model.attention, "materialized");
  EXPECT_EQ(config_load(d / "c.toml", {"training.attention=fused"}).model.attention, "fused");
  EXPECT_NE(error_of([] { config_load("", {"training.attention=sparse"}); })
                .find("\"sparse\" for training.attention: expected one of fused materialized"),
            std::string::npos);
}

// AdamW against the formulas written out in double for two steps, decay on a matrix
// element only; tolerance 1e-6 relative (float32 arithmetic of the same expression).
TEST(Optimizer, AdamWMatchesPyTorchFormula) {
  CpuAllocator alloc;
  Tensor w = Tensor::zeros({4}, DType::f32, alloc, MemTag::params);
  Tensor g = Tensor::zeros({4}, DType::f32, alloc, MemTag::grads);
  float w0[4] = {0.5f, -1.0f, 2.0f, 0.25f}, g0[4] = {0.1f, -0.2f, 0.3f, 1.5f};
  std::memcpy(w.f32(), w0, 16);
  OptimConfig oc;
  oc.lr = 0.01, oc.weight_decay = 0.1, oc.beta1 = 0.9, oc.beta2 = 0.95, oc.eps = 1e-8;
  Optimizer opt(oc, {OptimSegment{w, g, {{2, 4}}, {}}}, alloc);
  double m[4] = {}, v[4] = {}, p[4];
  for (int i = 0; i < 4; ++i) p[i] = w0[i];
  // The schedule's rate of each step, not optim.lr: decoupled decay and the update both scale with it.
  const double scheduled[3] = {0.3 * oc.lr, oc.lr, 0.55 * oc.lr};
  for (int t = 1; t <= 3; ++t) {
    const double lr = scheduled[t - 1];
    for (int i = 0; i < 4; ++i) g.f32()[i] = g0[i] * t;
    opt.step(lr);
    for (int i = 0; i < 4; ++i) {
      double gi = g0[i] * t, wd = i >= 2 ? oc.weight_decay : 0.0;
      p[i] *= 1 - lr * wd;
      m[i] = 0.9 * m[i] + 0.1 * gi;
      v[i] = 0.95 * v[i] + 0.05 * gi * gi;
      double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.95, t));
      p[i] -= lr * mh / (std::sqrt(vh) + oc.eps);
      EXPECT_NEAR(w.f32()[i], p[i], 1e-6 * std::fabs(p[i]) + 1e-7) << "step " << t << " element " << i;
    }
  }
}

TEST(Optimizer, SgdMomentumMatchesPyTorchFormula) {
  CpuAllocator alloc;
  Tensor w = Tensor::zeros({2}, DType::f32, alloc, MemTag::params);
  Tensor g = Tensor::zeros({2}, DType::f32, alloc, MemTag::grads);
  w.f32()[0] = 1.0f, w.f32()[1] = -2.0f;
  OptimConfig oc;
  oc.name = "sgd", oc.lr = 0.1, oc.momentum = 0.9, oc.weight_decay = 0.01;
  Optimizer opt(oc, {OptimSegment{w, g, {{1, 2}}, {}}}, alloc);
  double p[2] = {1.0, -2.0}, buf[2] = {};
  for (int t = 1; t <= 3; ++t) {
    g.f32()[0] = 0.5f, g.f32()[1] = 0.25f * t;
    opt.step(oc.lr);
    for (int i = 0; i < 2; ++i) {
      double d = g.f32()[i] + (i == 1 ? 0.01 * p[i] : 0.0);
      buf[i] = t == 1 ? d : 0.9 * buf[i] + d;
      p[i] -= 0.1 * buf[i];
      EXPECT_NEAR(w.f32()[i], p[i], 1e-6);
    }
  }
}

TEST(Optimizer, SchedulesAndClipping) {
  OptimConfig oc;
  oc.lr = 1.0, oc.warmup_steps = 10, oc.min_lr_ratio = 0.1;
  oc.schedule = "cosine";
  EXPECT_DOUBLE_EQ(lr_at(oc, 0, 110), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(oc, 9, 110), 1.0);
  EXPECT_NEAR(lr_at(oc, 60, 110), 0.55, 1e-12);
  EXPECT_NEAR(lr_at(oc, 110, 110), 0.1, 1e-12);
  oc.schedule = "linear";
  EXPECT_NEAR(lr_at(oc, 60, 110), 0.55, 1e-12);
  oc.schedule = "step", oc.step_size = 20, oc.step_gamma = 0.5;
  EXPECT_DOUBLE_EQ(lr_at(oc, 49, 110), 0.5);
  EXPECT_DOUBLE_EQ(lr_at(oc, 50, 110), 0.25);
  oc.schedule = "constant";
  EXPECT_DOUBLE_EQ(lr_at(oc, 100, 110), 1.0);

  CpuAllocator alloc;
  Tensor w = Tensor::zeros({2}, DType::f32, alloc, MemTag::params);
  Tensor g = Tensor::zeros({2}, DType::f32, alloc, MemTag::grads);
  g.f32()[0] = 3, g.f32()[1] = 4;
  std::vector<OptimSegment> segs{{w, g, {}}};
  EXPECT_DOUBLE_EQ(std::sqrt(grad_sumsq(segs)), 5.0);
  grad_clip(segs, 5.0, 10.0);  // below the limit: unchanged
  EXPECT_EQ(g.f32()[0], 3.0f);
  grad_clip(segs, 5.0, 1.0);
  EXPECT_NEAR(g.f32()[0], 0.6, 1e-6);
  EXPECT_NEAR(g.f32()[1], 0.8, 1e-6);
}

std::vector<nlohmann::json> step_metrics(const std::string& path) {
  std::vector<nlohmann::json> r;
  for (const std::string& l : test::read_lines(path)) {
    auto j = nlohmann::json::parse(l);
    if (j.contains("loss") && j.contains("step") && !j.contains("event")) r.push_back(j);
  }
  return r;
}

std::vector<float> checkpoint_params(const std::string& dir, const ModelConfig& m) {
  CpuAllocator alloc;  // outlives the units' tensors
  std::vector<Unit> units = model_layout(m);
  for (Unit& u : units) u.w = Tensor::empty({u.numel}, DType::f32, alloc, MemTag::params);
  checkpoint_load(checkpoint_latest(dir), m, checkpoint_param_slices(units));
  std::vector<float> all;
  for (Unit& u : units) all.insert(all.end(), u.w.f32(), u.w.f32() + u.numel);
  return all;
}

// 2k steps straight and k steps + resume + k steps: bit-identical losses and parameters
// (the data position and schedule are functions of the step; the optimizer state is saved
// whole). The schedule is warmup + constant so that stopping at k does not change it.
class Resume : public ::testing::TestWithParam<std::string> {};
TEST_P(Resume, IsBitExact) {
  test::TempDir d;
  Config c = test::tiny_config(GetParam(), test::write_tokens(d, "t.bin", 400, 37));
  c.optim.schedule = "constant";
  c.optim.warmup_steps = 3;
  c.data.shuffle = true;
  c.training.steps = 8;
  c.checkpoint.dir = d / "straight";
  c.logging.metrics = d / "straight.jsonl";
  train(c);

  c.checkpoint.dir = d / "split";
  c.logging.metrics = d / "split.jsonl";
  c.training.steps = 4;
  train(c);
  c.training.steps = 8;
  c.checkpoint.resume = true;
  train(c);

  auto a = step_metrics(d / "straight.jsonl"), b = step_metrics(d / "split.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(b[s]["step"].get<int>(), s);
    EXPECT_EQ(a[s]["loss"].get<double>(), b[s]["loss"].get<double>()) << "step " << s;
    EXPECT_EQ(a[s]["grad_norm"].get<double>(), b[s]["grad_norm"].get<double>()) << "step " << s;
  }
  EXPECT_EQ(checkpoint_params(d / "straight", c.model), checkpoint_params(d / "split", c.model));
}
INSTANTIATE_TEST_SUITE_P(Families, Resume, ::testing::Values("gpt2", "llama"));

// A tiny GPT-2 trained for `steps` steps with its checkpoint in d/ck; returns its config.
Config trained_with_checkpoint(const test::TempDir& d, int steps) {
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 300, 37));
  c.training.steps = steps;
  c.checkpoint.dir = d / "ck";
  train(c);
  return c;
}

TEST(Checkpoint, CorruptShardIsReportedAndLeftAlone) {
  test::TempDir d;
  Config c = trained_with_checkpoint(d, 2);
  const std::string dir = checkpoint_latest(d / "ck");
  ASSERT_FALSE(dir.empty());
  const std::string shard = dir + "/shard_00000.safetensors";
  const auto size = fs::file_size(shard);
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 5));
    f.put('\x7f');
  }
  c.checkpoint.resume = true;
  c.training.steps = 4;
  std::string msg = error_of([&] { train(c); });
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
  EXPECT_NE(msg.find(shard), std::string::npos) << msg;
  EXPECT_EQ(fs::file_size(shard), size);  // nothing was rewritten
  EXPECT_EQ(checkpoint_latest(d / "ck"), dir);
}

TEST(Checkpoint, ResumeRejectsADifferentModel) {
  test::TempDir d;
  Config c = trained_with_checkpoint(d, 1);
  c.checkpoint.resume = true;
  c.model.n_layer = 3;
  std::string msg = error_of([&] { train(c); });
  EXPECT_NE(msg.find("model.n_layer"), std::string::npos) << msg;
}

// A run that does not resume refuses a directory holding another run's checkpoints
// instead of pruning them away.
TEST(Checkpoint, FreshRunRefusesAUsedDirectory) {
  test::TempDir d;
  Config c = trained_with_checkpoint(d, 2);
  const std::string before = checkpoint_latest(d / "ck");
  std::string msg = error_of([&] { train(c); });
  EXPECT_NE(msg.find("already holds checkpoints"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checkpoint.resume=true"), std::string::npos) << msg;
  EXPECT_EQ(checkpoint_latest(d / "ck"), before);
}

TEST(Checkpoint, KeepsTheNewest) {
  test::TempDir d;
  Config c = test::tiny_config("gpt2", test::write_tokens(d, "t.bin", 300, 37));
  c.training.steps = 5;
  c.checkpoint.dir = d / "ck";
  c.checkpoint.every = 1;
  c.checkpoint.keep = 2;
  train(c);
  std::vector<std::string> names;
  for (auto& e : fs::directory_iterator(d / "ck")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step_00000004", "step_00000005"}));
}

}  // namespace
