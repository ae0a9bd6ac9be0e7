// The planner's layout text, its search over every layout a cluster can run, the H100
// calibration against torchtitan's published run, the `meshtrain plan` command, and the
// prediction every training run prints beside what it measured (plan/plan.h, plan/search.h,
// cli/plan_cmd.cpp, train/plan_report.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "plan/hardware.h"
#include "plan/search.h"
#include "plan/time.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::plan;
using namespace mt::test;

namespace {

// The JSON `text` holds, or a failure showing the text.
nlohmann::json parse(const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what() << "\n" << text;
    return nlohmann::json::object();
  }
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

const std::string kBench = std::string(MESHTRAIN_SOURCE_DIR) + "/configs/gpt2_bench.toml";

// A CPU-like device: fp32 only, a few hundred GFLOP/s, 16 GB, shared-memory "links".
Hardware cpu_like() {
  Hardware h;
  h.name = "cpu-test";
  h.gpu = false;
  h.flops_fp32 = h.flops_bf16 = h.flops_fp16 = 2e11;
  h.mem_bytes = 16e9;
  h.mem_bw = 2e10;
  h.intra_node_bw = h.inter_node_bw = 5e9;
  h.latency_s = 2e-5;
  h.efficiency = 0.5;
  return h;
}

// The core benchmark model (configs/gpt2_bench.toml: 6 layers, d_model 384, 6 heads, 256
// tokens, global batch 32) on `gpus` devices of `hw`, all on one node.
Question bench_question(int gpus, const Hardware& hw) {
  Question q;
  q.config = config_load(kBench, {});
  q.cluster.gpus = gpus;
  q.cluster.gpus_per_node = gpus;
  q.cluster.hw = hw;
  q.precision = Precisions::trained(hw.gpu ? "bf16" : "fp32");  // as `meshtrain plan` counts
  q.global_batch = q.config.training.global_batch;
  return q;
}

std::string family_of(const Layout& l) {
  return "tp=" + std::to_string(l.tp) + ",pp=" + std::to_string(l.pp) + ",cp=" + std::to_string(l.cp);
}

// What every search result must satisfy: each ranked layout uses the whole cluster, is one
// the engine runs (its own checks, schedules built), fits, trains the question's batch and
// matches base's named fields; they come fastest first; a rejected family has no ranked
// layout; ZeRO and sequence parallelism vary only where they mean something.
void expect_well_formed(const Question& q, const Layout& base, const SearchResult& r, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_FALSE(r.ranked.empty());
  EXPECT_GE(r.tried, static_cast<int>(r.ranked.size()));
  std::set<std::string> ranked_families;
  for (size_t i = 0; i < r.ranked.size(); ++i) {
    const Prediction& p = r.ranked[i];
    const Layout& l = p.layout;
    SCOPED_TRACE(l.text());
    EXPECT_EQ(l.ranks(), q.cluster.gpus);
    const auto problem = layout_problem(q, l, true);
    EXPECT_FALSE(problem.has_value()) << *problem;
    EXPECT_TRUE(p.fits) << p.why_not;
    EXPECT_GT(p.memory.peak, 0);
    EXPECT_LE(p.memory.peak, q.cluster.hw.mem_bytes);
    EXPECT_EQ(l.global_batch, q.global_batch);
    EXPECT_EQ(q.global_batch % (int64_t{l.dp} * l.micro_batch), 0);
    if (l.dp * l.cp == 1 && !base.named.count("zero")) EXPECT_EQ(l.zero, 0) << "ZeRO means nothing without a data group";
    if (l.tp == 1) EXPECT_FALSE(l.sequence_parallel) << "sequence parallelism needs tp";
    if (l.pp == 1) EXPECT_EQ(l.chunks, 1);
    EXPECT_GT(p.time.step_s, 0);
    EXPECT_NEAR(p.time.tokens_per_s, double(q.global_batch) * q.config.model.seq_len / p.time.step_s,
                1e-9 * p.time.tokens_per_s);
    if (i > 0) EXPECT_LE(r.ranked[i - 1].time.step_s, p.time.step_s * (1 + 1e-6)) << "ranked " << i;
    // base's named fields hold.
    if (base.named.count("dp")) EXPECT_EQ(l.dp, base.dp);
    if (base.named.count("tp")) EXPECT_EQ(l.tp, base.tp);
    if (base.named.count("pp")) EXPECT_EQ(l.pp, base.pp);
    if (base.named.count("cp")) EXPECT_EQ(l.cp, base.cp);
    if (base.named.count("v")) EXPECT_EQ(l.chunks, base.chunks);
    if (base.named.count("schedule")) EXPECT_EQ(l.schedule, base.schedule);
    if (base.named.count("zero")) EXPECT_EQ(l.zero, base.zero);
    if (base.named.count("sp")) EXPECT_EQ(l.sequence_parallel, base.sequence_parallel);
    if (base.named.count("recompute")) EXPECT_EQ(l.recompute, base.recompute);
    if (base.named.count("mb")) EXPECT_EQ(l.micro_batch, base.micro_batch);
    ranked_families.insert(family_of(l));
  }
  for (const Rejected& x : r.rejected) {
    EXPECT_EQ(ranked_families.count(x.family), 0u) << x.family << " is both ranked and rejected";
    EXPECT_GT(x.layouts, 0) << x.family;
    EXPECT_FALSE(x.reason.empty()) << x.family;
  }
}

}  // namespace

// ---- Layout text --------------------------------------------------------------------------

