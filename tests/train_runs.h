// Whole training runs through the command (one process, or ranks via meshtrain launch)
// and the comparisons the parallel tests make between them.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "nn/hf.h"
#include "nn/model.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "test_util.h"

namespace mt::test {

struct RunResult {
  std::vector<double> loss, grad_norm;
  nlohmann::json summary;  // the run's {"event": "summary"} line
  std::vector<std::vector<float>> units;  // final parameters per unit
  ModelConfig model;
  std::vector<std::vector<float>> adam_v;  // final AdamW second moments per unit (AdamW runs)
  Config config;                           // the run's configuration, as its checkpoint stores it
  std::string output;                      // what the command printed (stdout and stderr)
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
  r.output = out;
  for (const std::string& l : test::read_lines(d / (name + ".jsonl"))) {
    auto j = nlohmann::json::parse(l);
    if (j.value("event", "") == "summary") r.summary = j;
    if (j.contains("event")) continue;
    r.loss.push_back(j["loss"].is_null() ? NAN : j["loss"].get<double>());  // null: a step skipped as a spike
    r.grad_norm.push_back(j["grad_norm"].is_null() ? NAN : j["grad_norm"].get<double>());  // null: an fp16 step skipped
  }
  const std::string dir = checkpoint_latest(d / name);
  if (dir.empty()) return r;
  r.config = checkpoint_config(dir);
  r.model = r.config.model;
  std::vector<Unit> units = model_layout(r.model);
  r.units.resize(units.size());
  r.adam_v.resize(r.config.optim.name == "adamw" ? units.size() : 0);
  std::vector<CheckpointSlice> slices;
  for (size_t u = 0; u < units.size(); ++u) {
    r.units[u].resize(units[u].numel);
    slices.push_back({units[u].name, 0, units[u].numel, {{"params", r.units[u].data()}}});
    if (r.adam_v.empty()) continue;
    r.adam_v[u].resize(units[u].numel);
    slices.back().tensors.emplace_back("adam_v", r.adam_v[u].data());
  }
  checkpoint_load(dir, r.model, slices);
  return r;
}

// AdamW's eps is 1e-4 rather than 1e-8: an element whose gradient is zero up to rounding
// (GPT-2's key bias, rows of unseen tokens) then moves by rounding / eps instead of +-lr per
// step, so two layouts cannot drift apart through such elements and into everything they
// feed (expect_equivalent's first-order bound then holds; with 1e-8 it does not).
inline std::string options(const std::string& family, int global, int micro) {
  std::string o = "--model.family=" + family + " --model.n_layer=2 --model.n_head=4 --model.d_model=32 " +
                  "--model.vocab_size=37 --model.seq_len=16 --training.steps=6 --training.val_every=0 " +
                  "--optim.warmup_steps=0 --optim.lr=3e-3 --optim.eps=1e-4 --training.global_batch=" + std::to_string(global);
  if (family == "llama") o += " --model.n_kv_head=2";
  if (micro) o += " --training.micro_batch=" + std::to_string(micro);
  return o;
}

// The largest |AdamW step| / lr over `steps` steps: with bias correction the step is
// sum_s a_s g_s / sqrt(sum_s b_s g_s^2) for weights a (beta1) and b (beta2) that each sum to
// 1, at most sqrt(sum_s a_s^2 / b_s) by Cauchy-Schwarz (1 at the first step).
inline double adam_step_bound(double beta1, double beta2, int64_t steps) {
  double bound = 1;
  for (int64_t t = 1; t <= steps; ++t) {
    double sum = 0;
    for (int64_t s = 1; s <= t; ++s) {
      const double a = (1 - beta1) * std::pow(beta1, t - s) / (1 - std::pow(beta1, t));
      const double b = (1 - beta2) * std::pow(beta2, t - s) / (1 - std::pow(beta2, t));
      sum += a * a / b;
    }
    bound = std::max(bound, std::sqrt(sum));
  }
  return bound;
}

// Run `b` trains what the single-rank run `a` trains, up to float rounding. Derivation:
// - Two layouts compute every gradient element as the same sum in another order (other
//   rows per GEMM, other tiles, a sum over ranks), so the gradients differ by rounding:
//   |dg| <= rho G, with rho = 1e-5 (the worst-case relative error n u of a float32 sum of
//   n ~ 128 tokens' terms, u = 6e-8) and G the parameter's largest gradient scale.
// - Gradient norms then agree to rho: tolerance 1e-4. Losses are means of per-token losses
//   whose forward pass rounds differently (~1e-7 relative) from parameters that agree as
//   below: tolerance 1e-6.
// - AdamW's step m^/(sqrt(v^) + eps) moves by at most (1 + U) |dg| / (sqrt(v^_i) + eps) for a
//   gradient change dg (m^ and sqrt(v^) are weighted means, each changing by at most |dg|;
//   U = adam_step_bound bounds |step|). Summed over the run, element i may differ by
//       sum_t lr_t (1 + U) rho G / (sqrt(v^_i) + eps),
//   with v^_i the bias-corrected second moment of a's final optimizer state and G the
//   largest sqrt(v^) of the parameter: tiny where the element's gradients stand well above
//   the rounding level, larger where they do not. It is capped at Adam's hard bound
//   2 U sum_t lr_t, plus 1e-6 of the unit's largest magnitude for the rounding of the
//   parameters themselves. Weight decay only shrinks differences; the feedback of parameter
//   differences into later gradients is second order as long as no element's step is
//   dominated by rounding (see options(): eps 1e-4). Measured: the largest difference is
//   about a tenth of this bound, under the AVX2, AVX-512 and AVX (no FMA) kernel sets.
inline void expect_equivalent(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.loss.size(), b.loss.size()) << what;
  for (size_t s = 0; s < a.loss.size(); ++s) {
    EXPECT_NEAR(a.loss[s], b.loss[s], 1e-6 * std::fabs(a.loss[s])) << what << " step " << s;
    EXPECT_NEAR(a.grad_norm[s], b.grad_norm[s], 1e-4 * std::fabs(a.grad_norm[s])) << what << " step " << s;
  }
  ASSERT_EQ(a.units.size(), b.units.size()) << what;
  const OptimConfig& o = a.config.optim;
  ASSERT_EQ(a.adam_v.size(), a.units.size()) << what << ": the reference must be an AdamW run";
  const int64_t steps = a.config.training.steps;
  double lr_sum = 0;
  for (int64_t t = 0; t < steps; ++t) lr_sum += lr_at(o, t, steps);
  const double U = adam_step_bound(o.beta1, o.beta2, steps), rho = 1e-5;
  const double bc2 = std::sqrt(1 - std::pow(o.beta2, steps));  // sqrt(v^) = sqrt(v) / bc2
  std::vector<Unit> layout = model_layout(a.model);
  for (size_t u = 0; u < a.units.size(); ++u) {
    float scale = 0;
    for (float x : a.units[u]) scale = std::max(scale, std::fabs(x));
    for (const ParamSpec& p : layout[u].params) {
      double G = 0;
      for (int64_t i = 0; i < p.numel(); ++i) G = std::max(G, std::sqrt(a.adam_v[u][p.offset + i]) / bc2);
      for (int64_t i = 0; i < p.numel(); ++i) {
        const double sv = std::sqrt(a.adam_v[u][p.offset + i]) / bc2;
        const double drift = std::min(2 * U * lr_sum, lr_sum * (1 + U) * rho * G / (sv + o.eps));
        const double tol = drift + 1e-6 * scale;
        const float x = a.units[u][p.offset + i], y = b.units[u][p.offset + i];
        ASSERT_NEAR(x, y, tol) << what << " " << p.name << "[" << i << "]";
      }
    }
  }
}

