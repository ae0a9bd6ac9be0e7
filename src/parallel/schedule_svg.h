// Pictures of simulated schedules (SVG, no dependencies): ranks down, time across, one box
// per action (F, B, BI, BW in their own colours, the micro-batch number inside, later
// chunks in lighter shades), the bubble in each panel's title. Several simulations go one
// above the other on one time scale, so their lengths compare at a glance.
#pragma once
#include <string>
#include <vector>

#include "parallel/schedule_sim.h"

namespace mt {

// Times are drawn in the simulations' own unit (equal action costs: 1 per forward), or, with
// `unit` ("ms"), multiplied by `per_unit` (1e3 for seconds) and labelled.
std::string schedule_svg(const std::vector<Simulation>& sims, double per_unit = 1, const std::string& unit = "");

}  // namespace mt
