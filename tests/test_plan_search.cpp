// The planner's layout text, its search over every layout a cluster can run, and the H100
// calibration against torchtitan's published run (plan/plan.h, plan/search.h). The command
// and a run's own prediction: test_plan_command.cpp.
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
#include "core/message.h"
#include "plan/hardware.h"
#include "plan/search.h"
#include "plan/time.h"
#include "plan_tests.h"
#include "train_runs.h"

using namespace mt;
using namespace mt::plan;
using namespace mt::test;

namespace {

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
  // A field given twice, under its name or an alias, is refused (the last would win silently).
  for (const char* twice : {"sp=1,sequence_parallel=false", "tp=2,tp=4", "chunks=2,v=4"}) {
    SCOPED_TRACE(twice);
    EXPECT_THROW(
        try { layout_parse(twice); } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("given twice"), std::string::npos) << e.what();
          throw;
        },
        Error);
  }
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
  EXPECT_TRUE(has(error_of([] { layout_parse("recompute=some"); }), "none, selective, full or a count of blocks"));
  // A count of blocks per chunk: 0 is none, and a count reads back as written.
  EXPECT_EQ(layout_parse("recompute=0").recompute, "none");
  EXPECT_EQ(layout_parse("recompute=3").recomputed(), Recompute{3});
  EXPECT_EQ(layout_parse("recompute=3").text(), layout_parse(layout_parse("recompute=3").text()).text());
  EXPECT_EQ(layout_parse("recompute=full").recomputed(), Recompute{Recompute::kAll});
  EXPECT_FALSE(layout_parse("recompute=selective").recomputed().any());
}

// ---- The search ---------------------------------------------------------------------------

// The divisors the search ranges over and the messages list: by trial to the square root
// (trials to n took 65 s for a message about dp = 2^31 - 1), of every size int64 holds.
TEST(PlanSearch, DivisorsAndTheirText) {
  EXPECT_EQ(divisors(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(divisors(12), (std::vector<int64_t>{1, 2, 3, 4, 6, 12}));
  EXPECT_EQ(divisors(49), (std::vector<int64_t>{1, 7, 49}));
  EXPECT_EQ(divisors(2147483647), (std::vector<int64_t>{1, 2147483647}));
  EXPECT_EQ(divisors(int64_t{1} << 40).size(), 41u);
  EXPECT_TRUE(divisors(0).empty());
  EXPECT_EQ(values_text(divisors(12)), "1, 2, 3, 4, 6 or 12");
  EXPECT_EQ(values_text(divisors(12), 4), "1, 2, 3, 4, ...");
  EXPECT_EQ(values_text(divisors(12), 6), "1, 2, 3, 4, 6 or 12");
  EXPECT_EQ(values_text({}), "");
  EXPECT_EQ(values_where(1, 10, [](int64_t n) { return n % 3 == 0; }), "3, 6 or 9");
  EXPECT_EQ(values_where(1, 100, [](int64_t n) { return n % 3 == 0; }, 2), "3, 6, ...");
}

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
                         "dp=2,cp=2", "pp=4,schedule=1f1b", "tp=2,sp=1", "v=2"};
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
  EXPECT_TRUE(recomputes.count("none") && recomputes.count("full"));
  for (const std::string& rc : recomputes)
    EXPECT_TRUE(rc == "none" || rc == "full" || Layout{.recompute = rc}.recomputed().any()) << rc;
  EXPECT_TRUE(mbs.count(1) && mbs.count(8)) << "micro-batches 1 .. 8 divide 32 / 4";
}

