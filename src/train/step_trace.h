// logging.trace: the training steps' pipeline actions as measured (the first kMaxSteps),
// gathered from the pipeline ranks, written as a Chrome/Perfetto trace and drawn as the
// schedule's picture (parallel/pipeline_trace.h). The ranks traced are one pipeline: the one world rank 0
// belongs to (the other data- and tensor-parallel replicas run the same list).
//
//   <trace>        Chrome trace event JSON: one process per pipeline rank, compute and
//                  transfers on two threads, every step one after another; with
//                  logging.profile also every rank's ops and collectives (add_events)
//   <trace>.svg    the last step measured, above the simulator's timeline for the costs
//                  measured over all steps (where the two differ, something the simulator
//                  does not model took the time)
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "parallel/pipeline_trace.h"

namespace mt {

// What the steps' timelines say, for the summary and the benchmarks.
struct PipelineMeasure {
  int steps = 0;
  double step_s = 0;       // mean pipeline time per step (first action to last, over ranks)
  double bubble = 0;       // mean measured bubble
  double simulated_s = 0;  // the simulator's step for the mean measured action costs (stage weights included)
};

class StepTrace {
 public:
  // `writer`: this rank keeps the timelines and writes the files (world rank 0).
  StepTrace(std::string path, const Schedule& s, Communicator& pp, bool writer);
  // Collective over pp: this rank's timeline of step `step`, which began `start` seconds
  // after the run did.
  void add(int64_t step, double start, const std::vector<TimedAction>& mine);
  // Further Chrome trace events (logging.profile's, train/profile_report.h) for the file.
  void add_events(nlohmann::json events) { extra_ = std::move(events); }
  // On the writer: writes the files and returns the measure (nothing before a step).
  std::optional<PipelineMeasure> finish() const;
  const std::string& path() const { return path_; }
  static constexpr size_t kMaxSteps = 200;  // a trace of more would be too big to open

 private:
  std::string path_;
  const Schedule& schedule_;
  Communicator& pp_;
  bool writer_;
  std::vector<TraceStep> steps_;
  nlohmann::json extra_;
};

}  // namespace mt