// `meshtrain export` of the checkpoint `dir` holds exactly r's final parameters (each
// transposed back where the file stores it the other way round).
inline void expect_export_holds(const test::TempDir& d, const std::string& dir, const RunResult& r) {
  std::string out;
  const std::string file = d / "export.safetensors";
  ASSERT_EQ(test::run_command(std::string(MESHTRAIN_BIN) + " export --checkpoint " + dir + " --out " + file, &out), 0)
      << out;
  SafetensorsReader reader(file);
  std::vector<Unit> layout = model_layout(r.model);
  for (size_t u = 0; u < layout.size(); ++u)
    for (const ParamSpec& p : layout[u].params) {
      std::vector<float> got(p.numel());
      reader.read_f32(p.name, got.data(), p.numel());
      if (p.hf_transposed) {  // stored [a, b] here, [b, a] in the file
        std::vector<float> t(got.size());
        for (int64_t i = 0; i < p.shape[0]; ++i)
          for (int64_t j = 0; j < p.shape[1]; ++j) t[i * p.shape[1] + j] = got[j * p.shape[0] + i];
        got = t;
      }
      EXPECT_TRUE(std::equal(got.begin(), got.end(), r.units[u].begin() + p.offset)) << p.name;
    }
}

inline void expect_bit_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  EXPECT_EQ(a.grad_norm, b.grad_norm) << what;
  EXPECT_EQ(a.units, b.units) << what;
}

