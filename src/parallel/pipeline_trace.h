// Measured pipeline steps: each rank times the actions of its pipeline rank's list as it
// runs them, world rank 0 gathers the timelines (train/step_trace.h), and this turns them
// into what the simulator gives (a Simulation, so the same summary, picture and tables
// serve measured steps), into action costs that feed the simulator back (to compare a
// predicted step with the measured one), and into a trace that Perfetto and
// chrome://tracing open.
//
// A measured timeline holds, for every action of a rank's list in list order, its start
// and end in seconds since that rank's step began: compute actions the time computing,
// sends the time to post them, receives from when the rank starts waiting until the data
// is there. Ranks' clocks agree as well as their step starts do (the trainer starts a
// traced step together on all of them).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"

namespace mt {

// A Simulation from measured timelines, ranks[r] being rank r's (the actions of s.ranks[r]
// in order; throws mt::Error naming the rank and index where they differ, or where an
// action ends before it starts). Named s.name + " (measured)"; times shifted so that the
// earliest start of any rank is 0; step_time, bubble and peaks as schedule_simulate
// defines them (simulation_summarise); costs = measured_costs of the result, without
// stage weights.
Simulation measured_timeline(const Schedule& s, std::vector<std::vector<TimedAction>> ranks);

// The action costs a timeline shows, in ActionCosts' convention:
//   f, b, bi, bw  mean duration of that kind's actions, times v (an action on one of v
//                 chunks takes 1/v of a rank's share). A kind the schedule does not run
//                 is made of the others: b = bi + bw, or bi = bw = b / 2 (a kind with
//                 nothing to make it of keeps ActionCosts' default).
//   send          mean time to post a send.
//   recv          mean time a receive takes once its send is posted: end - max(start,
//                 the matching send's end), at least 0; the wait before is the
//                 simulator's to reproduce, not a cost. A receive whose send is not in
//                 the timelines counts whole.
//   stage_weight  with stage_weights: each virtual stage's measured compute time over
//                 the time its actions take at the whole-rank costs above (1/v each when
//                 the stages are balanced). Each action's cost is then its measured time
//                 wherever times are a kind's cost times a stage's weight, as the
//                 simulator's are. Without: empty (1/v each).
// Compute durations of 0 (a clock too coarse) give costs schedule_simulate rejects.
ActionCosts measured_costs(const Simulation& measured, bool stage_weights = false);

// One step of a trace: its index, when it started (seconds, on any clock common to the
// steps), its timelines (measured_timeline's, or a simulation's in seconds) and, for a
// trace of more processes than one pipeline's ranks, every process's timeline on sim's
// time axis (processes[i]'s is ranks[i]; TraceProcess says which pipeline rank's list it
// ran). With ranks empty, the processes are sim's ranks.
struct TraceStep {
  int64_t step = 0;
  double start = 0;
  Simulation sim;
  std::vector<std::vector<TimedAction>> ranks;
};

// A process of the trace: its name in the viewer (e.g. "rank 5 (pp 1, dp 0, tp 1)") and
// the pipeline rank whose list of actions it runs.
struct TraceProcess {
  std::string name;
  int pp_rank = 0;
};

// A Chrome trace event file (JSON; Perfetto and chrome://tracing open it) of the steps one
// after another on one time axis: ts and dur in microseconds, ts = (step start + action
// start) · 10^6. One process per entry of `processes` (pid = its index: the world rank in
// a training run's trace), or without them one per pipeline rank of sim (pid = rank,
// named "pp rank r"). Two threads in each: "compute" (F, B, BI, BW; tid 2·pid + 1) and
// "transfers" (sends and receives; tid 2·pid + 2). One complete event ("ph": "X") per
// action, named by kind and micro-batch ("F 3", "RECV_GRAD 3"), with category "compute" or
// "transfer" and args step, micro, chunk, stage (the virtual stage) and, for transfers,
// peer (the pipeline rank on the other end).
std::string chrome_trace_json(const std::vector<TraceStep>& steps, const std::vector<TraceProcess>& processes = {});
std::string chrome_trace_json(const Simulation& one);  // one step starting at 0

}  // namespace mt
