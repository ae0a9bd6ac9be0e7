#include "plan/time.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/error.h"
#include "nn/tp.h"
#include "parallel/schedule.h"

namespace mt::plan {

// ---- FLOPs -----------------------------------------------------------------------------

double model_flops_per_token(const ModelConfig& m) {
  const double C = m.d_model, D = m.head_dim(), NH = m.n_head, NKV = m.kv_heads(), F = m.ff_dim();
  const double block = (NH + 2 * NKV) * D * C + NH * D * C + (m.is_llama() ? 3 : 2) * C * F;
  const double weights = m.n_layer * block + double(m.vocab_size) * C;   // the head's product over the vocabulary
  const double attention = 6.0 * m.n_layer * m.seq_len * NH * D;        // 2 L T C forward, twice that backward
  return 6 * weights + attention;
}

namespace {

// Causal attention's forward FLOPs for one micro-batch through `blocks` blocks on one rank:
// each of its b T / cp queries against T / 2 keys on average, scores and values (2 x 2 D
// per key), over its NH / tp heads.
double attention_flops(const ModelConfig& m, const Layout& l, double blocks) {
  const double T = m.seq_len, tokens = double(l.micro_batch) * T / l.cp;
  return blocks * 2 * tokens * T * (m.n_head / l.tp) * m.head_dim();
}

}  // namespace

ChunkWork chunk_work(const ModelConfig& m, const Layout& l, const Precisions& prec, const ChunkShare& ch) {
  const int tp = l.tp;
  const double C = m.d_model, D = m.head_dim(), T = m.seq_len;
  const double NH = m.n_head / tp, NKV = m.kv_heads() % tp == 0 ? m.kv_heads() / tp : 1, F = m.ff_dim() / tp;
  const double V = static_cast<double>(padded_vocab(m, tp)) / tp;
  const double tokens = double(l.micro_batch) * T / l.cp;
  const double W = (NH + 2 * NKV) * D * C + NH * D * C + (m.is_llama() ? 3 : 2) * C * F;
  const double attn_f = attention_flops(m, l, 1);
  const bool fused = m.fused_attention() || l.cp > 1;  // the ring's parts are the fused kernel's
  const double attn_b = (fused ? 2.5 : 2.0) * attn_f;  // fused: the probabilities recomputed
  const double L = ch.blocks(), head = ch.head ? 2 * V * C * tokens : 0;
  ChunkWork w;
  w.f = L * (2 * W * tokens + attn_f) + head;
  w.bi = L * (2 * W * tokens + attn_b) + head;
  w.bw = L * 2 * W * tokens + head;
  w.bi += l.recomputed().of(ch.blocks()) * (2 * W * tokens + attn_f);  // the recomputed blocks' forward
  if (l.recompute == "selective" && !fused) w.bi += L * attn_f;
  if (!fused) {  // the T x T tensors, per head and sequence (time.h)
    const double square = double(l.micro_batch) * NH * T * T * prec.activation;  // one block's
    const double again = l.recompute == "selective" ? L : l.recomputed().of(ch.blocks());
    w.mem_f = 4 * L * square;
    w.mem_bi = 4.5 * L * square + 4 * again * square;
  }
  return w;
}

// ---- Stage costs -----------------------------------------------------------------------

namespace {

double compute_rate(const Cluster& c, const Precisions& prec) {
  const double peak = c.hw.flops(prec.name);
  MT_CHECK(peak > 0 && c.hw.efficiency > 0,
           "hardware profile " << (c.hw.name.empty() ? "(unnamed)" : c.hw.name) << " has no " << prec.name
                               << " FLOP/s peak or efficiency; set them in the profile");
  return peak * c.hw.efficiency;
}

// The context-parallel ring's time beyond what the attention parts computed meanwhile hide:
// a pass of k transfers alongside attention work a, all but the last part of which
// overlaps a transfer.
double ring_exposed(const Flow& ring, const Link& link, const Hardware& hw, double attention_s, int cp) {
  if (ring.messages == 0) return 0;
  if (!hw.gpu) return flow_time(ring, link, hw);  // a CPU's copies take the cores that compute
  return std::max(0.0, flow_time(ring, link, hw) - attention_s * (cp - 1) / cp);
}

}  // namespace

StageCosts stage_costs(const ModelConfig& model, const Layout& layout, const Cluster& cluster,
                       const Precisions& prec, const TrafficOptions& opt, bool with_comm) {
  MT_CHECK(!(layout.recomputed().any() && schedule_splits_backward(layout.schedule)),
           "layout " << layout.text() << ": recompute=" << layout.recompute << " cannot run with schedule "
                     << layout.schedule
                     << " (its split backward needs the activations in the weight half); use 1f1b or interleaved");
  const PipelineShape shape = pipeline_shape(model, layout, opt.pp_layers);
  const Hardware& hw = cluster.hw;
  const double rate = compute_rate(cluster, prec);
  const AxisLinks links = axis_links(layout, cluster);
  const int S = shape.stages();
  StageCosts c;
  c.f.assign(S, 0), c.b.assign(S, 0), c.bi.assign(S, 0), c.bw.assign(S, 0), c.rank_start.assign(shape.pp, 0);
  if (with_comm && layout.pp > 1) c.p2p = flow_time({pp_message_bytes(model, layout, prec), 1}, links.pp, hw);
  for (int r = 0; r < shape.pp; ++r) {
    double first_forwards = 0;
    for (const ChunkShare& ch : shape.ranks[r]) {
      const ChunkWork w = chunk_work(model, layout, prec, ch);
      double f = w.f / rate, bi = w.bi / rate, bw = w.bw / rate;
      if (hw.mem_bw > 0) f += w.mem_f / hw.mem_bw, bi += w.mem_bi / hw.mem_bw;
      first_forwards += f;
      if (with_comm) {
        const ActionFlows tp = tp_flows(model, layout, prec, ch), cp = cp_flows(model, layout, prec, ch);
        // the blocks' attention, which the ring's transfers overlap
        const double attn_f = attention_flops(model, layout, ch.blocks()) / rate;
        const double again = attention_flops(model, layout, layout.recomputed().of(ch.blocks())) / rate;
        const double attn_b = 2.5 * attn_f + again;
        f += flow_time(tp.f, links.tp, hw) + ring_exposed(cp.f, links.cp, hw, attn_f, layout.cp);
        bi += flow_time(tp.bi, links.tp, hw) + ring_exposed(cp.bi, links.cp, hw, attn_b, layout.cp);
        bw += flow_time(tp.bw, links.tp, hw);
      }
      c.f[ch.stage] = f, c.bi[ch.stage] = bi, c.bw[ch.stage] = bw, c.b[ch.stage] = bi + bw;
    }
    if (!with_comm || layout.zero < 3) continue;
    const DataPlan data = data_plan(model, layout, prec, opt, shape.ranks[r]);
    if (data.gather_forward.messages == 0) continue;
    const double first = flow_time(data.first_gather, links.shard, hw);
    const double gf = flow_time(data.gather_forward, links.shard, hw);
    if (layout.pp > 1) {  // once per step, hidden behind the rank's first forwards but the first unit's
      c.rank_start[r] = hw.gpu ? std::max(0.0, gf - first_forwards) + first : gf;
      continue;
    }
    // Without pipelining every micro-batch gathers (and reduce-scatters) behind its compute;
    // what shows is charged to the first stage (the forward's first and backward's last).
    double rs = 0, last = 0, f = 0, b = 0;
    for (const DataPlan::Reduction& red : data.reductions) last = flow_time(red.flow, links.shard, hw), rs += last;
    for (const ChunkShare& ch : shape.ranks[r]) f += c.f[ch.stage], b += c.b[ch.stage];
    const double gb = flow_time(data.gather_backward, links.shard, hw);
    const double more_f = hw.gpu ? std::max(f, gf) + first - f : gf;
    const double more_b = hw.gpu ? std::max(b, gb + rs) + last - b : gb + rs;
    c.f[0] += more_f, c.b[0] += more_b, c.bw[0] += more_b;
  }
  return c;
}

// ---- The simulator ---------------------------------------------------------------------

namespace {

// A schedule made, checked and replayed once: each rank's actions lie back to back from
// offset[rank]; `order` is the replay's order, each with its rank and, for a receive, the
// flat index of its send.
struct SimPlan {
  Schedule s;
  std::vector<int> offset;  // [pp + 1]
  struct Step {
    int at, rank, send;
  };
  std::vector<Step> order;
};

std::shared_ptr<const SimPlan> sim_plan(const std::string& name, int pp, int chunks, int micro) {
  using Key = std::tuple<std::string, int, int, int>;
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const SimPlan>> cache;
  const Key key{name, pp, chunks, micro};
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  auto plan = std::make_shared<SimPlan>();
  plan->s = schedule_make(name, pp, chunks, micro);
  const std::vector<std::string> problems = schedule_check(plan->s, 5);
  if (!problems.empty()) {
    std::string all;
    for (const std::string& p : problems) all += "\n  " + p;
    MT_FAIL("schedule " << name << " does not check:" << all);
  }
  plan->offset.assign(pp + 1, 0);
  for (int r = 0; r < pp; ++r) plan->offset[r + 1] = plan->offset[r] + static_cast<int>(plan->s.ranks[r].size());
  plan->order.reserve(plan->offset[pp]);
  schedule_replay(plan->s, [&](ActionRef at, const ActionRef* send) {
    plan->order.push_back({plan->offset[at.rank] + at.index, at.rank, send ? plan->offset[send->rank] + send->index : -1});
  });
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= 64) cache.clear();  // layouts searched one model at a time: a small working set
  cache.emplace(key, plan);
  return plan;
}

}  // namespace

