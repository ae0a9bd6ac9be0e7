// The `meshtrain plan` command, and the prediction every training run prints beside what it
// measured (cli/plan_cmd.cpp, train/plan_report.h).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "plan/search.h"
#include "plan_tests.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::plan;
using namespace mt::test;

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
  EXPECT_FALSE(has(f.printed, "parallel.pp_layers")) << f.printed;
  // A configured split is named, and every layout listed has its two stages.
  const Plan s = plan_cmd(d, "--config " + kBench + " --gpus 2 --hardware h100 --top 3 --set parallel.pp=2 "
                                                   "--set parallel.pp_layers=2,4");
  ASSERT_EQ(s.rc, 0) << s.out;
  EXPECT_TRUE(has(s.printed, "pipeline stages of 2,4 blocks (parallel.pp_layers)")) << s.printed;
  EXPECT_EQ(count(s.printed, ",pp=2,cp=1,v=1,"), 4u) << s.printed;  // three ranked, the best's breakdown
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
  // fp32 gradients sent in 16 bits: said in the header (the bytes and buffers assume it)
  const Plan sent = plan_cmd(d, cfg + "--set parallel.grad_comm_dtype=bf16");
  EXPECT_TRUE(has(sent.printed, "bf16, fp32 gradients reduced in bf16\n")) << sent.printed;
}

// The configuration's training.precision is planned where no --precision is given, and
// --precision is the configuration's before it is checked (its grad_dtype once was checked
// against fp32); the configuration's own pair the engine refuses is refused by its keys.
TEST(PlanCommand, PrecisionIsTheConfigurations) {
  const TempDir d;
  const std::string cfg = "--config " + kBench + " --gpus 2 --hardware h100 --top 1 ";
  const Plan half = plan_cmd(d, cfg + "--set training.precision=fp16 --set training.grad_dtype=fp16");
  ASSERT_EQ(half.rc, 0) << half.out;
  EXPECT_TRUE(has(half.printed, "fp16 with fp16 gradients")) << half.printed;
  const Plan kept = plan_cmd(d, cfg + "--set training.precision=fp16");
  ASSERT_EQ(kept.rc, 0) << kept.out;
  EXPECT_TRUE(has(kept.printed, "tokens, fp16\n")) << kept.printed;
  const Plan given = plan_cmd(d, cfg + "--precision=bf16 --set training.grad_dtype=bf16");
  ASSERT_EQ(given.rc, 0) << given.out;
  EXPECT_TRUE(has(given.printed, "bf16 with bf16 gradients")) << given.printed;
  const Plan over = plan_cmd(d, cfg + "--precision=bf16 --set training.precision=fp16 --set training.grad_dtype=fp16");
  ASSERT_EQ(over.rc, 0) << over.out;  // --grad-dtype's default: fp32 where the configuration's is not the precision's
  EXPECT_TRUE(has(over.printed, "tokens, bf16\n")) << over.printed;
  const Plan bad = plan_cmd(d, cfg + "--set training.precision=bf16 --set training.grad_dtype=fp16");
  EXPECT_EQ(bad.rc, 1) << bad.out;
  EXPECT_TRUE(has(bad.out, "training.grad_dtype = \"fp16\" under training.precision = bf16")) << bad.out;
}

