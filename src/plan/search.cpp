#include "plan/search.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/message.h"  // divisors
#include "parallel/schedule.h"  // schedule_default_chunks, schedule_splits_backward
#include "plan/comm.h"
#include "plan/memory.h"
#include "plan/time.h"

namespace mt::plan {

namespace {

// The configuration the engine would run this layout with.
Config layout_config(const Question& q, const Layout& l) {
  Config c = q.config;
  c.parallel.dp = l.dp, c.parallel.tp = l.tp, c.parallel.pp = l.pp, c.parallel.cp = l.cp;
  c.parallel.pp_chunks = l.chunks;
  c.parallel.pp_schedule = l.schedule;
  c.parallel.zero = l.zero;
  c.parallel.sharding.clear();
  c.parallel.shard_group = l.shard_group;
  c.parallel.sequence_parallel = l.sequence_parallel;
  const Recompute r = l.recomputed();
  c.training.recompute = r.any();
  c.training.recompute_blocks = r.blocks != Recompute::kAll ? r.blocks : 0;
  c.training.micro_batch = l.micro_batch;
  c.training.global_batch = l.global_batch;
  return c;
}

std::string gib(double bytes) {
  char s[400];  // "%.1f" of any finite double fits (at most 309 digits before the point)
  std::snprintf(s, sizeof s, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  return s;
}

std::string family_of(const Layout& l) {
  return "tp=" + std::to_string(l.tp) + ",pp=" + std::to_string(l.pp) + ",cp=" + std::to_string(l.cp);
}

std::vector<int> divisors_of(int n) {  // divisors() as ints
  const std::vector<int64_t> d = divisors(n);
  return {d.begin(), d.end()};
}

}  // namespace

TrafficOptions traffic(const Config& c) {
  TrafficOptions t;
  t.grad_comm_dtype = c.parallel.grad_comm_dtype;
  t.reshard_after_forward = c.parallel.reshard_after_forward;
  t.bucket_mb = c.parallel.bucket_mb;
  t.hierarchical = c.parallel.hierarchical;
  t.ranks_per_node = c.parallel.ranks_per_node;
  t.grad_compression = c.parallel.grad_compression;
  t.powersgd_rank = c.parallel.powersgd_rank;
  t.pp_layers = c.parallel.pp_layers;
  t.optim = c.optim.name;
  return t;
}

MemoryKnobs knobs(const Config& c) {
  MemoryKnobs k;
  k.bucket_mb = c.parallel.bucket_mb;
  k.grad_comm_dtype = c.parallel.grad_comm_dtype;
  k.prefetch = c.parallel.prefetch;
  k.reshard_after_forward = c.parallel.reshard_after_forward;
  k.pp_layers = c.parallel.pp_layers;
  k.hierarchical = c.parallel.hierarchical;
  k.ranks_per_node = c.parallel.ranks_per_node;
  k.grad_compression = c.parallel.grad_compression;
  k.powersgd_rank = c.parallel.powersgd_rank;
  return k;
}

std::optional<std::string> layout_problem(const Question& q, const Layout& l, bool full) {
  if (l.ranks() != q.cluster.gpus)
    return "dp x tp x pp x cp = " + std::to_string(l.ranks()) + " ranks, but the cluster has " +
           std::to_string(q.cluster.gpus) + " GPUs; choose sizes whose product is " + std::to_string(q.cluster.gpus);
  if (l.recompute == "selective")
    return "recompute=selective is not something meshtrain trains (its fused attention keeps no T x T "
           "scores to drop); use recompute=none or full";
  try {
    Config c = layout_config(q, l);
    c.validate();
    c.resolve_layout(q.cluster.gpus, full);
    pipeline_shape(c.model, l, c.parallel.pp_layers);  // a parallel.pp_layers list fits the stages
    const int64_t m = l.micro_batches(), stages = int64_t{l.pp} * l.chunks;
    // The engine's pipeline numbers its transfers at every pp (pipeline.cpp), pp = 1 too.
    MT_CHECK(2 * m * stages <= Communicator::kMaxPostTag,
             m << " micro-batches over " << stages << (stages == 1 ? " pipeline stage" : " pipeline stages")
               << " are more than the engine's transfers can tell apart (2 x micro-batches x stages at most "
               << Communicator::kMaxPostTag << "); use a larger micro-batch");
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

namespace {

Memory memory_of(const Question& q, const Layout& l) {
  return memory_per_rank(q.config.model, l, q.precision, q.config.optim.name, knobs(q.config));
}

// predict for a layout the engine accepts (layout_problem says nothing), whose memory is known.
Prediction predict_accepted(const Question& q, const Layout& l, const Memory& memory) {
  Prediction p;
  p.layout = l;
  const ModelConfig& model = q.config.model;
  p.memory = memory;
  p.comm = comm_bytes(model, l, q.precision, traffic(q.config));
  p.time = step_time(model, l, q.cluster, q.precision, traffic(q.config));
  if (p.memory.peak > q.cluster.hw.mem_bytes) {
    p.fits = false;
    p.why_not = "needs " + gib(p.memory.peak) + " per GPU, the " + q.cluster.hw.name + " has " +
                gib(q.cluster.hw.mem_bytes);
  }
  return p;
}

}  // namespace

Prediction predict(const Question& q, const Layout& l) {
  if (auto problem = layout_problem(q, l, /*full=*/false)) {  // the formulas assume a layout that runs
    Prediction p;
    p.layout = l;
    p.fits = false;
    p.why_not = *problem;
    return p;
  }
  return predict_accepted(q, l, memory_of(q, l));
}

namespace {

// Candidate layouts matching base's named fields (unnamed fields range as search.h says).
std::vector<Layout> candidates(const Question& q, const Layout& base) {
  const auto named = [&](const char* k) { return base.named.count(k) > 0; };
  // The values a field takes: the named one, or the open range.
  const auto values = [&](const char* k, int given, const std::vector<int>& open) {
    return named(k) ? std::vector<int>{given} : open;
  };
  const int G = q.cluster.gpus;
  std::vector<Layout> out;
  for (int tp : values("tp", base.tp, divisors_of(std::min(G, q.cluster.gpus_per_node))))
    for (int pp : values("pp", base.pp, divisors_of(G)))
      for (int cp : values("cp", base.cp, {1, 2, 4, 8})) {
        const int64_t model_ranks = int64_t{tp} * pp * cp;
        if (G % model_ranks != 0 || (!named("pp") && pp > q.config.model.n_layer)) continue;
        if (named("v") && base.chunks > 1 && pp == 1) continue;  // v chunks per rank need a pipeline
        const int dp = static_cast<int>(G / model_ranks);
        if (named("dp") && dp != base.dp) continue;
        // A named schedule without v runs its own default chunks (interleaved and zbv: 2).
        std::vector<std::pair<std::string, int>> schedules = {
            {base.schedule, named("v") ? base.chunks : schedule_default_chunks(base.schedule)}};
        if (!named("schedule") && pp > 1) schedules = {{"1f1b", 1}, {"interleaved", 2}, {"zb-h1", 1}, {"zbv", 2}};
        for (auto& s : schedules)
          if (named("v")) s.second = base.chunks;
        std::vector<int> mbs;
        for (int mb = 1; mb <= 16; ++mb)
          if (q.global_batch % (int64_t{dp} * mb) == 0) mbs.push_back(mb);
        if (mbs.empty()) mbs = {1};  // layout_problem names the batch that does not divide
        for (const auto& [schedule, v] : schedules)
          for (int zero : values("zero", base.zero, dp * cp > 1 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0}))
            for (int sp : values("sp", base.sequence_parallel, tp > 1 ? std::vector<int>{0, 1} : std::vector<int>{0}))
              for (const std::string& rc : named("recompute") ? std::vector<std::string>{base.recompute}
                                                              : std::vector<std::string>{"none", "full"}) {
                if (!named("recompute") && rc == "full" && schedule_splits_backward(schedule)) continue;
                for (int64_t mb : named("mb") ? std::vector<int64_t>{base.micro_batch}
                                              : std::vector<int64_t>(mbs.begin(), mbs.end())) {
                  Layout l = base;
                  l.dp = dp, l.tp = tp, l.pp = pp, l.cp = cp, l.chunks = pp > 1 ? v : 1, l.schedule = schedule;
                  l.zero = zero, l.sequence_parallel = sp, l.recompute = rc, l.micro_batch = mb;
                  l.global_batch = q.global_batch;
                  out.push_back(l);
                }
              }
      }
  return out;
}

// For a layout l that keeps every block's activations and does not fit: l with the fewest
// blocks of each chunk recomputing (recompute=N) that fits, the fastest of those that fit
// (each block more recomputes its forward again); none when only recomputing every block
// fits (full, a candidate of its own) or nothing does. Memory falls as N grows (each count
// more drops a block's activations from every slot of a chunk that has more blocks, and
// one shared set of them is held from N = 1), so the count is bisected.
std::optional<std::pair<Layout, Memory>> fewest_recomputed(const Question& q, const Layout& l) {
  int most = 0;  // blocks of the largest chunk
  for (const auto& chunks : pipeline_shape(q.config.model, l, q.config.parallel.pp_layers).ranks)
    for (const ChunkShare& ch : chunks) most = std::max(most, ch.blocks());
  std::optional<std::pair<Layout, Memory>> best;
  for (int lo = 1, hi = most - 1; lo <= hi;) {
    const int k = lo + (hi - lo) / 2;
    Layout t = l;
    t.recompute = std::to_string(k);
    const Memory m = memory_of(q, t);
    if (m.peak <= q.cluster.hw.mem_bytes) best.emplace(t, m), hi = k - 1;
    else lo = k + 1;
  }
  return best;
}

}  // namespace

SearchResult search(const Question& q, const Layout& base) {
  SearchResult r;
  struct Family {
    int tried = 0;
    std::string problem;           // the first engine refusal seen
    std::string refused;           // the first refusal of a layout that fits, once its schedule is checked
    double least_peak = -1;        // the smallest peak among layouts that run
    std::string least_layout;
  };
  std::map<std::string, Family> families;
  for (const Layout& l : candidates(q, base)) {
    ++r.tried;
    Family& f = families[family_of(l)];
    ++f.tried;
    if (auto problem = layout_problem(q, l, /*full=*/false)) {
      if (f.problem.empty()) f.problem = *problem;
      continue;
    }
    const Memory mem = memory_of(q, l);
    if (mem.peak > q.cluster.hw.mem_bytes) {
      if (f.least_peak < 0 || mem.peak < f.least_peak) f.least_peak = mem.peak, f.least_layout = l.text();
      if (base.named.count("recompute") || l.recompute != "none" || schedule_splits_backward(l.schedule)) continue;
      if (auto partial = fewest_recomputed(q, l)) {
        ++r.tried, ++f.tried;
        r.ranked.push_back(predict_accepted(q, partial->first, partial->second));
      }
      continue;
    }
    r.ranked.push_back(predict_accepted(q, l, mem));
  }
  // Fastest first; between layouts equally fast (to a part in a million), the simpler (fewer
  // axes split, a lower ZeRO stage), then the larger micro-batch (larger products run
  // nearer peak, which the time model does not count: on this machine 1 x 256 tokens runs
  // 15% slower than 4 x 256), then the one needing less memory.
  const auto simpler = [](const Layout& l) { return (l.tp > 1) + (l.pp > 1) + (l.cp > 1) + l.zero + l.sequence_parallel; };
  std::stable_sort(r.ranked.begin(), r.ranked.end(), [&](const Prediction& a, const Prediction& b) {
    if (std::abs(a.time.step_s - b.time.step_s) > 1e-6 * std::max(a.time.step_s, b.time.step_s))
      return a.time.step_s < b.time.step_s;
    if (simpler(a.layout) != simpler(b.layout)) return simpler(a.layout) < simpler(b.layout);
    if (a.layout.micro_batch != b.layout.micro_batch) return a.layout.micro_batch > b.layout.micro_batch;
    return a.memory.peak < b.memory.peak;
  });
  // The fastest few are checked as the engine would (their schedules built and checked); a
  // family left with no ranked layout is rejected with the engine's reason.
  for (size_t i = 0; i < r.ranked.size() && i < 20;) {
    if (auto problem = layout_problem(q, r.ranked[i].layout, /*full=*/true)) {
      Family& f = families[family_of(r.ranked[i].layout)];
      if (f.refused.empty()) f.refused = *problem;
      r.ranked.erase(r.ranked.begin() + i);
    } else {
      ++i;
    }
  }
  std::set<std::string> ranked;
  for (const Prediction& p : r.ranked) ranked.insert(family_of(p.layout));
  for (const auto& [fam, f] : families) {
    if (ranked.count(fam)) continue;
    std::string why = !f.refused.empty() ? f.refused
                      : f.least_peak >= 0 ? "does not fit: at least " + gib(f.least_peak) + " per GPU (" +
                                                f.least_layout + "), the " + q.cluster.hw.name + " has " +
                                                gib(q.cluster.hw.mem_bytes)
                                          : f.problem;
    r.rejected.push_back({fam, why, f.tried});
  }
  return r;
}

Layout search_closest(const Question& q, const Layout& base) {
  // A schedule of several chunks per rank names a pipeline: at pp = 1 the layout would run
  // pp_chunks = 1, which the engine refuses in its own keys.
  const int chunks = schedule_default_chunks(base.schedule);
  MT_CHECK(!(base.named.count("schedule") && base.named.count("pp") && base.pp == 1 && chunks > 1 && !base.named.count("v")),
           "--layout schedule=" << base.schedule << " with pp=1: " << base.schedule << " runs " << chunks
                                << " model chunks on each pipeline rank and needs a pipeline (pp > 1); name pp > 1 "
                                << "with it, or leave schedule out");
  const std::vector<Layout> all = candidates(q, base);
  if (all.empty() && base.named.count("v") && base.chunks > 1) {  // is v what leaves no layout?
    Layout open = base;
    open.named.erase("v");
    const std::string v = "v=" + std::to_string(base.chunks);
    const bool without_v = !candidates(q, open).empty();
    MT_CHECK(!without_v || !base.named.count("pp"),
             "--layout " << v << " with pp=" << base.pp << ": v is the model chunks each pipeline rank holds and needs "
                         << "a pipeline (pp > 1); name pp > 1 with it, or leave v out");
    MT_CHECK(!without_v,
             "--layout " << v << ": v is the model chunks each pipeline rank holds and needs a pipeline (pp > 1), but no "
                         << "pp > 1 fits the " << q.cluster.gpus << " GPUs with the fields named (pp divides the GPUs "
                         << "dp x tp x cp leave, at most model.n_layer = " << q.config.model.n_layer
                         << "); leave v out");
  }
  if (all.empty()) {
    int64_t fixed = 1;  // each size is at most 2^31 - 1: the product of four fits
    std::string named;
    for (const char* k : {"dp", "tp", "pp", "cp"})
      if (base.named.count(k)) {
        fixed *= k[0] == 'd' ? base.dp : k[0] == 't' ? base.tp : k[0] == 'p' ? base.pp : base.cp;
        named += std::string(named.empty() ? "" : " x ") + k;
      }
    MT_FAIL("--layout: dp x tp x pp x cp must multiply to the " << q.cluster.gpus << " GPUs, but " << named << " = "
                                                                 << fixed << " does not divide " << q.cluster.gpus
                                                                 << "; use sizes that divide it");
  }
  const Layout* best = nullptr;
  double least = 0;
  for (const Layout& l : all) {
    if (layout_problem(q, l, /*full=*/false)) continue;
    const double peak = memory_of(q, l).peak;
    if (!best || peak < least) best = &l, least = peak;
  }
  return best ? *best : all.front();
}

nlohmann::json prediction_json(const Prediction& p) {
  const Layout& l = p.layout;
  nlohmann::json j;
  j["layout"] = {{"dp", l.dp},
                 {"tp", l.tp},
                 {"pp", l.pp},
                 {"cp", l.cp},
                 {"pp_chunks", l.chunks},
                 {"pp_schedule", l.schedule},
                 {"zero", l.zero},
                 {"shard_group", l.shard()},
                 {"sequence_parallel", l.sequence_parallel},
                 {"recompute", l.recompute},
                 {"micro_batch", l.micro_batch},
                 {"global_batch", l.global_batch},
                 {"text", l.text()}};
  j["fits"] = p.fits;
  if (!p.fits) j["why_not"] = p.why_not;
  const Memory& m = p.memory;
  j["memory"] = {{"params", m.params}, {"grads", m.grads}, {"optim", m.optim}, {"activations", m.activations},
                 {"comm", m.comm},     {"other", m.other}, {"peak", m.peak}};
  j["comm_bytes"] = {{"dp", p.comm.dp}, {"tp", p.comm.tp}, {"pp", p.comm.pp}, {"cp", p.comm.cp}};
  j["comm_s"] = {{"dp", p.time.comm_s.dp}, {"tp", p.time.comm_s.tp}, {"pp", p.time.comm_s.pp}, {"cp", p.time.comm_s.cp}};
  j["compute_s"] = p.time.compute_s;
  j["exposed_comm_s"] = p.time.exposed_comm_s;
  j["bubble"] = p.time.bubble;
  j["step_s"] = p.time.step_s;
  j["tokens_per_s"] = p.time.tokens_per_s;
  j["mfu"] = p.time.mfu;
  return j;
}

}  // namespace mt::plan
