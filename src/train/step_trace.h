// logging.trace: the training steps' pipeline actions as measured (the first kMaxSteps) on
// every rank, gathered over the world to world rank 0, written as a Chrome/Perfetto trace
// and drawn as the schedule's picture (parallel/pipeline_trace.h). Every rank runs the
// list of its pipeline rank; the summary and the picture are those of the first pipeline
// (the ranks of dp 0, tp 0, cp 0: the simulator models one pipeline).
//
//   <trace>        Chrome trace event JSON: one process per world rank (pid = world rank,
//                  named by its coordinates, "rank 5 (pp 1, dp 0, tp 1)"), compute and
//                  transfers on two threads, every step one after another; with
//                  logging.profile also every rank's ops and collectives (add_events)
//   <trace>.svg    the first pipeline's last step measured, above the simulator's timeline
//                  for the costs measured over all steps (where the two differ, something
//                  the simulator does not model took the time)
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "parallel/pipeline_trace.h"

namespace mt {

// What the steps' timelines say, for the summary and the benchmarks.
struct PipelineMeasure {
  int steps = 0;           // the steps measured: those traced but the first (its warm-up: page faults,
  bool first_left_out = false;  // first touches), unless only one was traced
  double step_s = 0;       // mean pipeline time per step (first action to last, over ranks)
  double bubble = 0;       // mean measured bubble
  double simulated_s = 0;  // the simulator's step for the mean measured action costs (stage weights included)
};

class StepTrace {
 public:
  // World rank 0 keeps the timelines and writes the files.
  StepTrace(std::string path, const Schedule& s, const Mesh& mesh);
  // Collective over the world: this rank's timeline of step `step` (the actions of its
  // pipeline rank's list), which began `start` seconds after the run did (world rank 0's
  // start is the step's), its 0 at wall-clock time `origin` (Pipeline::timeline_origin):
  // every rank is put on the first pipeline rank's time axis by the difference.
  void add(int64_t step, double start, const std::vector<TimedAction>& mine, double origin);
  // Further Chrome trace events (logging.profile's, train/profile_report.h) for the file.
  void add_events(nlohmann::json events) { extra_ = std::move(events); }
  // On the writer: writes the files and returns the measure (nothing before a step).
  std::optional<PipelineMeasure> finish() const;
  const std::string& path() const { return path_; }
  static constexpr size_t kMaxSteps = 200;  // a trace of more would be too big to open

 private:
  std::string path_;
  const Schedule& schedule_;
  Communicator& world_;
  bool writer_;
  std::vector<TraceProcess> processes_;  // per world rank: its name and pipeline rank
  std::vector<int> first_;               // the first pipeline's world ranks, by pipeline rank
  std::vector<TraceStep> steps_;
  nlohmann::json extra_;
};

}  // namespace mt
