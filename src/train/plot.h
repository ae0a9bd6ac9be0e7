// A loss-curve picture (SVG, no dependencies): training loss per step and validation loss,
// written at the end of a run so a person can look instead of reading JSON lines.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mt {

using Curve = std::vector<std::pair<double, double>>;  // (step, value)

// Writes `path` (logging.plot), creating its directory if needed; baseline: a dashed line.
void plot_loss_svg(const std::string& path, const std::string& title, const Curve& train, const Curve& val,
                   const std::optional<double>& baseline);

}  // namespace mt