// The activation peak is activation_bytes (nn/model.h), the formula the summary prints.
inline void expect_activations_as_predicted(const RunResult& r, const std::string& name) {
  ASSERT_TRUE(r.summary.contains("mem_activations_predicted")) << name;
  EXPECT_EQ(r.summary["mem_activations"].get<double>(), r.summary["mem_activations_predicted"].get<double>()) << name;
}

// The busiest rank's memory by tag is the formulas' (the summary's): activations as
// activation_bytes, params + grads + optimizer state as the ZeRO formula of its share.
// Mixed precision's fp32 staging (MemTag::other) as the planner counts it.
inline void expect_memory_as_predicted(const RunResult& r, const std::string& name) {
  expect_activations_as_predicted(r, name);
  EXPECT_EQ(r.summary["mem_model_state"].get<double>(), r.summary["mem_model_state_predicted"].get<double>()) << name;
  ASSERT_TRUE(r.summary.contains("plan_mem_other")) << name;
  EXPECT_EQ(r.summary["plan_mem_other"].get<double>(), r.summary["mem_steps_other"].get<double>()) << name;
}

// The largest loss difference over the steps both runs have, relative to a's loss.
inline double max_rel_loss_diff(const RunResult& a, const RunResult& b) {
  double d = 0;
  for (size_t s = 0; s < a.loss.size() && s < b.loss.size(); ++s)
    d = std::max(d, std::fabs(a.loss[s] - b.loss[s]) / std::fabs(a.loss[s]));
  return d;
}

// A compressed run against the uncompressed run of the same options on a model that learns
// (the built-in tasks, `steps` steps): it learns, its losses stay within `band` relative of
// the other's at every step and differ somewhere (the compression changed something). Prints
// and returns the largest relative difference.
inline double expect_tracks_uncompressed(const RunResult& uncompressed, const RunResult& run, size_t steps,
                                         double band, const std::string& what) {
  EXPECT_EQ(run.loss.size(), steps) << run.output;
  if (run.loss.size() != steps) return 0;
  EXPECT_LT(run.loss.back(), 0.6 * run.loss.front()) << what << " learns";
  const double worst = max_rel_loss_diff(uncompressed, run);
  std::printf("%s: largest loss difference %.2e relative; final %.4f vs %.4f\n", what.c_str(), worst,
              run.loss.back(), uncompressed.loss.back());
  EXPECT_LT(worst, band) << what;
  EXPECT_GT(worst, 0) << what << " changed nothing";
  return worst;
}

// The compression tests' runs: the built-in tasks on Llama (untied) with 2 blocks, `steps`
// steps, every gradient in one bucket.
inline std::string compression_tasks(int steps) {
  return std::string("--config ") + MESHTRAIN_SOURCE_DIR + "/configs/llama_tasks.toml" + " --training.steps=" +
         std::to_string(steps) + " --training.val_every=0 --model.n_layer=2 --training.micro_batch=0" +
         " --parallel.bucket_mb=1000";
}

// grad_compression = `kind` on each named layout of 4 ranks (40 steps, micro-batches of 4)
// against the same layout uncompressed: within `band`, the dp bytes per step the planner's
// exactly, and fewer than uncompressed.
inline void expect_composed_compression(const TempDir& d, const std::vector<std::pair<std::string, std::string>>& layouts,
                                        const std::string& kind, double band) {
  for (const auto& [name, layout] : layouts) {
    SCOPED_TRACE(name);
    const std::string o = compression_tasks(40) + " --training.micro_batch=4 " + layout;
    const RunResult plain = train_run(d, name + "_plain", 4, o);
    const RunResult run = train_run(d, name + "_" + kind, 4, o + " --parallel.grad_compression=" + kind);
    expect_tracks_uncompressed(plain, run, 40, band, kind + " " + name);
    ASSERT_TRUE(run.summary.contains("plan_comm_bytes_dp")) << run.output;
    EXPECT_EQ(run.summary["plan_comm_bytes_dp"].get<double>(), run.summary["comm_bytes_dp_step"].get<double>());
    EXPECT_LT(run.summary["comm_bytes_dp_step"].get<double>(), plain.summary["comm_bytes_dp_step"].get<double>());
  }
}