// A named v holds: only pipelines (pp > 1) hold v chunks per rank (the search once ran the
// pp = 1 layouts with v = 1). Where v leaves no layout, search_closest says why by v and pp.
TEST(PlanSearch, NamedChunksNeedAPipeline) {
  const Question q = bench_question(4, hardware_get("h100"));
  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult r = search(q, layout_parse("v=2", base));
  ASSERT_FALSE(r.ranked.empty());
  for (const Prediction& p : r.ranked) {
    EXPECT_GT(p.layout.pp, 1) << p.layout.text();
    EXPECT_EQ(p.layout.chunks, 2) << p.layout.text();
  }
  const auto refusal = [&](const Question& question, const char* text) {
    try {
      search_closest(question, layout_parse(text, base));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string named = refusal(q, "pp=1,v=2,schedule=zbv");
  EXPECT_TRUE(has(named, "--layout v=2 with pp=1: v is the model chunks each pipeline rank holds")) << named;
  EXPECT_FALSE(has(named, "parallel.pp_chunks")) << named;
  for (const char* schedule : {"zbv", "interleaved"}) {  // the engine's "set parallel.pp_chunks=2"
    const std::string text = std::string("pp=1,schedule=") + schedule, why = refusal(q, text.c_str());
    EXPECT_TRUE(has(why, std::string("--layout schedule=") + schedule + " with pp=1: " + schedule + " runs 2 model "
                         "chunks on each pipeline rank and needs a pipeline (pp > 1)")) << why;
  }
  const std::string one = refusal(bench_question(1, hardware_get("h100")), "v=2");
  EXPECT_TRUE(has(one, "--layout v=2: v is the model chunks")) << one;
  EXPECT_TRUE(has(one, "no pp > 1 fits the 1 GPUs")) << one;
}

// The pipeline's message tags bound 2 x micro-batches x stages at every pp, pp = 1 too (the
// engine builds a pipeline of one stage): at a global batch of 2^21 sequences on 8 GPUs no
// layout runs, and every family says why (the pp = 1 ones were once ranked, then dropped
// by the schedule check without a word).
TEST(PlanSearch, MessageTagsBoundEveryPipeline) {
  Question q = bench_question(8, hardware_get("h100"));
  q.global_batch = 2097152;
  Layout base;
  base.global_batch = q.global_batch;
  const auto problem = layout_problem(q, layout_parse("dp=8,tp=1,pp=1,cp=1,mb=16", base), /*full=*/false);
  ASSERT_TRUE(problem.has_value());
  EXPECT_TRUE(has(*problem, "16384 micro-batches over 1 pipeline stage are more than the engine's transfers can "
                            "tell apart")) << *problem;
  const SearchResult r = search(q, base);
  EXPECT_TRUE(r.ranked.empty()) << r.ranked.front().layout.text();
  std::map<std::string, std::string> why;
  int layouts = 0;
  for (const Rejected& x : r.rejected) why[x.family] = x.reason, layouts += x.layouts;
  EXPECT_EQ(layouts, r.tried) << "every layout tried is in a rejected family";
  for (const char* family : {"tp=1,pp=1,cp=1", "tp=2,pp=1,cp=1", "tp=1,pp=1,cp=2", "tp=1,pp=2,cp=1"}) {
    ASSERT_TRUE(why.count(family)) << family;
    EXPECT_TRUE(has(why[family], "tell apart")) << family << ": " << why[family];
  }
}

// Where keeping every block's activations does not fit, the search also weighs the fewest
// blocks of each chunk recomputing that fit: with memory for a 6-block model that recomputes
// 2 blocks (recomputing 1 keeps as much as none: the recomputed blocks share one set), it
// ranks recompute=2 first, ahead of recompute=full (2 block forwards again, not 6), and no
// layout keeping every block's activations.
TEST(PlanSearch, FewestRecomputedBlocksThatFit) {
  Question q = bench_question(1, cpu_like());
  ASSERT_EQ(q.config.model.n_layer, 6);
  Layout base;
  base.global_batch = q.global_batch;
  base = layout_parse("mb=8", base);
  const auto peak = [&](const char* rc) {
    return predict(q, layout_parse(std::string("recompute=") + rc, base)).memory.peak;
  };
  EXPECT_EQ(peak("1"), peak("none"));
  EXPECT_LT(peak("2"), peak("1"));
  EXPECT_LT(peak("full"), peak("2"));
  q.cluster.hw.mem_bytes = peak("2");
  const SearchResult r = search(q, base);
  expect_well_formed(q, base, r, "recompute=2 fits");
  ASSERT_GE(r.ranked.size(), 2u);
  EXPECT_EQ(r.ranked[0].layout.recompute, "2");
  EXPECT_EQ(r.ranked[1].layout.recompute, "full");
  EXPECT_LT(r.ranked[0].time.step_s, r.ranked[1].time.step_s);
  for (const Prediction& p : r.ranked) EXPECT_NE(p.layout.recompute, "none") << p.layout.text();
}

// A configured split (parallel.pp_layers = 1,5) fixes the pipeline's stages: every layout
// ranked has pp x v = 2, and its time is the step of that split, not auto's (4,2 here: the
// head weighs about 1.6 blocks); the families whose stages it does not fit are refused by
// the key's name (the search once stopped at the first of them with that error).
TEST(PlanSearch, ConfiguredSplitFixesTheStages) {
  Question q = bench_question(4, cpu_like());
  q.config.parallel.pp = 2;
  q.config.parallel.pp_layers = "1,5";
  Layout base;
  base.global_batch = q.global_batch;
  const SearchResult r = search(q, base);
  expect_well_formed(q, base, r, "pp_layers = 1,5");
  EXPECT_EQ(pipeline_shape(q.config.model, r.ranked[0].layout).ranks[0][0].blocks(), 4);  // auto: 4,2
  for (const Prediction& p : r.ranked) {
    SCOPED_TRACE(p.layout.text());
    EXPECT_EQ(p.layout.pp * p.layout.chunks, 2);
    TrafficOptions o = traffic(q.config), even = o;
    even.pp_layers = "auto";
    EXPECT_EQ(p.time.step_s, step_time(q.config.model, p.layout, q.cluster, q.precision, o).step_s);
    EXPECT_NE(p.time.step_s, step_time(q.config.model, p.layout, q.cluster, q.precision, even).step_s);
  }
  bool one_stage = false;
  for (const Rejected& x : r.rejected)
    if (x.family == "tp=1,pp=1,cp=1") {
      one_stage = true;
      EXPECT_NE(x.reason.find("parallel.pp_layers = \"1,5\" lists 2 stages"), std::string::npos) << x.reason;
    }
  EXPECT_TRUE(one_stage);
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
