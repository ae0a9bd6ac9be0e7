#include "train/step_trace.h"

#include <algorithm>
#include <fstream>
#include <span>
#include <tuple>

#include "core/error.h"
#include "parallel/schedule_svg.h"

namespace mt {

namespace {

// "rank 5 (pp 1, dp 0, tp 1)": the coordinates of the axes the mesh has more than one rank on.
std::string rank_name(const Mesh& mesh, int rank) {
  const MeshCoords c = mesh.coords(rank);
  std::string axes;
  for (const auto& [name, size, at] : {std::tuple{"pp", mesh.pp().size(), c.pp}, std::tuple{"dp", mesh.dp().size(), c.dp},
                                       std::tuple{"tp", mesh.tp().size(), c.tp}, std::tuple{"cp", mesh.cp().size(), c.cp}})
    if (size > 1) axes += (axes.empty() ? "" : ", ") + std::string(name) + " " + std::to_string(at);
  return "rank " + std::to_string(rank) + (axes.empty() ? "" : " (" + axes + ")");
}

}  // namespace

StepTrace::StepTrace(std::string path, const Schedule& s, const Mesh& mesh)
    : path_(std::move(path)), schedule_(s), world_(mesh.world()), writer_(mesh.world().rank() == 0) {
  first_.assign(s.layout.pp, -1);
  for (int r = 0; r < world_.size(); ++r) {
    const MeshCoords c = mesh.coords(r);
    processes_.push_back({rank_name(mesh, r), c.pp});
    if (c.dp == 0 && c.tp == 0 && c.cp == 0) first_[c.pp] = r;
  }
}

void StepTrace::add(int64_t step, double start, const std::vector<TimedAction>& mine, double origin) {
  // Every rank's (start, end) per action, padded to the longest list, then its origin.
  size_t longest = 0;
  for (const std::vector<Action>& list : schedule_.ranks) longest = std::max(longest, list.size());
  std::vector<double> local(2 * longest + 1, 0.0), all(local.size() * world_.size());
  for (size_t i = 0; i < mine.size() && i < longest; ++i) local[2 * i] = mine[i].start, local[2 * i + 1] = mine[i].end;
  local.back() = origin;
  world_.allgather(Tensor::wrap(local.data(), {static_cast<int64_t>(local.size())}, DType::f64),
                   Tensor::wrap(all.data(), {static_cast<int64_t>(all.size())}, DType::f64));
  if (!writer_ || steps_.size() >= kMaxSteps) return;
  // Each rank's times on the first pipeline rank's axis: its origin's lead added.
  const double* first_rank = &all[first_[0] * local.size()];
  std::vector<std::vector<TimedAction>> ranks(world_.size());
  for (int w = 0; w < world_.size(); ++w) {
    const std::vector<Action>& list = schedule_.ranks[processes_[w].pp_rank];
    const double* row = &all[w * local.size()];
    const double lead = row[2 * longest] - first_rank[2 * longest];
    for (size_t i = 0; i < list.size(); ++i) ranks[w].push_back({list[i], row[2 * i] + lead, row[2 * i + 1] + lead});
  }
  std::vector<std::vector<TimedAction>> first;
  for (int w : first_) first.push_back(ranks[w]);
  TraceStep st{step, start, measured_timeline(schedule_, std::move(first)), {}};
  // Every rank on the first pipeline's time axis: shifted as measured_timeline shifted it.
  double shift = 0;
  for (size_t r = 0; r < first_.size(); ++r)
    if (!st.sim.ranks[r].empty()) shift = ranks[first_[r]][0].start - st.sim.ranks[r][0].start;
  for (std::vector<TimedAction>& line : ranks)
    for (TimedAction& t : line) t.start -= shift, t.end -= shift;
  st.ranks = std::move(ranks);
  steps_.push_back(std::move(st));
}

std::optional<PipelineMeasure> StepTrace::finish() const {
  if (!writer_ || steps_.empty()) return std::nullopt;
  PipelineMeasure m;
  // The first traced step runs several times slower (page faults, first touches): the
  // means are the later steps'.
  m.first_left_out = steps_.size() > 1;
  const std::span<const TraceStep> measured(steps_.begin() + (m.first_left_out ? 1 : 0), steps_.end());
  m.steps = static_cast<int>(measured.size());
  // The mean duration of every action over the steps, as one timeline, gives the costs.
  Simulation mean = steps_.back().sim;
  for (size_t r = 0; r < mean.ranks.size(); ++r)
    for (size_t i = 0; i < mean.ranks[r].size(); ++i) {
      double start = 0, end = 0;
      for (const TraceStep& s : measured) start += s.sim.ranks[r][i].start, end += s.sim.ranks[r][i].end;
      mean.ranks[r][i].start = start / m.steps, mean.ranks[r][i].end = end / m.steps;
    }
  for (const TraceStep& s : measured) m.step_s += s.sim.step_time / m.steps, m.bubble += s.sim.bubble / m.steps;
  Simulation predicted = schedule_simulate(schedule_, measured_costs(mean, /*stage_weights=*/true));
  predicted.name = schedule_.name + " (simulated with the measured costs)";
  m.simulated_s = predicted.step_time;
  std::string trace = chrome_trace_json(steps_, processes_);
  if (extra_.is_array() && !extra_.empty()) {
    nlohmann::json doc = nlohmann::json::parse(trace);
    for (const nlohmann::json& e : extra_) doc["traceEvents"].push_back(e);
    trace = doc.dump() + "\n";
  }
  for (const auto& [file, text] : {std::pair{path_, trace},
                                   std::pair{path_ + ".svg", schedule_svg({steps_.back().sim, predicted}, 1e3, "ms")}}) {
    std::ofstream out(file);
    out << text;
    MT_CHECK(out.good(), "logging.trace = " << path_ << ": could not write " << file);
  }
  return m;
}

}  // namespace mt