// The step lines of run `name`'s metrics (its events left out), in step order.
inline std::vector<nlohmann::json> steps_of(const TempDir& d, const std::string& name) {
  std::vector<nlohmann::json> r;
  for (const std::string& l : read_lines(d / (name + ".jsonl"))) {
    auto j = nlohmann::json::parse(l);
    if (!j.contains("event")) r.push_back(j);
  }
  return r;
}

// An 8-step fp16 run with optim.loss_scale=4096, optim.loss_scale_window=3 and
// parallel.test_fault=overflow:1:2,5 (its step metrics `st`, all 8 of them): exactly steps 2
// and 5 are skipped, the scale halving at each and doubling after 3 clean steps, and every
// loss is finite.
inline void expect_skips_the_injected_overflows(const RunResult& r, const std::vector<nlohmann::json>& st) {
  const double expect_scale[] = {4096, 4096, 4096, 2048, 2048, 2048, 1024, 1024};
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(st[s]["skipped"].get<bool>(), s == 2 || s == 5) << "step " << s;
    EXPECT_EQ(st[s]["loss_scale"].get<double>(), expect_scale[s]) << "step " << s;
    EXPECT_TRUE(std::isfinite(r.loss[s])) << "step " << s;
  }
}

// Every step's comm_bytes_<axis> of run `name` is its comm_bytes_<axis>_predicted, within
// rel x predicted + abs bytes.
inline void expect_comm_bytes_as_predicted(const TempDir& d, const std::string& name, const std::string& axis,
                                           double rel, double abs) {
  int steps = 0;
  const std::string key = "comm_bytes_" + axis;
  for (const std::string& l : read_lines(d / (name + ".jsonl"))) {
    const auto j = nlohmann::json::parse(l);
    if (j.contains("event")) continue;
    ++steps;
    ASSERT_TRUE(j.contains(key)) << name << ": " << l;
    const double got = j[key], want = j[key + "_predicted"];
    EXPECT_GT(want, 0) << name;
    EXPECT_NEAR(got, want, rel * want + abs) << name;
  }
  EXPECT_GT(steps, 0) << name;
}

// Every step's bytes sent over tp are the predicted ones (tp_bytes_per_micro_batch): the
// mappings run exactly the collectives the design says, no more.
inline void expect_tp_bytes_as_predicted(const TempDir& d, const std::string& name) {
  expect_comm_bytes_as_predicted(d, name, "tp", 1e-6, 64);  // per-collective byte counts are whole numbers
}

// A refused run printed its error once, not once per rank.
inline void expect_one_error(const std::string& out, const std::string& what) {
  size_t errors = 0;
  for (size_t at = out.find("error:"); at != std::string::npos; at = out.find("error:", at + 1)) ++errors;
  EXPECT_EQ(errors, 1u) << what << "\n" << out;
}

// `command` followed by each entry's options is refused: a failing exit, the entry's
// message in the output, and one error line.
inline void expect_refused(const std::string& command, const std::vector<std::pair<std::string, std::string>>& bad) {
  for (const auto& [opts, want] : bad) {
    std::string out;
    EXPECT_NE(test::run_command(command + opts + " --logging.progress=off", &out), 0) << opts;
    EXPECT_NE(out.find(want), std::string::npos) << opts << "\n" << out;
    expect_one_error(out, opts);
  }
}