TEST(PlanLayout, KeysAndAliases) {
  const Layout l = layout_parse("dp=2,tp=4,pp=8,cp=2,v=3,schedule=zbv,zero=2,shard_group=2,sp=1,recompute=full,mb=4,gb=512");
  EXPECT_EQ(l.dp, 2);
  EXPECT_EQ(l.tp, 4);
  EXPECT_EQ(l.pp, 8);
  EXPECT_EQ(l.cp, 2);
  EXPECT_EQ(l.chunks, 3);
  EXPECT_EQ(l.schedule, "zbv");
  EXPECT_EQ(l.zero, 2);
  EXPECT_EQ(l.shard_group, 2);
  EXPECT_TRUE(l.sequence_parallel);
  EXPECT_EQ(l.recompute, "full");
  EXPECT_EQ(l.micro_batch, 4);
  EXPECT_EQ(l.global_batch, 512);
  EXPECT_EQ(l.ranks(), 2 * 4 * 8 * 2);
  EXPECT_EQ(l.named, (std::set<std::string>{"dp", "tp", "pp", "cp", "v", "schedule", "zero", "shard_group", "sp",
                                            "recompute", "mb", "gb"}));

  // The configuration's names read as the short ones, and are recorded by the short name.
  const struct {
    const char* text;
    const char* key;
  } aliases[] = {{"chunks=3", "v"},          {"pp_chunks=3", "v"},           {"micro_batch=4", "mb"},
                 {"global_batch=512", "gb"}, {"sequence_parallel=true", "sp"}, {"pp_schedule=zbv", "schedule"}};
  for (const auto& a : aliases) {
    SCOPED_TRACE(a.text);
    const Layout x = layout_parse(a.text);
    EXPECT_EQ(x.named, std::set<std::string>{a.key});
  }
  EXPECT_EQ(layout_parse("chunks=3").chunks, 3);
  EXPECT_EQ(layout_parse("pp_chunks=3").chunks, 3);
  EXPECT_EQ(layout_parse("micro_batch=4").micro_batch, 4);
  EXPECT_EQ(layout_parse("global_batch=512").global_batch, 512);
  EXPECT_TRUE(layout_parse("sequence_parallel=true").sequence_parallel);
  EXPECT_FALSE(layout_parse("sp=1,sequence_parallel=false").sequence_parallel);
  EXPECT_EQ(layout_parse("pp_schedule=zbv").schedule, "zbv");

  // Onto a base: what the text does not name stays the base's, and is not recorded.
  Layout base;
  base.dp = 4, base.global_batch = 64, base.micro_batch = 2, base.recompute = "full";
  const Layout y = layout_parse("tp=2,,zero=1", base);  // empty items are skipped
  EXPECT_EQ(y.tp, 2);
  EXPECT_EQ(y.zero, 1);
  EXPECT_EQ(y.dp, 4);
  EXPECT_EQ(y.global_batch, 64);
  EXPECT_EQ(y.micro_batch, 2);
  EXPECT_EQ(y.recompute, "full");
  EXPECT_EQ(y.named, (std::set<std::string>{"tp", "zero"}));
  EXPECT_TRUE(layout_parse("").named.empty());
}

TEST(PlanLayout, TextRoundTrip) {
  Layout l;
  l.dp = 3, l.tp = 2, l.pp = 4, l.cp = 2, l.chunks = 2, l.schedule = "interleaved", l.zero = 3, l.shard_group = 3;
  l.sequence_parallel = true, l.recompute = "full", l.micro_batch = 5, l.global_batch = 960;
  EXPECT_EQ(l.text(), "dp=3,tp=2,pp=4,cp=2,v=2,schedule=interleaved,zero=3,shard_group=3,sp=1,recompute=full,mb=5,gb=960");
  const Layout r = layout_parse(l.text());
  EXPECT_EQ(r.text(), l.text());
  EXPECT_EQ(r.dp, l.dp);
  EXPECT_EQ(r.tp, l.tp);
  EXPECT_EQ(r.pp, l.pp);
  EXPECT_EQ(r.cp, l.cp);
  EXPECT_EQ(r.chunks, l.chunks);
  EXPECT_EQ(r.schedule, l.schedule);
  EXPECT_EQ(r.zero, l.zero);
  EXPECT_EQ(r.shard_group, l.shard_group);
  EXPECT_EQ(r.sequence_parallel, l.sequence_parallel);
  EXPECT_EQ(r.recompute, l.recompute);
  EXPECT_EQ(r.micro_batch, l.micro_batch);
  EXPECT_EQ(r.global_batch, l.global_batch);
  EXPECT_EQ(r.shard(), 3);
  // The defaults' text (no shard group) round-trips too.
  EXPECT_EQ(layout_parse(Layout{}.text()).text(), Layout{}.text());
  EXPECT_FALSE(has(Layout{}.text(), "shard_group"));
}

TEST(PlanLayout, ErrorsNameTheKeyAndValue) {
  const std::string unknown = error_of([] { layout_parse("tp=2,bogus=3"); });
  EXPECT_TRUE(has(unknown, "unknown key 'bogus'")) << unknown;
  for (const char* k : {"dp", "tp", "pp", "cp", "v", "schedule", "zero", "shard_group", "sp", "recompute", "mb", "gb"})
    EXPECT_TRUE(has(unknown, k)) << k << " is not listed: " << unknown;

  const struct {
    const char* text;
    const char* says;
  } bad[] = {
      {"tp=two", "tp=two"},        {"tp=0", "tp=0"},           {"dp=-2", "dp=-2"},       {"pp=2x", "pp=2x"},
      {"mb=", "mb="},              {"zero=4", "zero=4"},       {"zero=-1", "zero=-1"},   {"sp=2", "sp=2"},
      {"recompute=some", "recompute=some"}, {"tp", "'tp' is not key=value"},
  };
  for (const auto& b : bad) {
    SCOPED_TRACE(b.text);
    const std::string e = error_of([&] { layout_parse(b.text); });
    EXPECT_TRUE(has(e, b.says)) << e;
  }
  EXPECT_TRUE(has(error_of([] { layout_parse("zero=4"); }), "ZeRO stages are 0 (DDP), 1, 2 and 3"));
  EXPECT_TRUE(has(error_of([] { layout_parse("recompute=some"); }), "none, selective or full"));
}