// A named v holds (it once fell away where the search chose pp = 1).
TEST(PlanCommand, NamedChunksHold) {
  const TempDir d;
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 4 --gpus-per-node 4 --hardware h100 --layout v=2 --json");
  ASSERT_EQ(p.rc, 0) << p.out;
  const nlohmann::json l = parse(p.printed)["layouts"][0]["layout"];
  EXPECT_EQ(l["pp_chunks"], 2) << l.dump();
  EXPECT_GT(l["pp"].get<int>(), 1) << l.dump();
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
    // The largest cluster --gpus takes: its divisors by trial up to the square root (the
    // loop to 2^31 - 1 wrapped round to a division by zero), and no layout with advice
    // for too few devices.
    const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 2147483647");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "no layout runs at all: change --gpus or --global-batch")) << p.out;
    EXPECT_FALSE(has(p.out, "use more GPUs")) << p.out;
    expect_one_error(p.out, "no layout of this model fits");
    const Plan q = plan_cmd(d, "--config " + kBench + " --gpus 2147483647 --layout shard_group=8");
    EXPECT_EQ(q.rc, 1) << q.out;
    EXPECT_TRUE(has(q.out, "parallel.shard_group = 8 does not divide dp = 2147483647; parallel.shard_group can be 1 "
                           "or 2147483647")) << q.out;
  }
  for (const char* layout : {"tp=2147483648", "mb=1099511627777"}) {  // past int and 2^40: refused, not wrapped
    const Plan p = plan_cmd(d, cfg + "--layout " + layout);
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "expected a whole number from 1 to")) << p.out;
    expect_one_error(p.out, layout);
  }
  // --top, --global-batch (whose -1 once read as "not given") and --precision out of range:
  // the option named, what it takes.
  for (const char* top : {"0", "-5"}) {
    const Plan p = plan_cmd(d, cfg + "--top " + top);
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, std::string("--top ") + top + ": give the number of layouts to list, at least 1")) << p.out;
    expect_one_error(p.out, top);
  }
  for (const char* gb : {"-1", "0", "-7"}) {
    const Plan p = plan_cmd(d, cfg + "--global-batch " + gb);
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, std::string("--global-batch: ") + gb + " sequences per step: give at least 1")) << p.out;
    expect_one_error(p.out, gb);
  }
  {
    const Plan p = plan_cmd(d, cfg + "--precision fp8");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "--precision fp8: use fp32, bf16 or fp16")) << p.out;
    expect_one_error(p.out, "fp8");
  }
  {
    // v chunks per rank need a pipeline: said by the layout's fields, not a key not set.
    const Plan p = plan_cmd(d, cfg + "--layout pp=1,v=2,schedule=zbv");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "--layout v=2 with pp=1:")) << p.out;
    EXPECT_FALSE(has(p.out, "parallel.pp_chunks")) << p.out;
    expect_one_error(p.out, "v=2");
  }
  {
    // A named layout the engine refuses: the engine's reason.
    const Plan p = plan_cmd(d, cfg + "--layout tp=4");
    EXPECT_EQ(p.rc, 1) << p.out;
    EXPECT_TRUE(has(p.out, "--layout tp=4: model.n_head = 6 does not split over parallel.tp = 4")) << p.out;
    expect_one_error(p.out, "tp=4");
  }
}

// The slowest device a profile may describe, a huge model and batch: every figure prints
// whole, with its unit (they were cut at 31 characters: "step 4755...200.00, 0 tokens/s").
TEST(PlanCommand, LongFiguresPrintWhole) {
  const TempDir d;
  Hardware slow = cpu_like();
  slow.flops_fp32 = slow.flops_bf16 = slow.flops_fp16 = 1e6, slow.efficiency = 1e-4;
  slow.mem_bytes = 1e15, slow.latency_s = 10;
  slow.mem_bw = slow.intra_node_bw = slow.inter_node_bw = 1e3;
  write_file(d / "slow.toml", hardware_to_toml(slow));
  const Plan p = plan_cmd(d, "--config " + kBench + " --gpus 1 --hardware " + (d / "slow.toml") +
                                 " --layout mb=1099511627776,gb=1099511627776 --set model.n_layer=4096 "
                                 "--set model.d_model=65536 --set model.n_head=64");
  EXPECT_EQ(p.rc, 1) << p.out;  // 2.6e14 GiB does not fit
  EXPECT_TRUE(has(p.printed, ".00 s, bubble 0.0%: step ")) << p.printed;
  EXPECT_TRUE(has(p.printed, "00.00 s, 0 tokens/s")) << p.printed;
  EXPECT_TRUE(has(p.printed, "GiB: does not fit")) << p.printed;
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
