// The planner's picture (SVG, no dependencies): memory per GPU by tag for each layout, one
// stacked bar per layout against the device's memory, and below it the pipeline timeline
// of the first (the chosen) layout as the simulator predicts it.
#pragma once
#include <string>
#include <vector>

#include "parallel/schedule_sim.h"
#include "plan/search.h"

namespace mt::plan {

// timeline: the chosen layout's simulated step (null: no timeline, as for pp = 1).
std::string plan_svg(const Question& q, const std::vector<Prediction>& layouts, const Simulation* timeline);

}  // namespace mt::plan
