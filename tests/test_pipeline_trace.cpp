// Measured pipeline steps: a simulator's timelines passed through as if measured give back
// its step time, bubble, peaks and action costs (and the simulator fed those costs predicts
// the same step); receives that include their wait still cost what the simulator charged;
// timelines that do not follow the schedule are refused; the Chrome trace holds every action
// once, in microseconds, one process per rank; a training run's trace (logging.trace) at
// pp x dp and pp x tp holds every world rank's actions of every step, one process each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "parallel/pipeline_trace.h"
#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"
#include "parallel/schedule_svg.h"
#include "train_runs.h"

namespace mt {
namespace {

struct Case {
  const char* name;
  int pp, chunks, micro;
};

const Case kCases[] = {{"1f1b", 2, 1, 4},        {"zb-h1", 2, 1, 4}, {"gpipe", 3, 1, 5},
                       {"zb-h1", 4, 1, 8},       {"zbv", 3, 2, 6},   {"interleaved", 2, 2, 4},
                       {"interleaved", 4, 3, 8}, {"1f1b", 8, 1, 3},  {"gpipe", 1, 1, 3}};

std::string label(const Case& c) {
  return std::string(c.name) + " P " + std::to_string(c.pp) + " v " + std::to_string(c.chunks) + " m " +
         std::to_string(c.micro);
}

ActionCosts uneven_costs() {
  ActionCosts c;
  c.f = 1.5, c.b = 3, c.bi = 1.2, c.bw = 1.8, c.send = 0.1, c.recv = 0.05;
  return c;
}

// The simulation's timelines as a rank would time them: on a clock that started `shift` earlier.
std::vector<std::vector<TimedAction>> shifted(const Simulation& sim, double shift) {
  std::vector<std::vector<TimedAction>> ranks = sim.ranks;
  for (auto& line : ranks)
    for (TimedAction& t : line) t.start += shift, t.end += shift;
  return ranks;
}

void expect_costs(const ActionCosts& got, const ActionCosts& want, const std::string& what) {
  EXPECT_NEAR(got.f, want.f, 1e-9) << what;
  EXPECT_NEAR(got.b, want.b, 1e-9) << what;
  EXPECT_NEAR(got.bi, want.bi, 1e-9) << what;
  EXPECT_NEAR(got.bw, want.bw, 1e-9) << what;
  EXPECT_NEAR(got.send, want.send, 1e-9) << what;
  EXPECT_NEAR(got.recv, want.recv, 1e-9) << what;
}

// ---- Measured timelines ----

TEST(PipelineTrace, MeasuredTimelineMatchesTheSimulator) {
  for (const Case& c : kCases)
    for (const ActionCosts& costs : {ActionCosts{}, uneven_costs()}) {
      const Schedule s = schedule_make(c.name, c.pp, c.chunks, c.micro);
      const Simulation sim = schedule_simulate(s, costs);
      const Simulation m = measured_timeline(s, shifted(sim, 100.25));
      EXPECT_EQ(m.name, std::string(c.name) + " (measured)");
      EXPECT_EQ(m.layout, s.layout);
      EXPECT_NEAR(m.step_time, sim.step_time, 1e-9) << label(c);
      EXPECT_NEAR(m.bubble, sim.bubble, 1e-9) << label(c);
      EXPECT_EQ(m.peak_in_flight, sim.peak_in_flight) << label(c);
      EXPECT_EQ(m.peak_until_weight, sim.peak_until_weight) << label(c);
      ASSERT_EQ(m.ranks.size(), sim.ranks.size());
      for (size_t r = 0; r < m.ranks.size(); ++r)
        for (size_t i = 0; i < m.ranks[r].size(); ++i) {
          EXPECT_EQ(m.ranks[r][i].action, sim.ranks[r][i].action);
          EXPECT_NEAR(m.ranks[r][i].start, sim.ranks[r][i].start, 1e-9) << label(c) << " rank " << r << " " << i;
          EXPECT_NEAR(m.ranks[r][i].end, sim.ranks[r][i].end, 1e-9) << label(c) << " rank " << r << " " << i;
        }
    }
}

// The simulator's costs come back from its timelines. A kind the schedule does not run is
// made of the others (1f1b: BI = BW = B/2; zb-h1: B = BI + BW).
TEST(PipelineTrace, MeasuredCostsRecoverTheSimulatorsCosts) {
  for (const Case& c : kCases) {
    const Schedule s = schedule_make(c.name, c.pp, c.chunks, c.micro);
    const ActionCosts given = uneven_costs();
    const Simulation m = measured_timeline(s, shifted(schedule_simulate(s, given), 3));
    ActionCosts want = given;
    const std::string n = c.name;
    if (n == "zb-h1" || n == "zbv") want.b = given.bi + given.bw;
    if (n == "1f1b" || n == "gpipe" || n == "interleaved") want.bi = want.bw = given.b / 2;
    if (c.pp == 1) want.send = want.recv = 0;
    expect_costs(measured_costs(m), want, label(c));
    expect_costs(m.costs, want, label(c) + " (the timeline's own)");
    EXPECT_TRUE(m.costs.stage_weight.empty());
    // The simulator fed the measured costs predicts the measured step.
    EXPECT_NEAR(schedule_simulate(s, measured_costs(m)).step_time, m.step_time, 1e-9) << label(c);
  }
}

// Stages of uneven weight: the kind means alone miss, with stage weights every action's cost
// is its measured time again, so the prediction is the measured step action for action.
TEST(PipelineTrace, MeasuredStageWeights) {
  for (const Case& c : kCases) {
    const Schedule s = schedule_make(c.name, c.pp, c.chunks, c.micro);
    ActionCosts given = uneven_costs();
    const int S = s.layout.stages();
    for (int st = 0; st < S; ++st) given.stage_weight.push_back(0.2 + 0.3 * st + (st == S - 1 ? 1.0 : 0.0));
    const Simulation m = measured_timeline(s, schedule_simulate(s, given).ranks);
    const ActionCosts got = measured_costs(m, true);
    ASSERT_EQ(got.stage_weight.size(), static_cast<size_t>(S));
    const Simulation again = schedule_simulate(s, got);
    EXPECT_NEAR(again.step_time, m.step_time, 1e-9) << label(c);
    for (size_t r = 0; r < m.ranks.size(); ++r)
      for (size_t i = 0; i < m.ranks[r].size(); ++i)
        EXPECT_NEAR(again.ranks[r][i].end - again.ranks[r][i].start, m.ranks[r][i].end - m.ranks[r][i].start, 1e-9)
            << label(c) << " rank " << r << " " << i;
    // Balanced stages: 1/v each.
    const ActionCosts even = measured_costs(schedule_simulate(s, uneven_costs()), true);
    for (double w : even.stage_weight) EXPECT_NEAR(w, 1.0 / c.chunks, 1e-12) << label(c);
  }
}

// A rank times a receive from when it starts waiting: right after its previous action. The
// wait is idle time, not the receive's cost, and the step, bubble and costs stay the same.
TEST(PipelineTrace, ReceivesWaitingForTheirSend) {
  for (const Case& c : kCases) {
    const Schedule s = schedule_make(c.name, c.pp, c.chunks, c.micro);
    const ActionCosts given = uneven_costs();
    const Simulation sim = schedule_simulate(s, given);
    std::vector<std::vector<TimedAction>> waiting = sim.ranks;
    bool waited = false;
    for (auto& line : waiting)
      for (size_t i = 0; i < line.size(); ++i)
        if (line[i].action.is_recv()) {
          const double from = i == 0 ? 0 : line[i - 1].end;
          waited = waited || from < line[i].start - 1e-9;
          line[i].start = from;
        }
    if (c.pp > 1) EXPECT_TRUE(waited) << label(c);
    const Simulation m = measured_timeline(s, waiting);
    EXPECT_NEAR(m.step_time, sim.step_time, 1e-9) << label(c);
    EXPECT_NEAR(m.bubble, sim.bubble, 1e-9) << label(c);
    EXPECT_NEAR(m.costs.recv, c.pp > 1 ? given.recv : 0, 1e-9) << label(c);
  }
}

TEST(PipelineTrace, TimelinesThatDoNotFollowTheScheduleAreRefused) {
  const Schedule s = schedule_make("1f1b", 2, 1, 4);
  const Simulation sim = schedule_simulate(s);
  auto refused = [&](std::vector<std::vector<TimedAction>> ranks, const std::string& words) {
    try {
      measured_timeline(s, std::move(ranks));
      ADD_FAILURE() << "accepted; expected: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused({sim.ranks[0]}, "1 ranks' timelines for pp 2");
  auto missing = sim.ranks;
  missing[1].pop_back();
  refused(missing, "rank 1 timed 15 actions of its 16");
  auto swapped = sim.ranks;
  std::swap(swapped[0][0], swapped[0][1]);
  refused(swapped, "rank 0 action 0 is SEND_ACT micro 0 chunk 0 to rank 1 where the schedule has F micro 0 chunk 0");
  auto backwards = sim.ranks;
  backwards[1][2].end = backwards[1][2].start - 0.5;
  refused(backwards, "rank 1 action 2");
}

TEST(PipelineTrace, PictureOfAMeasuredStep) {
  const Schedule s = schedule_make("zb-h1", 4, 1, 8);
  const std::string svg = schedule_svg({measured_timeline(s, shifted(schedule_simulate(s), 7))});
  EXPECT_NE(svg.find("zb-h1 (measured): pp 4, 1 chunk per rank, 8 micro-batches; step 27, bubble 11.1%"),
            std::string::npos);
}

// ---- Chrome trace ----

TEST(PipelineTrace, ChromeTrace) {
  const Schedule s = schedule_make("interleaved", 2, 2, 4);
  const Simulation a = measured_timeline(s, schedule_simulate(s, uneven_costs()).ranks);
  const Simulation b = measured_timeline(s, schedule_simulate(s).ranks);
  const std::vector<TraceStep> steps = {{5, 0.5, a}, {6, 0.5 + a.step_time + 0.25, b}};
  const nlohmann::json j = nlohmann::json::parse(chrome_trace_json(steps));
  EXPECT_EQ(j.at("displayTimeUnit"), "ms");
  const nlohmann::json& events = j.at("traceEvents");

  std::map<int, std::string> process;                 // pid -> name
  std::map<std::pair<int, int>, std::string> thread;  // (pid, tid) -> name
  size_t complete = 0;
  for (const nlohmann::json& e : events) {
    if (e.at("ph") != "M") continue;
    const int pid = e.at("pid"), tid = e.at("tid");
    if (e.at("name") == "process_name") process[pid] = e.at("args").at("name");
    if (e.at("name") == "thread_name") thread[{pid, tid}] = e.at("args").at("name");
  }
  EXPECT_EQ(process, (std::map<int, std::string>{{0, "pp rank 0"}, {1, "pp rank 1"}}));
  ASSERT_EQ(thread.size(), 4u);
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> spans;  // (pid, tid) -> [ts, ts + dur)
  for (const nlohmann::json& e : events) {
    if (e.at("ph") == "M") continue;
    ASSERT_EQ(e.at("ph"), "X");
    ++complete;
    const int pid = e.at("pid"), tid = e.at("tid");
    ASSERT_TRUE(pid == 0 || pid == 1) << e;
    ASSERT_TRUE(thread.count({pid, tid})) << e;
    const nlohmann::json& args = e.at("args");
    const int step = args.at("step"), micro = args.at("micro"), chunk = args.at("chunk");
    ASSERT_TRUE(step == 5 || step == 6) << e;
    const TraceStep& st = steps[step - 5];
    // The action it stands for: the rank's first of that name, chunk and peer not yet matched.
    const std::string name = e.at("name");
    const bool compute = e.at("cat") == "compute";
    EXPECT_EQ(thread[std::make_pair(pid, tid)], compute ? "compute" : "transfers") << e;
    EXPECT_EQ(args.contains("peer"), !compute) << e;
    EXPECT_EQ(args.at("stage"), s.layout.stage(pid, chunk)) << e;
    const TimedAction* found = nullptr;
    for (const TimedAction& t : st.sim.ranks[pid])
      if (std::string(action_kind_name(t.action.kind)) + " " + std::to_string(t.action.micro) == name &&
          t.action.micro == micro && t.action.chunk == chunk && (compute || t.action.peer == args.at("peer")) &&
          std::abs((st.start + t.start) * 1e6 - e.at("ts").get<double>()) < 1e-3)
        found = &t;
    ASSERT_TRUE(found) << e;
    EXPECT_NEAR(e.at("dur").get<double>(), (found->end - found->start) * 1e6, 1e-3) << e;
    spans[{pid, tid}].push_back({e.at("ts").get<double>(), e.at("ts").get<double>() + e.at("dur").get<double>()});
  }
  size_t actions = 0;
  for (const Simulation* sim : {&a, &b})
    for (const auto& line : sim->ranks) actions += line.size();
  EXPECT_EQ(complete, actions);
  EXPECT_EQ(events.size(), actions + 2 * 3);  // a process and two thread names per rank
  // Each thread's events follow one another (what a complete event's track needs).
  for (auto& [where, list] : spans) {
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i) EXPECT_GE(list[i].first, list[i - 1].second - 1e-3);
  }
  // Step 6 starts after step 5 ends: 0.5 s + a's step, then 0.25 s idle.
  double first6 = 1e300, last5 = 0;
  for (const nlohmann::json& e : events)
    if (e.at("ph") == "X") {
      const double ts = e.at("ts"), end = ts + e.at("dur").get<double>();
      if (e.at("args").at("step") == 6) first6 = std::min(first6, ts);
      if (e.at("args").at("step") == 5) last5 = std::max(last5, end);
    }
  EXPECT_NEAR(last5, (0.5 + a.step_time) * 1e6, 1e-3);
  EXPECT_NEAR(first6, (0.5 + a.step_time + 0.25) * 1e6, 1e-3);
  // One simulation alone: a step 0 starting at 0.
  const nlohmann::json one = nlohmann::json::parse(chrome_trace_json(a));
  EXPECT_EQ(one.at("traceEvents").size(), actions / 2 + 6);
}

// Processes other than the pipeline's ranks: each runs its pipeline rank's list, under its
// own pid, name and threads.
TEST(PipelineTrace, ChromeTraceOfMoreProcessesThanPipelineRanks) {
  const Schedule s = schedule_make("interleaved", 2, 2, 4);
  const Simulation a = measured_timeline(s, schedule_simulate(s, uneven_costs()).ranks);
  const std::vector<TraceProcess> procs = {{"rank 0 (pp 0, dp 0)", 0}, {"rank 1 (pp 0, dp 1)", 0},
                                           {"rank 2 (pp 1, dp 0)", 1}, {"rank 3 (pp 1, dp 1)", 1}};
  const TraceStep st{3, 0.5, a, {a.ranks[0], a.ranks[0], a.ranks[1], a.ranks[1]}};
  const nlohmann::json j = nlohmann::json::parse(chrome_trace_json({st}, procs));
  std::map<int, std::string> process;
  std::map<int, std::set<int>> tids;  // pid -> its tids
  std::map<int, size_t> count;        // pid -> complete events
  for (const nlohmann::json& e : j.at("traceEvents")) {
    const int pid = e.at("pid"), tid = e.at("tid");
    tids[pid].insert(tid);
    if (e.at("name") == "process_name") process[pid] = e.at("args").at("name");
    if (e.at("ph") != "X") continue;
    ++count[pid];
    EXPECT_EQ(e.at("args").at("stage"), s.layout.stage(procs[pid].pp_rank, e.at("args").at("chunk").get<int>())) << e;
  }
  for (int p = 0; p < 4; ++p) {
    EXPECT_EQ(process[p], procs[p].name);
    EXPECT_EQ(count[p], a.ranks[procs[p].pp_rank].size()) << p;
    EXPECT_EQ(tids[p], (std::set<int>{2 * p + 1, 2 * p + 2})) << p;
  }
  TraceStep short_one = st;
  short_one.ranks.pop_back();
  EXPECT_THROW(chrome_trace_json({short_one}, procs), Error);
}

// ---- A training run's trace ----

// Every world rank's actions of every step, under its own pid named by its coordinates,
// with thread ids no other process uses; the summary still measures the first pipeline.
void expect_every_rank_traced(const std::string& name, const std::string& layout, int ranks, int global,
                              int micro, const std::string& schedule, const std::map<int, std::string>& names) {
  test::TempDir d;
  const std::string opts = test::options("gpt2", global, 1) + " --model.n_layer=4 --data.path=" +
                           test::write_tokens(d, "t.bin", 3000, 37) + layout + " --parallel.pp_schedule=" + schedule +
                           " --logging.trace=" + d / "trace.json";
  const test::RunResult r = test::train_run(d, name, ranks, opts);
  ASSERT_FALSE(r.loss.empty()) << r.output;
  const Schedule s = schedule_make(schedule, 2, 1, micro);
  const int per_stage = ranks / 2;  // pp is the outermost axis: world rank w runs pp rank w / per_stage
  std::ifstream in(d / "trace.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  std::map<int, std::string> process;
  std::map<int, int> owner;                                // tid -> pid
  std::map<std::tuple<int, int64_t, bool>, size_t> count;  // (pid, step, compute) -> events
  for (const nlohmann::json& e : j.at("traceEvents")) {
    const int pid = e.at("pid");
    if (pid >= 1000) continue;  // logging.profile's processes
    const auto [it, fresh] = owner.emplace(e.at("tid").get<int>(), pid);
    EXPECT_EQ(it->second, pid) << "tid " << e.at("tid") << " under two pids";
    if (e.at("name") == "process_name") process[pid] = e.at("args").at("name");
    if (e.at("ph") == "X") ++count[{pid, e.at("args").at("step").get<int64_t>(), e.at("cat") == "compute"}];
  }
  EXPECT_EQ(process, names);
  for (int w = 0; w < ranks; ++w) {
    const std::vector<Action>& list = s.ranks[w / per_stage];
    const size_t compute = std::count_if(list.begin(), list.end(), [](const Action& a) { return a.is_compute(); });
    for (int64_t step = 0; step < static_cast<int64_t>(r.loss.size()); ++step) {
      EXPECT_EQ((count[{w, step, true}]), compute) << name << ": rank " << w << " step " << step;
      EXPECT_EQ((count[{w, step, false}]), list.size() - compute) << name << ": rank " << w << " step " << step;
    }
  }
  EXPECT_EQ(count.size(), 2 * ranks * r.loss.size()) << name;
  ASSERT_TRUE(r.summary.contains("pp_bubble")) << r.summary.dump();
  EXPECT_GT(r.summary["pp_simulated_ms"].get<double>(), 0);
  // The picture's times are the trace's, in milliseconds, labelled so
  std::ifstream svg(d / "trace.json.svg");
  const std::string picture((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  char step[64];
  std::snprintf(step, sizeof step, "; step %g ms, bubble", std::round(r.summary["pp_simulated_ms"].get<double>() * 1000) / 1000);  // the simulated panel
  EXPECT_NE(picture.find(step), std::string::npos) << step << "\n" << picture.substr(0, 2000);
}

TEST(PipelineTrace, TrainingTraceHoldsEveryRankAtPipelineTimesData) {
  expect_every_rank_traced("pp2dp2", " --parallel.pp=2 --parallel.dp=2", 4, 8, 4, "zb-h1",
                           {{0, "rank 0 (pp 0, dp 0)"}, {1, "rank 1 (pp 0, dp 1)"}, {2, "rank 2 (pp 1, dp 0)"},
                            {3, "rank 3 (pp 1, dp 1)"}});
}

TEST(PipelineTrace, TrainingTraceHoldsEveryRankAtPipelineTimesTensor) {
  expect_every_rank_traced("pp2tp2", " --parallel.pp=2 --parallel.tp=2", 4, 4, 4, "1f1b",
                           {{0, "rank 0 (pp 0, tp 0)"}, {1, "rank 1 (pp 0, tp 1)"}, {2, "rank 2 (pp 1, tp 0)"},
                            {3, "rank 3 (pp 1, tp 1)"}});
}

}  // namespace
}  // namespace mt