PipelineRun pipeline_run(const std::string& schedule, int pp, int chunks, int micro, const StageCosts& costs,
                         Keep keep) {
  const std::shared_ptr<const SimPlan> plan = sim_plan(schedule, pp, chunks, micro);
  const Schedule& s = plan->s;
  const PipeLayout& L = s.layout;
  MT_CHECK(static_cast<int>(costs.f.size()) == L.stages() && static_cast<int>(costs.rank_start.size()) == pp,
           "internal: stage costs for " << costs.f.size() << " stages and " << costs.rank_start.size()
                                        << " ranks; the schedule has " << L.stages() << " and " << pp);
  const int n = plan->offset[pp];
  // Reused between calls (a big pipeline's fresh buffers cost more in page faults than the pass).
  static thread_local std::vector<double> start, end;
  start.resize(std::max<size_t>(start.size(), n)), end.resize(std::max<size_t>(end.size(), n));
  std::vector<double> prev(costs.rank_start);
  PipelineRun run;
  run.busy.assign(pp, 0);
  for (const SimPlan::Step& step : plan->order) {
    const Action& a = s.ranks[step.rank][step.at - plan->offset[step.rank]];
    const double t0 = prev[step.rank];
    double t1 = t0;
    if (a.is_recv()) {
      t1 = std::max(t0, start[step.send] + costs.p2p);  // the send posted at its start
    } else if (a.is_compute()) {
      const int st = L.stage(step.rank, a.chunk);
      const double d = a.kind == Action::F ? costs.f[st] : a.kind == Action::B ? costs.b[st]
                       : a.kind == Action::BI ? costs.bi[st] : costs.bw[st];
      t1 = t0 + d;
      run.busy[step.rank] += d;
    }
    start[step.at] = t0, end[step.at] = t1, prev[step.rank] = t1;
  }
  run.end = prev;
  run.ranks.resize(pp);
  double busy_all = 0;
  for (int r = 0; r < pp; ++r) {
    run.step = std::max(run.step, prev[r]);
    busy_all += run.busy[r];
    if (keep == Keep::none) continue;
    for (int i = 0; i < static_cast<int>(s.ranks[r].size()); ++i) {
      const Action& a = s.ranks[r][i];
      if (keep == Keep::all || a.kind == Action::B || a.kind == Action::BW)
        run.ranks[r].push_back({a, start[plan->offset[r] + i], end[plan->offset[r] + i]});
    }
  }
  run.bubble = run.step > 0 ? 1 - busy_all / (pp * run.step) : 0;
  return run;
}

