#include "parallel/schedule_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <sstream>

namespace mt {

namespace {

struct Rgb {
  int r, g, b;
};

// Base colours per kind: F blue, B green, BI orange, BW purple; transfers grey.
Rgb kind_colour(Action::Kind k) {
  switch (k) {
    case Action::F: return {78, 121, 167};
    case Action::B: return {89, 161, 79};
    case Action::BI: return {242, 142, 43};
    case Action::BW: return {156, 106, 222};
    default: return {160, 160, 160};
  }
}

// Chunk c of v: mixed towards white, up to half-way for the last chunk.
Rgb chunk_shade(Rgb c, int chunk, int chunks) {
  const double t = chunks > 1 ? 0.5 * chunk / (chunks - 1) : 0;
  auto mix = [t](int x) { return static_cast<int>(std::lround(x + (255 - x) * t)); };
  return {mix(c.r), mix(c.g), mix(c.b)};
}

std::string hex(Rgb c) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c.r, c.g, c.b);
  return buf;
}

// Schedule names can be file paths: keep them from breaking the XML.
std::string xml_escape(const std::string& text) {
  std::string out;
  for (char ch : text) out += ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : ch == '&' ? "&amp;" : std::string(1, ch);
  return out;
}

bool dark(Rgb c) { return 0.299 * c.r + 0.587 * c.g + 0.114 * c.b < 150; }

std::string number(double x) {
  std::ostringstream s;
  s << std::round(x * 1000) / 1000;
  return s.str();
}

// Grid spacing: 1, 2 or 5 times a power of ten, giving about ten lines over `span`.
double grid_step(double span) {
  const double raw = span / 10, p = std::pow(10, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0})
    if (f * p >= raw) return f * p;
  return 10 * p;
}

}  // namespace

std::string schedule_svg(const std::vector<Simulation>& sims, double per_unit, const std::string& unit) {
  const std::string suffix = unit.empty() ? "" : " " + unit;
  auto shown = [&](double t) { return number(t * per_unit); };
  const double W = 1100, left = 64, right = 20, row = 22, title_h = 26, gap = 22, legend_h = 34;
  double longest = 0, height = legend_h + 10;
  for (const Simulation& s : sims) {
    longest = std::max(longest, s.step_time);
    height += title_h + s.layout.pp * row + 18 + gap;
  }
  const double scale = (W - left - right) / longest;  // pixels per time unit
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << height
    << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n";
  double x = left;
  for (Action::Kind k : {Action::F, Action::B, Action::BI, Action::BW}) {
    o << "<rect x='" << x << "' y='10' width='16' height='14' fill='" << hex(kind_colour(k)) << "'/><text x='"
      << x + 21 << "' y='21'>" << action_kind_name(k) << "</text>\n";
    x += 60;
  }
  o << "<text x='" << x << "' y='21'>number: micro-batch; lighter: later chunk; white: idle; grey: transfer time"
    << "</text>\n";
  double y = legend_h + 10;
  for (const Simulation& s : sims) {
    const PipeLayout& L = s.layout;
    o << "<text x='" << left << "' y='" << y + 16 << "' font-size='13'>" << xml_escape(s.name) << ": pp " << L.pp << ", "
      << L.chunks << (L.chunks == 1 ? " chunk" : " chunks") << " per rank, " << L.micro
      << (L.micro == 1 ? " micro-batch" : " micro-batches") << "; step " << shown(s.step_time) << suffix << ", bubble " << std::fixed << std::setprecision(1)
      << 100 * s.bubble << std::defaultfloat << std::setprecision(6) << "%</text>\n";
    y += title_h;
    const double step = grid_step(longest);
    for (double t = 0; t <= s.step_time + 1e-9; t += step)
      o << "<line x1='" << left + t * scale << "' x2='" << left + t * scale << "' y1='" << y << "' y2='"
        << y + L.pp * row << "' stroke='#e4e4e4'/><text x='" << left + t * scale << "' y='" << y + L.pp * row + 13
        << "' text-anchor='middle' fill='#666'>" << shown(t) << (t == 0 ? suffix : "") << "</text>\n";
    for (int r = 0; r < L.pp; ++r) {
      const double top = y + r * row;
      o << "<text x='" << left - 8 << "' y='" << top + 15 << "' text-anchor='end'>rank " << r << "</text>\n";
      for (const TimedAction& t : s.ranks[r]) {
        const double w = (t.end - t.start) * scale;
        if (w <= 0) continue;  // a transfer that takes no time
        const Rgb c = chunk_shade(kind_colour(t.action.kind), t.action.chunk, L.chunks);
        o << "<rect x='" << left + t.start * scale << "' y='" << top + 1 << "' width='" << w << "' height='"
          << row - 2 << "' fill='" << hex(c) << "' stroke='white' stroke-width='0.5'><title>"
          << action_describe(t.action) << ": " << shown(t.start) << " to " << shown(t.end) << suffix << "</title></rect>\n";
        if (t.action.is_compute() && w >= 6.5 * std::to_string(t.action.micro).size())
          o << "<text x='" << left + t.start * scale + w / 2 << "' y='" << top + 15 << "' text-anchor='middle' fill='"
            << (dark(c) ? "white" : "black") << "' font-size='10'>" << t.action.micro << "</text>\n";
      }
    }
    y += L.pp * row + 18 + gap;
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace mt
