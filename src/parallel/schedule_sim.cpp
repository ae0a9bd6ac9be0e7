#include "parallel/schedule_sim.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

namespace {

void costs_check(const ActionCosts& c, const PipeLayout& L) {
  MT_CHECK(c.f > 0 && c.b > 0 && c.bi > 0 && c.bw > 0,
           "action costs: F, B, BI and BW must take some time (got " << c.f << ", " << c.b << ", " << c.bi << ", "
                                                                    << c.bw << ")");
  MT_CHECK(c.send >= 0 && c.recv >= 0, "action costs: send and receive times cannot be negative");
  MT_CHECK(c.stage_weight.empty() || static_cast<int>(c.stage_weight.size()) == L.stages(),
           "action costs: " << c.stage_weight.size() << " stage weights for " << L.stages() << " virtual stages");
  for (double w : c.stage_weight) MT_CHECK(w > 0, "action costs: stage weights must be positive");
}

double action_cost(const ActionCosts& c, const PipeLayout& L, int rank, const Action& a) {
  if (a.is_send()) return c.send;
  if (a.is_recv()) return c.recv;
  const double kind = a.kind == Action::F ? c.f : a.kind == Action::B ? c.b : a.kind == Action::BI ? c.bi : c.bw;
  return kind * (c.stage_weight.empty() ? 1.0 / L.chunks : c.stage_weight[L.stage(rank, a.chunk)]);
}

// Peak activations held on one rank, following its list: F takes a (micro-batch, chunk)'s
// activations; B frees them; BI frees them for the in-flight count, BW for the other.
void peaks_count(const std::vector<TimedAction>& line, int* in_flight, int* until_weight) {
  int held = 0, held_for_w = 0;
  *in_flight = *until_weight = 0;
  for (const TimedAction& t : line) {
    const Action& a = t.action;
    if (a.kind == Action::F) ++held, ++held_for_w;
    if (a.kind == Action::B || a.kind == Action::BI) --held;
    if (a.kind == Action::B || a.kind == Action::BW) --held_for_w;
    *in_flight = std::max(*in_flight, held);
    *until_weight = std::max(*until_weight, held_for_w);
  }
}

}  // namespace

Simulation schedule_simulate(const Schedule& s, const ActionCosts& costs) {
  const std::vector<std::string> problems = schedule_check(s, 5);
  if (!problems.empty()) {
    std::string all;
    for (const std::string& p : problems) all += "\n  " + p;
    MT_FAIL("schedule " << s.name << " does not check:" << all);
  }
  const PipeLayout& L = s.layout;
  costs_check(costs, L);
  Simulation sim;
  sim.name = s.name;
  sim.layout = L;
  sim.costs = costs;
  sim.ranks.resize(L.pp);
  std::vector<double> busy(L.pp, 0);
  // The replay visits each rank's actions in order and a receive after its send, so the
  // send's end time is known when the receive is placed.
  schedule_replay(s, [&](ActionRef at, const ActionRef* send) {
    std::vector<TimedAction>& line = sim.ranks[at.rank];
    const Action& a = s.ranks[at.rank][at.index];
    double start = line.empty() ? 0 : line.back().end;
    if (send) start = std::max(start, sim.ranks[send->rank][send->index].end);
    const double d = action_cost(costs, L, at.rank, a);
    line.push_back({a, start, start + d});
    if (a.is_compute()) busy[at.rank] += d;
  });
  simulation_summarise(sim, busy);
  return sim;
}

void simulation_summarise(Simulation& sim, const std::vector<double>& busy) {
  const int P = sim.layout.pp;
  double busy_all = 0;
  for (double b : busy) busy_all += b;
  sim.step_time = 0;
  for (const std::vector<TimedAction>& line : sim.ranks)
    for (const TimedAction& t : line) sim.step_time = std::max(sim.step_time, t.end);
  sim.bubble = sim.step_time > 0 ? 1 - busy_all / (P * sim.step_time) : 0;
  sim.peak_in_flight.assign(P, 0);
  sim.peak_until_weight.assign(P, 0);
  for (int r = 0; r < P; ++r) peaks_count(sim.ranks[r], &sim.peak_in_flight[r], &sim.peak_until_weight[r]);
}

}  // namespace mt