// ---- The search ---------------------------------------------------------------------------

// The core benchmark model on 2 and 4 devices of an H100 and of a CPU-like profile.
TEST(PlanSearch, RankedLayoutsAreValidAndFastestFirst) {
  for (const Hardware& hw : {hardware_get("h100"), cpu_like()})
    for (int gpus : {2, 4}) {
      const std::string what = hw.name + " x " + std::to_string(gpus);
      const Question q = bench_question(gpus, hw);
      Layout base;
      base.global_batch = q.global_batch;
      const SearchResult r = search(q, base);
      expect_well_formed(q, base, r, what);
      // The search weighs ZeRO, tp, pp, cp: on 4 devices every axis shows up among those ranked.
      std::set<int> zeros, tps, pps, cps;
      for (const Prediction& p : r.ranked) {
        zeros.insert(p.layout.zero), tps.insert(p.layout.tp), pps.insert(p.layout.pp), cps.insert(p.layout.cp);
      }
      EXPECT_EQ(zeros, (std::set<int>{0, 1, 2, 3})) << what;
      EXPECT_TRUE(tps.count(2) && pps.count(2) && cps.count(2)) << what;

      // No layout the engine runs and fits is faster than the first: a brute force over the
      // plain axes and micro-batches, independent of the search's own enumeration.
      const double best = r.ranked.front().time.step_s;
      int checked = 0;
      for (int tp : {1, 2, 4})
        for (int pp : {1, 2, 4})
          for (int zero : {0, 1, 2, 3})
            for (int mb : {1, 2, 4, 8, 16}) {
              if (gpus % (tp * pp) != 0) continue;
              Layout l = base;
              l.tp = tp, l.pp = pp, l.dp = gpus / (tp * pp), l.zero = zero, l.micro_batch = mb;
              if (l.dp == 1 && zero > 0) continue;
              if (q.global_batch % (l.dp * mb) != 0 || layout_problem(q, l, true)) continue;
              const Prediction p = predict(q, l);
              if (!p.fits) continue;
              ++checked;
              EXPECT_GE(p.time.step_s, best * (1 - 1e-6)) << what << ": " << l.text() << " beats the first, "
                                                          << r.ranked.front().layout.text();
            }
      EXPECT_GT(checked, 10) << what;
      // The first is predict's own answer for it.
      const Prediction again = predict(q, r.ranked.front().layout);
      EXPECT_DOUBLE_EQ(again.time.step_s, best) << what;
      EXPECT_DOUBLE_EQ(again.memory.peak, r.ranked.front().memory.peak) << what;
    }
}

// 6 heads do not split over 4 ranks: the engine's own message, in layout_problem and as the
// reason the tp=4 families are rejected.
TEST(PlanSearch, EnginesReasonsForLayoutsItRefuses) {
  const Question q = bench_question(4, hardware_get("h100"));
  Layout l;
  l.tp = 4, l.global_batch = q.global_batch;
  const auto problem = layout_problem(q, l, true);
  ASSERT_TRUE(problem.has_value());
  EXPECT_TRUE(has(*problem, "model.n_head = 6 does not split over parallel.tp = 4")) << *problem;
  EXPECT_TRUE(has(*problem, "parallel.tp can be")) << *problem;

  Layout wrong = l;
  wrong.tp = 1, wrong.dp = 2;  // 2 ranks on a 4-GPU cluster
  const auto size = layout_problem(q, wrong, true);
  ASSERT_TRUE(size.has_value());
  EXPECT_TRUE(has(*size, "choose sizes whose product is 4")) << *size;

  Layout selective = l;
  selective.tp = 1, selective.dp = 4, selective.recompute = "selective";
  ASSERT_TRUE(layout_problem(q, selective, true).has_value());

  // predict says so too.
  const Prediction p = predict(q, l);
  EXPECT_FALSE(p.fits);

  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult r = search(q, base);
  int tp4 = 0;
  for (const Rejected& x : r.rejected)
    if (x.family.rfind("tp=4,", 0) == 0) {
      ++tp4;
      EXPECT_TRUE(has(x.reason, "does not split over parallel.tp = 4")) << x.family << ": " << x.reason;
    }
  EXPECT_EQ(tp4, 1) << "tp=4 leaves pp = cp = 1 on 4 GPUs: one family";
  for (const Prediction& x : r.ranked) EXPECT_NE(x.layout.tp, 4);
}

