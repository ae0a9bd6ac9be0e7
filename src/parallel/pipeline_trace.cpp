#include "parallel/pipeline_trace.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/error.h"

namespace mt {

namespace {

// A transfer's hop, the same for its send and its receive: (gradient?, micro-batch, the
// virtual stage that receives). Activations go up one stage, gradients down one.
std::tuple<bool, int, int> hop(const PipeLayout& L, int rank, const Action& a) {
  const bool grad = a.kind == Action::SEND_GRAD || a.kind == Action::RECV_GRAD;
  const int stage = L.stage(rank, a.chunk);
  return {grad, a.micro, a.is_recv() ? stage : grad ? stage - 1 : stage + 1};
}

double kind_cost(const ActionCosts& c, Action::Kind k) {
  return k == Action::F ? c.f : k == Action::B ? c.b : k == Action::BI ? c.bi : c.bw;
}

// Each virtual stage's measured compute time over the time its actions take at c's
// whole-rank kind costs; 1/v for a stage with no compute time predicted.
std::vector<double> stage_weights_measure(const Simulation& m, const ActionCosts& c) {
  const PipeLayout& L = m.layout;
  std::vector<double> time(L.stages(), 0), predicted(L.stages(), 0), w(L.stages());
  for (int r = 0; r < L.pp; ++r)
    for (const TimedAction& t : m.ranks[r]) {
      if (!t.action.is_compute()) continue;
      const int stage = L.stage(r, t.action.chunk);
      time[stage] += t.end - t.start;
      predicted[stage] += kind_cost(c, t.action.kind);
    }
  for (int s = 0; s < L.stages(); ++s) w[s] = predicted[s] > 0 ? time[s] / predicted[s] : 1.0 / L.chunks;
  return w;
}

}  // namespace

Simulation measured_timeline(const Schedule& s, std::vector<std::vector<TimedAction>> ranks) {
  const PipeLayout& L = s.layout;
  MT_CHECK(static_cast<int>(ranks.size()) == L.pp && static_cast<int>(s.ranks.size()) == L.pp,
           "measured timeline of " << s.name << ": " << ranks.size() << " ranks' timelines for pp " << L.pp);
  double first = std::numeric_limits<double>::infinity();
  for (int r = 0; r < L.pp; ++r) {
    const std::vector<Action>& list = s.ranks[r];
    MT_CHECK(ranks[r].size() == list.size(), "measured timeline of " << s.name << ": rank " << r << " timed "
                                                                     << ranks[r].size() << " actions of its "
                                                                     << list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const TimedAction& t = ranks[r][i];
      MT_CHECK(t.action == list[i], "measured timeline of " << s.name << ": rank " << r << " action " << i << " is "
                                                            << action_describe(t.action) << " where the schedule has "
                                                            << action_describe(list[i]));
      MT_CHECK(std::isfinite(t.start) && std::isfinite(t.end) && t.end >= t.start,
               "measured timeline of " << s.name << ": rank " << r << " action " << i << " ("
                                       << action_describe(t.action) << ") runs from " << t.start << " to " << t.end);
      first = std::min(first, t.start);
    }
  }
  if (!std::isfinite(first)) first = 0;  // no actions at all
  std::vector<double> busy(L.pp, 0);
  for (int r = 0; r < L.pp; ++r)
    for (TimedAction& t : ranks[r]) {
      t.start -= first, t.end -= first;
      if (t.action.is_compute()) busy[r] += t.end - t.start;
    }
  Simulation sim;
  sim.name = s.name + " (measured)";
  sim.layout = L;
  sim.ranks = std::move(ranks);
  simulation_summarise(sim, busy);
  sim.costs = measured_costs(sim);
  return sim;
}

ActionCosts measured_costs(const Simulation& m, bool stage_weights) {
  const PipeLayout& L = m.layout;
  double total[4] = {}, send_total = 0, recv_total = 0;
  int64_t count[4] = {}, sends = 0, recvs = 0;
  std::map<std::tuple<bool, int, int>, double> posted;  // hop -> when its send was posted
  for (int r = 0; r < L.pp; ++r)
    for (const TimedAction& t : m.ranks[r]) {
      const Action& a = t.action;
      if (a.is_compute()) total[a.kind] += t.end - t.start, ++count[a.kind];
      if (a.is_send()) send_total += t.end - t.start, ++sends, posted[hop(L, r, a)] = t.end;
    }
  // A receive costs what it takes once its send is posted; waiting before that is idle.
  for (int r = 0; r < L.pp; ++r)
    for (const TimedAction& t : m.ranks[r]) {
      if (!t.action.is_recv()) continue;
      const auto send = posted.find(hop(L, r, t.action));
      const double from = send == posted.end() ? t.start : std::max(t.start, send->second);
      recv_total += std::max(0.0, t.end - from), ++recvs;
    }
  ActionCosts c;
  double* kind[4] = {&c.f, &c.b, &c.bi, &c.bw};
  for (int k = 0; k < 4; ++k)
    if (count[k] > 0) *kind[k] = L.chunks * total[k] / count[k];
  if (count[Action::B] == 0 && count[Action::BI] > 0 && count[Action::BW] > 0) c.b = c.bi + c.bw;
  if (count[Action::B] > 0 && count[Action::BI] == 0 && count[Action::BW] == 0) c.bi = c.bw = c.b / 2;
  if (sends > 0) c.send = send_total / sends;
  if (recvs > 0) c.recv = recv_total / recvs;
  if (stage_weights) c.stage_weight = stage_weights_measure(m, c);
  return c;
}

std::string chrome_trace_json(const std::vector<TraceStep>& steps, const std::vector<TraceProcess>& processes) {
  using nlohmann::json;
  // Thread ids unique across processes and never 0: some Perfetto versions merge a tid 0
  // with another, or one tid seen under several pids.
  auto tid = [](int pid, bool compute) { return 2 * pid + (compute ? 1 : 2); };
  std::vector<TraceProcess> named = processes;
  if (named.empty()) {  // the pipeline ranks themselves
    int pp = 0;
    for (const TraceStep& st : steps) pp = std::max(pp, st.sim.layout.pp);
    for (int r = 0; r < pp; ++r) named.push_back({"pp rank " + std::to_string(r), r});
  }
  json events = json::array();
  for (int p = 0; p < static_cast<int>(named.size()); ++p) {
    events.push_back(json{{"name", "process_name"}, {"ph", "M"}, {"pid", p}, {"tid", tid(p, true)},
                          {"args", {{"name", named[p].name}}}});
    for (bool compute : {true, false})
      events.push_back(json{{"name", "thread_name"}, {"ph", "M"}, {"pid", p}, {"tid", tid(p, compute)},
                            {"args", {{"name", compute ? "compute" : "transfers"}}}});
  }
  for (const TraceStep& st : steps) {
    const PipeLayout& L = st.sim.layout;
    const std::vector<std::vector<TimedAction>>& lines = processes.empty() ? st.sim.ranks : st.ranks;
    MT_CHECK(processes.empty() || lines.size() == processes.size(),
             "chrome trace: step " << st.step << " has " << lines.size() << " timelines for " << processes.size()
                                   << " processes");
    for (int p = 0; p < static_cast<int>(lines.size()); ++p)
      for (const TimedAction& t : lines[p]) {
        const Action& a = t.action;
        json args = {{"step", st.step}, {"micro", a.micro}, {"chunk", a.chunk}, {"stage", L.stage(named[p].pp_rank, a.chunk)}};
        if (!a.is_compute()) args["peer"] = a.peer;
        events.push_back(json{{"name", std::string(action_kind_name(a.kind)) + " " + std::to_string(a.micro)},
                              {"cat", a.is_compute() ? "compute" : "transfer"},
                              {"ph", "X"},
                              {"ts", (st.start + t.start) * 1e6},
                              {"dur", (t.end - t.start) * 1e6},
                              {"pid", p},
                              {"tid", tid(p, a.is_compute())},
                              {"args", std::move(args)}});
      }
  }
  return json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump() + "\n";
}

std::string chrome_trace_json(const Simulation& one) { return chrome_trace_json(std::vector<TraceStep>{{0, 0, one, {}}}); }

}  // namespace mt
