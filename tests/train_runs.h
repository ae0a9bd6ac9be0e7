// Whole training runs through the command (one process, or ranks via meshtrain launch)
// and the comparisons the parallel tests make between them.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "nn/model.h"
#include "train/checkpoint.h"
#include "test_util.h"

namespace mt::test {

struct RunResult {
  std::vector<double> loss, grad_norm;
  nlohmann::json summary;  // the run's {"event": "summary"} line
  std::vector<std::vector<float>> units;  // final parameters per unit
  ModelConfig model;
};

// Trains with `ranks` ranks (1: a plain process) and reads back metrics and the final checkpoint.
inline RunResult train_run(const test::TempDir& d, const std::string& name, int ranks, const std::string& opts) {
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
    if (j.value("event", "") == "summary") r.summary = j;
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

inline std::string options(const std::string& family, int global, int micro) {
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
inline void expect_equivalent(const RunResult& a, const RunResult& b, const std::string& what) {
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

inline void expect_bit_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  EXPECT_EQ(a.units, b.units) << what;
}

}  // namespace mt::test