// Named fields are kept; the open ones are searched.
TEST(PlanSearch, NamedFieldsAreRespected) {
  const Question q = bench_question(4, hardware_get("h100"));
  const char* texts[] = {"tp=2", "pp=2,schedule=zb-h1", "pp=2,schedule=interleaved,v=2", "zero=3", "mb=2,recompute=full",
                         "dp=2,cp=2", "pp=4,schedule=1f1b", "tp=2,sp=1"};
  for (const char* text : texts) {
    Layout base;
    base.global_batch = q.global_batch;
    base = layout_parse(text, base);
    const SearchResult r = search(q, base);
    expect_well_formed(q, base, r, text);
  }
  // A named schedule without v runs with its own chunks: interleaved and zbv 2 per rank.
  for (const char* schedule : {"interleaved", "zbv"}) {
    Layout base;
    base.global_batch = q.global_batch;
    base = layout_parse(std::string("pp=2,schedule=") + schedule, base);
    const SearchResult r = search(q, base);
    expect_well_formed(q, base, r, schedule);
    for (const Prediction& p : r.ranked) EXPECT_EQ(p.layout.chunks, 2) << p.layout.text();
  }
  // Without a name, both values of an open field are weighed.
  Layout open;
  open.global_batch = q.global_batch;
  const SearchResult r = search(q, open);
  std::set<std::string> schedules, recomputes;
  std::set<int64_t> mbs;
  for (const Prediction& p : r.ranked) {
    if (p.layout.pp > 1) schedules.insert(p.layout.schedule);
    recomputes.insert(p.layout.recompute);
    mbs.insert(p.layout.micro_batch);
  }
  EXPECT_EQ(schedules, (std::set<std::string>{"1f1b", "interleaved", "zb-h1", "zbv"}));
  EXPECT_EQ(recomputes, (std::set<std::string>{"none", "full"}));
  EXPECT_TRUE(mbs.count(1) && mbs.count(8)) << "micro-batches 1 .. 8 divide 32 / 4";
}

// A smaller device: every layout ranked still fits it, and fewer do.
TEST(PlanSearch, LessMemoryFewerLayouts) {
  Question q = bench_question(2, cpu_like());
  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult all = search(q, base);
  std::vector<double> peaks;
  for (const Prediction& p : all.ranked) peaks.push_back(p.memory.peak);
  std::sort(peaks.begin(), peaks.end());
  q.cluster.hw.mem_bytes = peaks[peaks.size() / 2];
  const SearchResult some = search(q, base);
  expect_well_formed(q, base, some, "half the memory");
  EXPECT_LT(some.ranked.size(), all.ranked.size());
  EXPECT_GE(some.ranked.size(), all.ranked.size() / 3);
}

// Llama 3 70B on one A100 40 GB: nothing fits, and the family says by how much.
TEST(PlanSearch, AModelThatFitsNowhere) {
  Question q;
  ModelConfig& m = q.config.model;
  m.family = "llama";
  m.n_layer = 80, m.n_head = 64, m.n_kv_head = 8, m.d_model = 8192, m.d_ff = 28672, m.vocab_size = 128256;
  m.seq_len = 4096;
  q.cluster.gpus = 1, q.cluster.gpus_per_node = 8;
  q.cluster.hw = hardware_get("a100-40gb");
  q.precision = Precisions::of("bf16");
  q.global_batch = 8;
  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult r = search(q, base);
  EXPECT_TRUE(r.ranked.empty());
  ASSERT_EQ(r.rejected.size(), 1u);
  EXPECT_EQ(r.rejected[0].family, "tp=1,pp=1,cp=1");
  EXPECT_GT(r.rejected[0].layouts, 1);
  const std::string& why = r.rejected[0].reason;
  EXPECT_TRUE(has(why, "does not fit")) << why;
  EXPECT_TRUE(has(why, "GiB per GPU")) << why;
  EXPECT_TRUE(has(why, "a100-40gb has 37.3 GiB")) << why;  // 40e9 bytes
  // At least the model states, 16 bytes a parameter in bf16 with fp32 masters and moments: ~1 TiB.
  const double gib = std::stod(why.substr(why.find("at least ") + 9));
  EXPECT_GT(gib, 70.5e9 * 16 / (1 << 30)) << why;
  EXPECT_TRUE(has(why, "recompute=full")) << "the least-memory layout recomputes: " << why;

  const Prediction p = predict(q, layout_parse("mb=1,recompute=full", base));
  EXPECT_FALSE(p.fits);
  EXPECT_TRUE(has(p.why_not, "per GPU, the a100-40gb has")) << p.why_not;
}

// ---- The H100 calibration -----------------------------------------------------------------

// torchtitan's Llama 3.1 8B on 8 H100s (published-figures.md): FSDP (ZeRO 3 over dp 8),
// local batch 2 sequences of 8192 tokens, 5,762 tokens/s per GPU. Its selective
// recomputation recomputes no matrix product: recompute none here. The built-in h100's
// efficiency reproduces it within 5%.
TEST(PlanCalibration, TorchtitanLlama31_8bOn8H100) {
  Question q;
  ModelConfig& m = q.config.model;
  m.family = "llama";
  m.n_layer = 32, m.n_head = 32, m.n_kv_head = 8, m.d_model = 4096, m.d_ff = 14336, m.vocab_size = 128256;
  m.seq_len = 8192, m.tie_embeddings = 0, m.rope_theta = 500000;
  q.cluster.gpus = 8, q.cluster.gpus_per_node = 8;
  q.cluster.hw = hardware_get("h100");
  q.precision = Precisions::of("bf16");
  q.global_batch = 16;
  const Layout l = layout_parse("dp=8,zero=3,mb=2,gb=16,recompute=none");
  EXPECT_FALSE(layout_problem(q, l, true).has_value());
  const Prediction p = predict(q, l);
  const double per_gpu = p.time.tokens_per_s / 8;
  std::printf("Llama 3.1 8B, 8 x H100, FSDP: %.0f tokens/s per GPU predicted, 5762 published (%+.1f%%), MFU %.1f%%\n",
              per_gpu, 100 * (per_gpu / 5762 - 1), 100 * p.time.mfu);
  EXPECT_NEAR(per_gpu, 5762, 0.05 * 5762);
  // The model is the published 8.03B parameters.
  double n = 0;
  for (double u : unit_numels(m, 1)) n += u;
  EXPECT_NEAR(n, 8.03e9, 0.01e9);
}

// ---- The command --------------------------------------------------------------------------