Simulation pipeline_simulation(const ModelConfig& model, const Layout& layout, const Cluster& cluster,
                               const Precisions& prec, const TrafficOptions& opt) {
  const PipelineShape shape = pipeline_shape(model, layout, opt.pp_layers);
  const StageCosts costs = stage_costs(model, layout, cluster, prec, opt);
  PipelineRun run = pipeline_run(layout.schedule, shape.pp, shape.chunks, shape.micro, costs);
  Simulation sim;
  sim.name = layout.schedule;
  sim.layout = {shape.pp, shape.chunks, shape.micro, shape.vee ? Placement::vee : Placement::loop};
  ActionCosts& ac = sim.costs;  // the first rank's, as one rank's costs over its chunks
  ac.f = ac.b = ac.bi = ac.bw = 0;
  for (const ChunkShare& ch : shape.ranks[0])
    ac.f += costs.f[ch.stage], ac.b += costs.b[ch.stage], ac.bi += costs.bi[ch.stage], ac.bw += costs.bw[ch.stage];
  ac.send = 0, ac.recv = costs.p2p;
  sim.ranks = std::move(run.ranks);
  simulation_summarise(sim, run.busy);
  return sim;
}

// ---- The step --------------------------------------------------------------------------

namespace {

// When rank r's data-group reductions are done (see time.h): chunks' reductions launched
// while their backward runs, on one link in launch order.
double reductions_done(const DataPlan& data, const std::vector<TimedAction>& line, int chunks, const Link& link,
                       const Hardware& hw) {
  std::vector<double> t(chunks, 0), tail(chunks, 0);
  for (const DataPlan::Reduction& red : data.reductions) {
    tail[red.chunk] = flow_time(red.flow, link, hw);
    t[red.chunk] += tail[red.chunk];
  }
  std::vector<int> last(chunks, -1);  // each chunk's last backward that finishes weights
  for (int i = 0; i < static_cast<int>(line.size()); ++i)
    if (line[i].action.kind == Action::B || line[i].action.kind == Action::BW) last[line[i].action.chunk] = i;
  double free = 0, serial = 0;
  for (int i = 0; i < static_cast<int>(line.size()); ++i) {
    const TimedAction& a = line[i];
    if (a.action.kind != Action::B && a.action.kind != Action::BW) continue;
    const int c = a.action.chunk;
    if (!data.every_micro && i != last[c]) continue;
    if (t[c] == 0) continue;
    serial += t[c];
    free = std::max(free, a.start) + t[c];
    free = std::max(free, a.end + tail[c]);
  }
  // On a CPU the copies take the cores the compute uses: the reductions add to the rank's
  // timeline instead of running beside it.
  if (!hw.gpu) return (line.empty() ? 0 : line.back().end) + serial;
  return free;
}

// Seconds of AdamW's update on a rank holding `elements` (its shard): each element's
// gradient read, two moments read and written, the parameter (or its fp32 master, and then
// the working copy written) read and written, at the memory bandwidth.
double optimizer_time(double elements, const Precisions& p, const Hardware& hw) {
  if (hw.mem_bw <= 0) return 0;
  const double bytes = p.grad + 4 * p.moment + (p.master > 0 ? 2 * p.master + p.param : 2 * p.param);
  return elements * bytes / hw.mem_bw;
}

// What follows the last backward on rank r, in sequence: ZeRO 1-2's gather, HYBRID's
// replicas, the tied embedding's sum, the sums of the loss and gradient norm, the update.
double after_backward(const ModelConfig& model, const Layout& layout, const Cluster& cluster, const Precisions& prec,
                      const std::vector<ChunkShare>& chunks, const DataPlan& data,
                      const RankTraffic& traffic, const AxisLinks& links, double* optimizer_s) {
  const Hardware& hw = cluster.hw;
  double t = flow_time(data.after_step, links.shard, hw) + flow_time(data.replica, links.replicate, hw) +
             flow_time(data.scalars, links.shard, hw);
  const double units = model.n_layer + 2;
  if (layout.tp > 1) t += flow_time({8 * units * (layout.tp - 1), 1}, links.tp, hw);
  t += flow_time(traffic.pp_after, links.pp, hw);
  double elements = 0;
  const std::vector<double> numel = unit_numels(model, layout.tp);
  for (const HeldUnit& h : held_units(model, chunks))
    elements += layout.zero > 0 ? std::ceil(numel[h.unit] / layout.shard()) : numel[h.unit];
  *optimizer_s = optimizer_time(elements, prec, hw);
  return t + *optimizer_s;
}

}  // namespace