// Checkpoints hold whole units: a run of `opts` (6 steps) at layout `saved` on `saved_ranks`,
// stopped after 3 steps and resumed at each (ranks, layout) of `others`, continues the
// uninterrupted run to rounding (expect_equivalent), and at `saved` itself bit-exactly; the
// export of the uninterrupted run's checkpoint holds its parameters.
inline void expect_resumes_at_other_layouts(const TempDir& d, const std::string& opts, const std::string& saved,
                                            const std::vector<std::pair<int, std::string>>& others,
                                            int saved_ranks = 4) {
  RunResult straight = train_run(d, "straight", saved_ranks, opts + saved);
  const RunResult last3{{straight.loss.begin() + 3, straight.loss.end()},
                        {straight.grad_norm.begin() + 3, straight.grad_norm.end()},
                        {},
                        straight.units,
                        straight.model,
                        straight.adam_v,
                        straight.config};
  std::vector<std::pair<int, std::string>> layouts = others;
  layouts.emplace_back(saved_ranks, saved);
  for (const auto& [ranks, layout] : layouts) {
    const std::string name = "resume" + std::to_string(ranks) + (layout == saved ? "same" : "");
    train_run(d, name, saved_ranks, opts + saved + " --training.steps=3");
    std::filesystem::remove(d / (name + ".jsonl"));
    RunResult r = train_run(d, name, ranks, opts + layout + " --checkpoint.resume=true");
    ASSERT_EQ(r.loss.size(), 3u) << name;
    if (layout == saved) {
      EXPECT_EQ(r.loss, last3.loss) << name;
      EXPECT_EQ(r.units, straight.units) << name;
      continue;
    }
    expect_equivalent(last3, r, "resumed at " + name);  // losses within 1e-6 of the uninterrupted run's
  }
  expect_export_holds(d, d / "straight", straight);
}

// expect_resumes_at_other_layouts for a saved layout on any number of ranks: a run of `opts`
// (6 steps) at `saved` on `saved_ranks` ranks, stopped after 3 steps and resumed at each
// (ranks, layout) of `others`, continues the uninterrupted run to rounding
// (expect_equivalent), and at `saved` itself bit-exactly. Returns the uninterrupted run;
// `resumed` (when given) receives each resumed run, in the order of `others`.
inline RunResult expect_resumes_across_layouts(const TempDir& d, const std::string& opts, int saved_ranks,
                                               const std::string& saved,
                                               const std::vector<std::pair<int, std::string>>& others,
                                               std::vector<RunResult>* resumed = nullptr) {
  RunResult straight = train_run(d, "straight", saved_ranks, opts + saved);
  RunResult last3 = straight;
  last3.loss.erase(last3.loss.begin(), last3.loss.begin() + std::min<size_t>(3, last3.loss.size()));
  last3.grad_norm.erase(last3.grad_norm.begin(), last3.grad_norm.begin() + std::min<size_t>(3, last3.grad_norm.size()));
  std::vector<std::pair<int, std::string>> layouts = others;
  layouts.emplace_back(saved_ranks, saved);
  for (size_t i = 0; i < layouts.size(); ++i) {
    const auto& [ranks, layout] = layouts[i];
    const bool same = i + 1 == layouts.size();
    const std::string name = same ? "resume_same" : "resume" + std::to_string(i);
    const std::string what = "resumed at " + std::to_string(ranks) + " ranks," + (layout.empty() ? " one layout" : layout);
    train_run(d, name, saved_ranks, opts + saved + " --training.steps=3");
    std::filesystem::remove(d / (name + ".jsonl"));
    RunResult r = train_run(d, name, ranks, opts + layout + " --checkpoint.resume=true");
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << what << "\n" << r.output;
    if (r.loss.size() != 3u) {
      ADD_FAILURE() << what << ": " << r.loss.size() << " steps after resuming, not 3\n" << r.output;
      continue;
    }
    if (same) {
      EXPECT_EQ(r.loss, last3.loss) << what;
      EXPECT_EQ(r.units, straight.units) << what;
      continue;
    }
    expect_equivalent(last3, r, what);  // losses within 1e-6 of the uninterrupted run's
    if (resumed) resumed->push_back(std::move(r));
  }
  return straight;
}

// A Hugging Face file of a tiny Llama (2 layers, d_model 32, vocabulary 37) initialised from
// seed 4242, for runs that start from model.init_from; returns its path.
inline std::string write_hf_init(const TempDir& d) {
  ModelConfig m;
  m.family = "llama", m.n_layer = 2, m.n_head = 4, m.n_kv_head = 2, m.d_model = 32, m.vocab_size = 37, m.seq_len = 16;
  CpuAllocator alloc;
  Model src(m, alloc, 1);
  src.init(4242);
  hf_export(m, src.units(), d / "init.safetensors");
  return d / "init.safetensors";
}

}  // namespace mt::test