namespace {

struct Plan {
  int rc = -1;
  std::string out;     // stdout and stderr
  std::string printed;  // stdout alone
};

Plan plan_cmd(const TempDir& d, const std::string& args) {
  Plan p;
  const std::string file = d / "plan.out";
  p.rc = run_command("(" + std::string(MESHTRAIN_BIN) + " plan " + args + " > " + file + ")", &p.out);  // stderr alone
  p.printed = read_file(file);
  p.out = p.printed + p.out;
  return p;
}

}  // namespace

TEST(PlanCommand, JsonIsTheIssuesSchemaBestFirst) {
  const TempDir d;
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 4 --gpus-per-node 4 --hardware h100 --json --top 5");
  ASSERT_EQ(p.rc, 0) << p.out;
  const nlohmann::json j = parse(p.printed);
  ASSERT_TRUE(j.contains("layouts") && j["layouts"].is_array()) << p.printed;
  ASSERT_EQ(j["layouts"].size(), 5u);
  // The same question in the library: the same five, in order.
  const Question q = bench_question(4, hardware_get("h100"));
  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult r = search(q, base);
  double last = 0;
  for (size_t i = 0; i < 5; ++i) {
    const nlohmann::json& x = j["layouts"][i];
    SCOPED_TRACE(x.dump());
    const nlohmann::json& l = x["layout"];
    for (const char* k : {"dp", "tp", "pp", "cp", "pp_chunks", "pp_schedule", "zero", "shard_group", "sequence_parallel",
                          "recompute", "micro_batch", "global_batch", "text"})
      EXPECT_TRUE(l.contains(k)) << k;
    EXPECT_EQ(l["dp"].get<int>() * l["tp"].get<int>() * l["pp"].get<int>() * l["cp"].get<int>(), 4);
    EXPECT_EQ(l["global_batch"].get<int64_t>(), 32);
    EXPECT_EQ(l["text"].get<std::string>(), r.ranked[i].layout.text());
    EXPECT_EQ(layout_parse(l["text"].get<std::string>()).text(), l["text"].get<std::string>());
    EXPECT_EQ(x["fits"], true);
    const nlohmann::json& m = x["memory"];
    double sum = 0;
    for (const char* k : {"params", "grads", "optim", "activations", "comm", "other", "peak"}) {
      ASSERT_TRUE(m.contains(k) && m[k].is_number()) << k;
      EXPECT_GE(m[k].get<double>(), 0) << k;
      if (std::string(k) != "peak") sum += m[k].get<double>();
    }
    EXPECT_GT(m["params"].get<double>(), 0);
    EXPECT_GT(m["peak"].get<double>(), m["params"].get<double>());
    EXPECT_LE(m["peak"].get<double>(), sum * (1 + 1e-12));
    EXPECT_LE(m["peak"].get<double>(), 80e9);
    EXPECT_DOUBLE_EQ(m["peak"].get<double>(), r.ranked[i].memory.peak);
    for (const char* k : {"dp", "tp", "pp", "cp"}) {
      ASSERT_TRUE(x["comm_bytes"].contains(k) && x["comm_bytes"][k].is_number()) << k;
      const int size = l[k].get<int>();
      if (size == 1 && std::string(k) != "dp") EXPECT_EQ(x["comm_bytes"][k].get<double>(), 0) << k;
    }
    for (const char* k : {"step_s", "tokens_per_s", "mfu"}) {
      ASSERT_TRUE(x[k].is_number()) << k;
      EXPECT_GT(x[k].get<double>(), 0) << k;
    }
    EXPECT_LT(x["mfu"].get<double>(), 1);
    EXPECT_NEAR(x["tokens_per_s"].get<double>(), 32.0 * 256 / x["step_s"].get<double>(),
                1e-9 * x["tokens_per_s"].get<double>());
    EXPECT_DOUBLE_EQ(x["step_s"].get<double>(), r.ranked[i].time.step_s);
    EXPECT_GE(x["step_s"].get<double>(), last);
    last = x["step_s"].get<double>();
  }
  // The rejected families come along: tp=4 splits no 6 heads.
  ASSERT_TRUE(j["rejected"].is_array());
  bool tp4 = false;
  for (const auto& x : j["rejected"]) tp4 |= x["family"] == "tp=4,pp=1,cp=1";
  EXPECT_TRUE(tp4) << j["rejected"].dump();

  // --top 1: one.
  const Plan one = plan_cmd(d, "--config " + kBench + " --gpus 4 --gpus-per-node 4 --json --top 1");
  ASSERT_EQ(one.rc, 0) << one.out;
  EXPECT_EQ(parse(one.printed)["layouts"].size(), 1u);
}

// On a GPU profile the command plans bf16 as meshtrain trains it: every tag of its memory
// (activations and messages in fp32, the blocks' kept tensors in 16 bits, the fp32 staging
// as `other`) is what a bf16 run of that layout holds, to the byte.
TEST(PlanCommand, Bf16MemoryIsWhatABf16RunHolds) {
  const TempDir d;
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware h100 --global-batch 4 --json " +
                                 "--layout dp=2,tp=1,pp=1,cp=1,v=1,schedule=1f1b,zero=1,sp=0,recompute=none,mb=2");
  ASSERT_EQ(p.rc, 0) << p.out;
  const nlohmann::json m = parse(p.printed)["layouts"][0]["memory"];
  const RunResult run = train_run(d, "bf16", 2, "--config " + kBench + " --training.precision=bf16 --parallel.dp=2 " +
                                                   "--parallel.zero=1 --training.global_batch=4 --training.micro_batch=2 " +
                                                   "--training.steps=1 --training.val_every=0");
  ASSERT_TRUE(run.summary.contains("mem_steps_other")) << run.output;
  for (const char* tag : {"params", "grads", "optim", "activations", "comm", "other"})
    EXPECT_EQ(m[tag].get<double>(), run.summary[std::string("mem_steps_") + tag].get<double>()) << tag;
  EXPECT_GT(m["other"].get<double>(), 0);
}