Timing step_time(const ModelConfig& model, const Layout& layout, const Cluster& cluster, const Precisions& prec,
                 const TrafficOptions& opt) {
  const PipelineShape shape = pipeline_shape(model, layout, opt.pp_layers);
  const Hardware& hw = cluster.hw;
  const AxisLinks links = axis_links(layout, cluster);
  Timing t;
  // The schedule with compute alone: its bubble and the busiest rank's compute.
  const PipelineRun bare = pipeline_run(layout.schedule, shape.pp, shape.chunks, shape.micro,
                                        stage_costs(model, layout, cluster, prec, opt, false), Keep::none);
  t.bubble = bare.bubble;
  for (double b : bare.busy) t.compute_s = std::max(t.compute_s, b);
  // With synchronous communication and transfers; then each rank's reductions and tail.
  const PipelineRun run = pipeline_run(layout.schedule, shape.pp, shape.chunks, shape.micro,
                                       stage_costs(model, layout, cluster, prec, opt, true), Keep::weights);
  double done = 0, tail = 0, optimizer = 0;
  for (int r = 0; r < shape.pp; ++r) {
    const DataPlan data = data_plan(model, layout, prec, opt, shape.ranks[r]);
    const RankTraffic traffic = comm_traffic(model, layout, prec, r, opt);
    const CommBytes s = comm_time(traffic, layout, cluster);
    t.comm_s.dp = std::max(t.comm_s.dp, s.dp), t.comm_s.tp = std::max(t.comm_s.tp, s.tp);
    t.comm_s.pp = std::max(t.comm_s.pp, s.pp), t.comm_s.cp = std::max(t.comm_s.cp, s.cp);
    double finish = run.end[r];
    const bool in_costs = layout.zero == 3 && layout.pp == 1;  // ZeRO 3 without pipelining: in the actions
    if (!in_costs) finish = std::max(finish, reductions_done(data, run.ranks[r], shape.chunks, links.shard, hw));
    done = std::max(done, finish);
    double opt_s = 0;
    tail = std::max(tail, after_backward(model, layout, cluster, prec, shape.ranks[r], data, traffic, links, &opt_s));
    optimizer = std::max(optimizer, opt_s);
  }
  t.step_s = done + tail;
  t.exposed_comm_s = std::max(0.0, t.step_s - bare.step - optimizer);
  const double tokens = double(layout.global_batch) * model.seq_len;
  t.tokens_per_s = tokens / t.step_s;
  t.mfu = model_flops_per_token(model) * tokens / (t.step_s * layout.ranks() * hw.flops(prec.name));
  return t;
}

}  // namespace mt::plan
