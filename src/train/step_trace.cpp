#include "train/step_trace.h"

#include <algorithm>
#include <fstream>

#include "core/error.h"
#include "parallel/schedule_svg.h"

namespace mt {

StepTrace::StepTrace(std::string path, const Schedule& s, Communicator& pp, bool writer)
    : path_(std::move(path)), schedule_(s), pp_(pp), writer_(writer) {}

void StepTrace::add(int64_t step, double start, const std::vector<TimedAction>& mine) {
  // Every rank's (start, end) per action, padded to the longest list.
  size_t longest = 0;
  for (const std::vector<Action>& list : schedule_.ranks) longest = std::max(longest, list.size());
  std::vector<double> local(2 * longest, 0.0), all(local.size() * pp_.size());
  for (size_t i = 0; i < mine.size(); ++i) local[2 * i] = mine[i].start, local[2 * i + 1] = mine[i].end;
  pp_.allgather(Tensor::wrap(local.data(), {static_cast<int64_t>(local.size())}, DType::f64),
                Tensor::wrap(all.data(), {static_cast<int64_t>(all.size())}, DType::f64));
  if (!writer_ || steps_.size() >= kMaxSteps) return;
  std::vector<std::vector<TimedAction>> ranks(pp_.size());
  for (int r = 0; r < pp_.size(); ++r)
    for (size_t i = 0; i < schedule_.ranks[r].size(); ++i) {
      const double* t = &all[r * local.size() + 2 * i];
      ranks[r].push_back({schedule_.ranks[r][i], t[0], t[1]});
    }
  steps_.push_back({step, start, measured_timeline(schedule_, std::move(ranks))});
}

std::optional<PipelineMeasure> StepTrace::finish() const {
  if (!writer_ || steps_.empty()) return std::nullopt;
  PipelineMeasure m;
  m.steps = static_cast<int>(steps_.size());
  // The mean duration of every action over the steps, as one timeline, gives the costs.
  Simulation mean = steps_.back().sim;
  for (size_t r = 0; r < mean.ranks.size(); ++r)
    for (size_t i = 0; i < mean.ranks[r].size(); ++i) {
      double start = 0, end = 0;
      for (const TraceStep& s : steps_) start += s.sim.ranks[r][i].start, end += s.sim.ranks[r][i].end;
      mean.ranks[r][i].start = start / m.steps, mean.ranks[r][i].end = end / m.steps;
    }
  for (const TraceStep& s : steps_) m.step_s += s.sim.step_time / m.steps, m.bubble += s.sim.bubble / m.steps;
  Simulation predicted = schedule_simulate(schedule_, measured_costs(mean, /*stage_weights=*/true));
  predicted.name = schedule_.name + " (simulated with the measured costs)";
  m.simulated_s = predicted.step_time;
  std::string trace = chrome_trace_json(steps_);
  if (extra_.is_array() && !extra_.empty()) {
    nlohmann::json doc = nlohmann::json::parse(trace);
    for (const nlohmann::json& e : extra_) doc["traceEvents"].push_back(e);
    trace = doc.dump() + "\n";
  }
  for (const auto& [file, text] : {std::pair{path_, trace},
                                   std::pair{path_ + ".svg", schedule_svg({steps_.back().sim, predicted})}}) {
    std::ofstream out(file);
    out << text;
    MT_CHECK(out.good(), "logging.trace = " << path_ << ": could not write " << file);
  }
  return m;
}

}  // namespace mt