// The table, the best layout's breakdown and the rejected families, as text.
TEST(PlanCommand, TextRanksAndExplains) {
  const TempDir d;
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 4 --gpus-per-node 4 --hardware h100 --top 3");
  ASSERT_EQ(p.rc, 0) << p.out;
  EXPECT_TRUE(has(p.printed, "meshtrain plan: gpt2 6 layers x 384")) << p.printed;
  EXPECT_TRUE(has(p.printed, "4 x h100")) << p.printed;
  EXPECT_TRUE(has(p.printed, "bf16")) << p.printed;
  EXPECT_TRUE(has(p.printed, "best:\nlayout dp=")) << p.printed;
  EXPECT_EQ(count(p.printed, "memory per GPU:"), 1u) << p.printed;
  EXPECT_TRUE(has(p.printed, "rejected families")) << p.printed;
  EXPECT_TRUE(has(p.printed, "does not split over parallel.tp = 4")) << p.printed;
  // --precision overrides the GPU default (bf16).
  const Plan f = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware h100 --precision fp32 --top 1");
  ASSERT_EQ(f.rc, 0) << f.out;
  EXPECT_TRUE(has(f.printed, "fp32")) << f.printed;
}

// A --layout naming some fields: the rest completed with the best choice, one breakdown.
// --grad-dtype bf16: gradients kept in the working precision (2Ψ + 2Ψ + 12Ψ), the same
// layout with exactly half the gradient bytes, named in the header; the default follows the
// configuration's training.grad_dtype; a type other than fp32 or the precision's is refused.
TEST(PlanCommand, GradDtypeHalvesTheGradients) {
  const TempDir d;
  const std::string cfg = "--config " + kBench + " --gpus 2 --hardware h100 --layout dp=2,zero=0,mb=1 ";
  const Plan f = plan_cmd(d, cfg + "--json");
  const Plan h = plan_cmd(d, cfg + "--json --grad-dtype bf16");
  const Plan k = plan_cmd(d, cfg + "--json --set training.grad_dtype=bf16 --set training.precision=bf16");
  ASSERT_EQ(f.rc, 0) << f.out;
  ASSERT_EQ(h.rc, 0) << h.out;
  ASSERT_EQ(k.rc, 0) << k.out;
  const nlohmann::json a = parse(f.printed)["layouts"][0]["memory"], b = parse(h.printed)["layouts"][0]["memory"];
  EXPECT_GT(a["grads"].get<double>(), 0);
  EXPECT_EQ(b["grads"].get<double>() * 2, a["grads"].get<double>());
  EXPECT_EQ(b["params"], a["params"]);
  EXPECT_EQ(b["optim"], a["optim"]);
  EXPECT_EQ(parse(k.printed)["layouts"][0]["memory"]["grads"], b["grads"]);
  const Plan t = plan_cmd(d, cfg + "--grad-dtype bf16");
  EXPECT_TRUE(has(t.printed, "bf16 with bf16 gradients")) << t.printed;
  const Plan bad = plan_cmd(d, cfg + "--grad-dtype fp16");
  EXPECT_EQ(bad.rc, 1) << bad.out;
  EXPECT_TRUE(has(bad.out, "--grad-dtype fp16 with precision bf16")) << bad.out;
}

TEST(PlanCommand, PartialLayoutIsCompleted) {
  const TempDir d;
  const std::string args = "--config " + kBench + " --gpus 4 --gpus-per-node 4 --hardware h100 --layout tp=2";
  const Plan t = plan_cmd(d, args);
  ASSERT_EQ(t.rc, 0) << t.out;
  EXPECT_EQ(count(t.printed, "\nlayout dp="), 1u) << t.printed;
  EXPECT_EQ(count(t.printed, "memory per GPU:"), 1u) << t.printed;
  EXPECT_FALSE(has(t.printed, "best:")) << t.printed;

  const Plan j = plan_cmd(d, args + " --json");
  ASSERT_EQ(j.rc, 0) << j.out;
  const nlohmann::json x = parse(j.printed);
  ASSERT_EQ(x["layouts"].size(), 1u);
  EXPECT_EQ(x["layouts"][0]["layout"]["tp"], 2);
  const Question q = bench_question(4, hardware_get("h100"));
  Layout base;
  base.global_batch = q.global_batch;
  base = layout_parse("tp=2", base);
  const std::string best = search(q, base).ranked.front().layout.text();
  EXPECT_EQ(x["layouts"][0]["layout"]["text"], best);
  EXPECT_TRUE(has(t.printed, "layout " + best + "\n")) << t.printed;

  // gb is the question's global batch (it was overwritten by the configuration's); beside
  // a different --global-batch it is refused.
  const Plan g = plan_cmd(d, args + ",gb=64 --json");
  ASSERT_EQ(g.rc, 0) << g.out;
  EXPECT_EQ(parse(g.printed)["layouts"][0]["layout"]["global_batch"], 64) << g.printed;
  const Plan both = plan_cmd(d, args + ",gb=64 --global-batch 32");
  EXPECT_EQ(both.rc, 1);
  EXPECT_TRUE(has(both.out, "--layout gb=64 and --global-batch 32 differ")) << both.out;
}

