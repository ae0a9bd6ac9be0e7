// The planner's prediction for a run's own layout beside what the run measured: memory per
// tag, bytes per step on each axis, and (with a hardware profile, logging.hardware) the
// step time. Printed in the run's summary and written as plan_* keys of its summary line.
#pragma once
#include <array>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/allocator.h"
#include "plan/plan.h"
#include "train/config.h"

namespace mt {

struct PlanMeasured {
  MemStats mem;                       // the training steps' peaks on the busiest rank
  std::array<double, 4> comm_bytes{};  // dp, tp, pp, cp: bytes rank 0 sent in the last step
  double step_s = 0;                  // mean time of a timed step
};

// The planner's layout of a run's (resolved) configuration.
plan::Layout run_layout(const Config& c);

// Appends the printed lines to *lines and returns the metrics keys: plan_mem_<tag> beside
// mem_steps_<tag> (the training steps' peak: the summary's mem_<tag> also holds the final
// validation's), plan_comm_bytes_<axis> beside comm_bytes_<axis>_step (pipeline rank 0's;
// both measurements null where no step ran), plan_step_s (null without a profile).
nlohmann::json plan_report(const Config& c, int world_size, const PlanMeasured& m, std::vector<std::string>* lines);

}  // namespace mt
