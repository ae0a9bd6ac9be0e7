// What a schedule costs: its timeline when each action takes a given time, the step time,
// the bubble (idle time) and the activations each rank holds. The planner feeds it
// measured action costs; `meshtrain schedule` prints and draws it.
//
// Closed forms it reproduces with the default costs (F 1, B 2, BI 1, BW 1, transfers free),
// P ranks, m micro-batches:
//   gpipe, 1f1b       step (m + P - 1)·3,        bubble (P - 1) / (m + P - 1)
//   interleaved (v)   step (m + (P - 1)/v)·3,    bubble (P - 1) / (v·m + P - 1)   (m a multiple of P)
//   zb-h1             step 3m + P - 1,           bubble (P - 1) / (3m + P - 1): a third of 1f1b's idle time
#pragma once
#include <string>
#include <vector>

#include "parallel/schedule.h"

namespace mt {

struct ActionCosts {
  // Time of one micro-batch's action through a whole rank's share of the layers. An action
  // on one of v chunks takes 1/v of it (or stage_weight's share), so that schedules with
  // different v compare at equal work.
  double f = 1, b = 2, bi = 1, bw = 1;
  double send = 0, recv = 0;          // time a rank spends posting a send / taking in a receive
  std::vector<double> stage_weight;   // [P·v] each virtual stage's share of a rank's costs; empty: 1/v each
};

struct TimedAction {
  Action action;
  double start, end;
};

struct Simulation {
  std::string name;
  PipeLayout layout;
  ActionCosts costs;
  std::vector<std::vector<TimedAction>> ranks;  // [P][actions in list order]
  double step_time = 0;                         // when the last rank finishes; all start at 0
  double bubble = 0;  // idle / (P · step_time); idle: time a rank is not computing (transfers count as idle)
  // Per rank, the most (micro-batch, chunk) activations held at once, each 1/v of a rank's
  // layers: from F until B or BI (what the input gradient needs), and from F until B or BW
  // (BW still reads the layer inputs, so a split backward holds them longer).
  std::vector<int> peak_in_flight;     // [P]
  std::vector<int> peak_until_weight;  // [P]
};

// Simulates a schedule (which must pass schedule_check; throws mt::Error with its problems
// otherwise). Each rank runs its list in order: an action starts when the previous one
// ends, a receive no earlier than its send ends.
Simulation schedule_simulate(const Schedule& s, const ActionCosts& costs = {});

// Fills a simulation's summary from its timelines (ranks, layout) and each rank's compute
// time busy[r] (the time in F, B, BI and BW: the simulator sums the costs it charged, a
// measurement its actions' durations): step_time (the latest end; the timelines start at
// 0), bubble (0 for a step of no time) and the peaks, counted along each rank's list. The
// simulator and measured timelines (pipeline_trace.h) share it.
void simulation_summarise(Simulation& sim, const std::vector<double>& busy);

}  // namespace mt