// A fully named layout that does not fit: its breakdown, a message, exit status 1.
TEST(PlanCommand, NamedLayoutThatDoesNotFit) {
  const TempDir d;
  Hardware small = cpu_like();
  small.mem_bytes = 1e8;  // 100 MB: the benchmark model's states alone are ~250 MB
  write_file(d / "small.toml", hardware_to_toml(small));
  const std::string layout = "dp=2,tp=1,pp=1,cp=1,zero=0,mb=1,recompute=none,sp=0";
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware " + (d / "small.toml") + " --layout " + layout);
  EXPECT_EQ(p.rc, 1) << p.out;
  EXPECT_TRUE(has(p.printed, "layout dp=2,tp=1,pp=1,cp=1,v=1,schedule=1f1b,zero=0,sp=0,recompute=none,mb=1,gb=32"))
      << p.printed;
  EXPECT_TRUE(has(p.printed, "memory per GPU:")) << p.printed;
  EXPECT_TRUE(has(p.printed, ": does not fit")) << p.printed;
  EXPECT_TRUE(has(p.out, "error: --layout " + layout + " does not fit: needs")) << p.out;
  EXPECT_TRUE(has(p.out, "cpu-test has 0.1 GiB")) << p.out;
  expect_one_error(p.out, "does not fit");

  const Plan j = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware " + (d / "small.toml") + " --layout " + layout +
                                 " --json");
  EXPECT_EQ(j.rc, 1) << j.out;
  const nlohmann::json x = parse(j.printed);
  ASSERT_EQ(x["layouts"].size(), 1u);
  EXPECT_EQ(x["layouts"][0]["fits"], false);
  EXPECT_TRUE(has(x["layouts"][0]["why_not"].get<std::string>(), "needs")) << j.printed;
  EXPECT_GT(x["layouts"][0]["memory"]["peak"].get<double>(), 1e8);

  // With no --layout, nothing fits: every family's reason, and what would help.
  const Plan n = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware " + (d / "small.toml"));
  EXPECT_EQ(n.rc, 1) << n.out;
  EXPECT_TRUE(has(n.out, "no layout of this model fits 2 x cpu-test")) << n.out;
  EXPECT_TRUE(has(n.out, "tp=1,pp=1,cp=1: does not fit: at least")) << n.out;
  EXPECT_TRUE(has(n.out, "use more GPUs")) << n.out;
  expect_one_error(n.out, "fits nowhere");
}

// Bad input: what is wrong, exit status 1, one error.
TEST(PlanCommand, BadInputIsExplained) {
  const TempDir d;
  const std::string cfg = "--config " + kBench + " --gpus 4 ";
  {
    const Plan p = plan_cmd(d, cfg + "--hardware tpu-v9");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "unknown hardware \"tpu-v9\"")) << p.out;
    for (const std::string& n : hardware_builtin_names()) EXPECT_TRUE(has(p.out, n)) << n << "\n" << p.out;
    expect_one_error(p.out, "unknown hardware");
  }
  {
    std::string text;
    std::istringstream in(hardware_to_toml(hardware_get("h100")));
    for (std::string l; std::getline(in, l);)
      if (l.rfind("mem_bw =", 0) != 0) text += l + "\n";
    write_file(d / "no_bw.toml", text);
    const Plan p = plan_cmd(d, cfg + "--hardware " + (d / "no_bw.toml"));
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "[hardware].mem_bw is missing")) << p.out;
    EXPECT_TRUE(has(p.out, d / "no_bw.toml")) << p.out;
    expect_one_error(p.out, "missing field");
  }
  for (const char* layout : {"tp=3", "dp=3", "tp=2,pp=2,dp=2"}) {
    SCOPED_TRACE(layout);
    const Plan p = plan_cmd(d, cfg + "--layout " + layout);
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "must multiply to the 4 GPUs")) << p.out;
    EXPECT_TRUE(has(p.out, "does not divide 4")) << p.out;
    expect_one_error(p.out, layout);
  }
  {
    const Plan p = plan_cmd(d, cfg + "--layout tp=2,stages=4");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "unknown key 'stages'")) << p.out;
    EXPECT_TRUE(has(p.out, "keys: dp, tp, pp")) << p.out;
    expect_one_error(p.out, "unknown key");
  }
  {
    // A named layout the engine refuses: the engine's reason.
    const Plan p = plan_cmd(d, cfg + "--layout tp=4");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "--layout tp=4: model.n_head = 6 does not split over parallel.tp = 4")) << p.out;
    expect_one_error(p.out, "tp=4");
  }
}

// --svg: memory per rank of the top layouts; with pp, the chosen layout's pipeline nested.
TEST(PlanCommand, SvgDrawsMemoryAndThePipeline) {
  const TempDir d;
  const std::string cfg = "--config " + kBench + " --gpus 4 --gpus-per-node 4 --hardware h100 ";
  const Plan flat = plan_cmd(d, cfg + "--layout pp=1 --svg " + (d / "flat/plan.svg"));
  ASSERT_EQ(flat.rc, 0) << flat.out;
  EXPECT_TRUE(has(flat.printed, "drew " + (d / "flat/plan.svg"))) << flat.printed;
  const std::string a = read_file(d / "flat/plan.svg");
  EXPECT_EQ(count(a, "<svg"), 1u) << a.substr(0, 400);
  EXPECT_TRUE(has(a, "</svg>"));

  const Plan piped = plan_cmd(d, cfg + "--layout pp=2,schedule=1f1b --json --svg " + (d / "pp.svg"));
  ASSERT_EQ(piped.rc, 0) << piped.out;
  EXPECT_FALSE(has(piped.printed, "drew")) << "--json prints JSON alone";
  EXPECT_TRUE(parse(piped.printed).contains("layouts")) << piped.printed;
  const std::string b = read_file(d / "pp.svg");
  EXPECT_EQ(count(b, "<svg"), 2u) << b.substr(0, 400);
  EXPECT_EQ(count(b, "</svg>"), 2u);
  EXPECT_GT(b.size(), a.size());
}

