#include "plan/plan_svg.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "parallel/schedule_svg.h"

namespace mt::plan {

namespace {

std::string fixed(double v, int digits) {
  char s[32];
  std::snprintf(s, sizeof s, "%.*f", digits, v);
  return s;
}

}  // namespace

std::string plan_svg(const Question& q, const std::vector<Prediction>& layouts, const Simulation* timeline) {
  const double W = 1100, left = 20, right = 20, top = 44, row = 34, label_h = 13;
  const double device = q.cluster.hw.mem_bytes;
  double most = device;
  for (const Prediction& p : layouts) most = std::max(most, p.memory.peak);
  const double scale = (W - left - right - 90) / most;  // pixels per byte
  const double bars_h = top + layouts.size() * row + 24;
  const std::string chosen = timeline ? schedule_svg({*timeline}) : "";
  double timeline_h = 0;
  if (!chosen.empty()) {
    const size_t h = chosen.find("height='") + 8;
    timeline_h = std::stod(chosen.substr(h, chosen.find('\'', h) - h));
  }
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << bars_h + timeline_h
    << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n";
  o << "<text x='" << left << "' y='16' font-size='13'>memory per GPU by tag, " << q.cluster.gpus << " x "
    << q.cluster.hw.name << " (" << q.precision.name << "); the line is the device's "
    << fixed(device / (1 << 30), 1) << " GiB</text>\n";
  const char* names[] = {"params", "grads", "optim", "activations", "buffers", "staging"};
  const char* colours[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#bab0ac", "#b07aa1"};
  for (int k = 0; k < 6; ++k)
    o << "<rect x='" << left + k * 110 << "' y='24' width='12' height='10' fill='" << colours[k] << "'/><text x='"
      << left + k * 110 + 16 << "' y='33'>" << names[k] << "</text>\n";
  for (size_t i = 0; i < layouts.size(); ++i) {
    const Memory& m = layouts[i].memory;
    const double y = top + i * row;
    o << "<text x='" << left << "' y='" << y + label_h - 2 << "'>" << i + 1 << ". " << layouts[i].layout.text()
      << "  (step " << fixed(layouts[i].time.step_s, 3) << " s)</text>\n";
    double x = left;
    const double parts[] = {m.params, m.grads, m.optim, m.activations, m.comm, m.other};
    for (int k = 0; k < 6; ++k) {
      o << "<rect x='" << x << "' y='" << y + label_h << "' width='" << parts[k] * scale << "' height='14' fill='"
        << colours[k] << "'/>\n";
      x += parts[k] * scale;
    }
    o << "<text x='" << x + 4 << "' y='" << y + label_h + 11 << "'>" << fixed(m.peak / (1 << 30), 2) << " GiB</text>\n";
  }
  const double xd = left + device * scale;
  o << "<line x1='" << xd << "' y1='" << top << "' x2='" << xd << "' y2='" << bars_h - 16
    << "' stroke='black' stroke-dasharray='4 3'/>\n";
  if (!chosen.empty()) {  // the timeline picture, nested below the bars
    o << "<svg x='0' y='" << bars_h << "' " << chosen.substr(chosen.find("<svg ") + 5);
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace mt::plan
