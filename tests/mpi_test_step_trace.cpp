// The training trace (train/step_trace.h) under mpirun: ranks start their timelines at
// different moments, each timing its actions from its own 0, and the trace puts them on one
// time axis by their wall-clock origins. Run with 2 and 4 ranks (pp 2, dp the rest).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "comm/mesh.h"
#include "mpi_main.h"
#include "parallel/schedule.h"
#include "parallel/schedule_sim.h"
#include "test_util.h"
#include "train/step_trace.h"

namespace mt {
namespace {

Communicator* g_world = nullptr;  // the test program's world, set in main

// What every test here traces: pp 2 (1f1b, 4 micro-batches) times the rest as dp, each
// pipeline rank's true timeline from the simulator with fixed costs, and the trace.
struct Traced {
  Communicator& w = *g_world;
  Mesh mesh{w, w.size() / 2, 2, 1};
  Schedule s = schedule_make("1f1b", 2, 1, 4);
  Simulation truth = schedule_simulate(s, ActionCosts{1e-3, 2e-3, 1e-3, 1e-3, 1e-4, 1e-4, {}});
  test::TempDir d;
  std::string path = d / "trace.json";
  StepTrace trace{path, s, mesh};
};

// Every rank replays the simulator's timeline of its pipeline rank (one true axis, causal),
// timed from its own 0: rank w started 10 ms x w after the true 0, its wall-clock origin
// as late. The trace must give every action its true time plus one shift common to all
// ranks: the lead of each rank's origin is put back.
TEST(StepTrace, RanksStartedAtDifferentMomentsShareOneTimeAxis) {
  Traced t;
  auto& [w, mesh, s, truth, d, path, trace] = t;
  const double late = 0.01 * w.rank(), origin = 1.8e9 + late;
  for (int64_t step = 0; step < 2; ++step) {
    std::vector<TimedAction> mine = truth.ranks[mesh.pp().rank()];
    for (TimedAction& t : mine) t.start -= late, t.end -= late;
    trace.add(step, 0.1 * step, mine, origin + 0.1 * step);
  }
  if (w.rank() != 0) return;
  ASSERT_TRUE(trace.finish().has_value());
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  // Per rank and step, the trace's times in order against the true ones in order.
  std::map<std::pair<int, int64_t>, std::vector<double>> seen;
  for (const nlohmann::json& e : j.at("traceEvents"))
    if (e.at("ph") == "X") seen[{e.at("pid").get<int>(), e.at("args").at("step").get<int64_t>()}].push_back(e.at("ts"));
  ASSERT_EQ(seen.size(), 2u * w.size());
  double shift = NAN;
  for (auto& [key, ts] : seen) {
    const auto& [rank, step] = key;
    std::vector<double> want;
    for (const TimedAction& t : truth.ranks[rank / (w.size() / 2)]) want.push_back(1e6 * t.start);  // pp outermost
    std::sort(ts.begin(), ts.end());
    std::sort(want.begin(), want.end());
    ASSERT_EQ(ts.size(), want.size()) << "rank " << rank;
    for (size_t i = 0; i < ts.size(); ++i) {
      if (std::isnan(shift)) shift = ts[i] - want[i];
      // 1 us: the origins' difference carries the rounding of two numbers near 1.8e9 s.
      EXPECT_NEAR(ts[i] - want[i] - 1e5 * step, shift, 1.0) << "rank " << rank << " step " << step << " action " << i;
    }
  }
}

// The first traced step (page faults, first touches) runs several times slower than the
// rest: the summary's step time and the simulator's costs are the later steps' means.
TEST(StepTrace, TheFirstStepIsLeftOutOfTheMeans) {
  Traced t;
  auto& [w, mesh, s, truth, d, path, trace] = t;
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<TimedAction> mine = truth.ranks[mesh.pp().rank()];
    const double slow = step == 0 ? 5 : 1;
    for (TimedAction& t : mine) t.start *= slow, t.end *= slow;
    trace.add(step, 0.1 * step, mine, 1.8e9 + 0.1 * step);
  }
  if (w.rank() != 0) return;
  const std::optional<PipelineMeasure> m = trace.finish();
  ASSERT_TRUE(m.has_value());
  EXPECT_TRUE(m->first_left_out);
  EXPECT_EQ(m->steps, 2);
  EXPECT_NEAR(m->step_s, truth.step_time, 1e-6);  // 1 us: origins near 1.8e9 s
}

}  // namespace
}  // namespace mt

int main(int argc, char** argv) {
  return mt::test::mpi_test_main(argc, argv, mt::CommOptions{false, 60, nullptr}, &mt::g_world);
}