// ---- The run's own prediction -------------------------------------------------------------

// Validation on the built-in tasks (greedy answers: a maximum over tp) allocates no
// communication buffer on one tp rank, so the run's memory stays the planner's.
TEST(PlanReport, ValidationOnOneTpRankHoldsNoCommunicationBuffer) {
  const TempDir d;
  const RunResult run = train_run(d, "val", 1, "--training.steps=4 --training.val_every=2");
  ASSERT_TRUE(run.summary.contains("mem_comm")) << run.output;
  EXPECT_EQ(run.summary["mem_comm"].get<double>(), 0) << run.output;
  EXPECT_EQ(run.summary["plan_mem_comm"].get<double>(), 0);
  EXPECT_TRUE(run.summary["answer_accuracy"].is_number()) << "validation ran: " << run.summary.dump();
}

// Each run's summary line carries the planner's memory per tag beside the training steps'
// peaks (within 5%), its bytes per step beside pipeline rank 0's last step (equal), and its
// step time with a hardware profile (null without); the printed summary has the lines.
TEST(PlanReport, PredictedBesideMeasured) {
  struct Run {
    std::string name, family;
    int ranks;
    int global, micro;
    std::string keys;
  };
  const std::vector<Run> runs = {
      {"one", "gpt2", 1, 4, 2, " --logging.hardware=h100"},
      {"dp2_zero1", "gpt2", 2, 4, 1, " --parallel.zero=1"},
      {"tp2", "llama", 2, 2, 1, " --parallel.tp=2 --logging.hardware=h100"},
      {"pp2_1f1b", "llama", 2, 4, 1, " --parallel.pp=2 --parallel.pp_schedule=1f1b"},
      {"cp2", "gpt2", 2, 2, 1, " --parallel.cp=2"},
      // DDP's cheaper reductions, several buckets each: rank 0's bytes as the communicator
      // counts them, and their buffers
      {"dp4_hier", "gpt2", 4, 4, 1,
       " --parallel.hierarchical=true --parallel.ranks_per_node=2 --parallel.grad_comm_dtype=bf16 --parallel.bucket_mb=0.02"},
      {"dp4_hier_zero2", "llama", 4, 4, 1, " --parallel.zero=2 --parallel.hierarchical=true --parallel.ranks_per_node=2"},
      {"dp2_int8", "llama", 2, 4, 1, " --parallel.grad_compression=int8 --parallel.bucket_mb=0.02"},
      {"dp2_zero1_int8", "gpt2", 2, 4, 1, " --parallel.zero=1 --parallel.grad_compression=int8"},
      {"dp2_psgd", "gpt2", 2, 4, 1, " --parallel.grad_compression=powersgd --parallel.powersgd_rank=2 --parallel.bucket_mb=0.02"},
  };
  const TempDir d;
  const std::string data = " --data.path=" + write_tokens(d, "t.bin", 3000, 37);
  for (const Run& r : runs) {
    SCOPED_TRACE(r.name);
    const RunResult x = train_run(d, r.name, r.ranks, options(r.family, r.global, r.micro) + data + r.keys);
    const nlohmann::json& s = x.summary;
    ASSERT_TRUE(s.contains("plan_mem_params")) << x.output;
    for (const char* tag : {"params", "grads", "optim", "activations", "comm"}) {
      const double want = s[std::string("plan_mem_") + tag], got = s[std::string("mem_steps_") + tag];
      std::printf("%-10s %-12s predicted %9.0f measured %9.0f\n", r.name.c_str(), tag, want, got);
      EXPECT_NEAR(want, got, 0.05 * got) << tag;
      if (std::string(tag) != "comm" || r.ranks > 1) EXPECT_GT(got, 0) << tag;
    }
    // The steps' peaks are no more than the run's (which include the final validation).
    EXPECT_LE(s["mem_steps_params"].get<double>(), s["mem_params"].get<double>());
    for (const char* axis : {"dp", "tp", "pp", "cp"}) {
      const double want = s[std::string("plan_comm_bytes_") + axis], got = s[std::string("comm_bytes_") + axis + "_step"];
      EXPECT_EQ(want, got) << axis;
      const bool split = (std::string(axis) == "dp" && (r.name.rfind("dp", 0) == 0 || r.name == "cp2")) ||
                         (std::string(axis) == "tp" && r.name == "tp2") || (std::string(axis) == "pp" && r.name == "pp2_1f1b") ||
                         (std::string(axis) == "cp" && r.name == "cp2");
      if (split) EXPECT_GT(got, 0) << axis;
      else EXPECT_EQ(got, 0) << axis;
    }
    const bool hw = has(r.keys, "logging.hardware");
    ASSERT_TRUE(s.contains("plan_step_s"));
    if (hw) {
      ASSERT_TRUE(s["plan_step_s"].is_number()) << s.dump();
      EXPECT_GT(s["plan_step_s"].get<double>(), 0);
      EXPECT_LT(s["plan_step_s"].get<double>(), 1);  // a tiny model on an H100
      EXPECT_TRUE(has(x.output, "planner, step time with h100:")) << x.output;
    } else {
      EXPECT_TRUE(s["plan_step_s"].is_null()) << s.dump();
      EXPECT_TRUE(has(x.output, "planner, step time: set logging.hardware")) << x.output;
    }
    EXPECT_EQ(count(x.output, "planner, memory per tag (predicted / measured):"), 1u) << x.output;
    EXPECT_EQ(count(x.output, "planner, bytes per step (predicted / measured):"), 1u) << x.output;
  }
}
