#include "train/plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "train/metrics.h"

namespace mt {

void plot_loss_svg(const std::string& path, const std::string& title, const Curve& train, const Curve& val,
                   const std::optional<double>& base) {
  if (train.empty()) return;
  const double W = 720, H = 420, left = 60, right = 20, top = 40, bottom = 50;
  double x0 = train.front().first, x1 = train.back().first, y0 = 1e30, y1 = -1e30;
  for (const Curve* c : {&train, &val})
    for (auto [x, y] : *c) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
  const double baseline = base.value_or(0);  // a loss: positive when it exists
  if (baseline > 0) y0 = std::min(y0, baseline), y1 = std::max(y1, baseline);
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  y0 = std::max(0.0, y0 - 0.05 * (y1 - y0));
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * (W - left - right); };
  auto py = [&](double y) { return top + (y1 - y) / (y1 - y0) * (H - top - bottom); };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif' "
    << "font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << left << "' y='24' font-size='15'>" << title << "</text>\n";
  for (int i = 0; i <= 5; ++i) {  // grid and axis labels
    double y = y0 + (y1 - y0) * i / 5, x = x0 + (x1 - x0) * i / 5;
    s << "<line x1='" << left << "' x2='" << W - right << "' y1='" << py(y) << "' y2='" << py(y)
      << "' stroke='#ddd'/>\n<text x='" << left - 6 << "' y='" << py(y) + 4 << "' text-anchor='end'>"
      << std::round(y * 100) / 100 << "</text>\n<text x='" << px(x) << "' y='" << H - bottom + 18
      << "' text-anchor='middle'>" << std::lround(x) << "</text>\n";
  }
  s << "<text x='" << (W + left) / 2 << "' y='" << H - 12 << "' text-anchor='middle'>step</text>\n";
  auto polyline = [&](const Curve& c, const char* color, const char* extra) {
    s << "<polyline fill='none' stroke='" << color << "' stroke-width='1.5' " << extra << " points='";
    for (auto [x, y] : c) s << px(x) << "," << py(y) << " ";
    s << "'/>\n";
  };
  polyline(train, "#1f77b4", "");
  if (!val.empty()) {
    polyline(val, "#d62728", "");
    for (auto [x, y] : val) s << "<circle cx='" << px(x) << "' cy='" << py(y) << "' r='3' fill='#d62728'/>\n";
  }
  if (baseline > 0)
    polyline({{x0, baseline}, {x1, baseline}}, "#888", "stroke-dasharray='5,4'");
  double ly = top + 10;
  auto legend = [&](const char* color, const char* text) {
    s << "<rect x='" << W - right - 190 << "' y='" << ly - 9 << "' width='14' height='3' fill='" << color
      << "'/><text x='" << W - right - 170 << "' y='" << ly - 4 << "'>" << text << "</text>\n";
    ly += 16;
  };
  legend("#1f77b4", "training loss");
  if (!val.empty()) legend("#d62728", "validation loss");
  if (baseline > 0) legend("#888", "token-frequency baseline");
  s << "</svg>\n";
  output_parent_create(path, "logging.plot");
  std::ofstream f(path);
  MT_CHECK(f, "cannot write the loss curve logging.plot = " << path << ": " << std::strerror(errno));
  f << s.str();
}

}  // namespace mt
