// The text format of schedules (schedule.h): one CSV line per action, a layout line first.
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/message.h"  // not_regular_kind
#include "parallel/schedule.h"

namespace mt {

namespace {

constexpr const char* kActionFormat = "rank,kind,micro,chunk[,peer]";
constexpr const char* kLayoutFormat = "layout,pp=P,chunks=V,microbatches=M[,stages=loop|v]";

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::vector<std::string> fields_split(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  std::string f;
  while (std::getline(ss, f, ',')) out.push_back(trim(f));
  if (!line.empty() && line.back() == ',') out.push_back("");
  return out;
}

// A whole field as an integer in [lo, hi], or an error naming what it is.
int int_parse(const std::string& field, const char* what, int lo, int hi, const std::string& where) {
  int v = 0;
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
  MT_CHECK(ec == std::errc() && end == field.data() + field.size() && !field.empty(),
           where << ": " << what << " \"" << field << "\" is not a whole number");
  MT_CHECK(v >= lo && v <= hi, where << ": " << what << " " << v << " is out of range " << lo << ".." << hi);
  return v;
}

PipeLayout layout_parse(const std::vector<std::string>& f, const std::string& where) {
  PipeLayout L;
  bool pp = false, chunks = false, micro = false;
  for (size_t i = 1; i < f.size(); ++i) {
    const size_t eq = f[i].find('=');
    const std::string key = f[i].substr(0, eq), value = eq == std::string::npos ? "" : f[i].substr(eq + 1);
    if (key == "pp") L.pp = int_parse(value, "pp", 1, 1 << 16, where), pp = true;
    else if (key == "chunks") L.chunks = int_parse(value, "chunks", 1, 1 << 16, where), chunks = true;
    else if (key == "microbatches") L.micro = int_parse(value, "microbatches", 1, 1 << 20, where), micro = true;
    else if (key == "stages" && (value == "loop" || value == "v"))
      L.placement = value == "v" ? Placement::vee : Placement::loop;
    else MT_FAIL(where << ": unknown layout entry \"" << f[i] << "\"; the line is " << kLayoutFormat);
  }
  MT_CHECK(pp && chunks && micro, where << ": the layout line needs pp, chunks and microbatches: " << kLayoutFormat);
  MT_CHECK(schedule_within(L.pp, L.chunks, L.micro), where << ": pp x chunks x microbatches = " << L.pp << " x " << L.chunks
                                                            << " x " << L.micro << " forward passes per step, more than the "
                                                            << kMaxScheduleForwards << " meshtrain schedules");
  MT_CHECK(L.placement == Placement::loop || L.chunks == 2, where << ": stages=v needs chunks=2");
  return L;
}

Action action_parse(const std::vector<std::string>& f, const PipeLayout& L, int* rank, const std::string& where) {
  MT_CHECK(f.size() == 4 || f.size() == 5, where << ": " << f.size() << " fields; a line is " << kActionFormat);
  *rank = int_parse(f[0], "rank", 0, L.pp - 1, where);
  const std::optional<Action::Kind> kind = action_kind_parse(f[1]);
  MT_CHECK(kind, where << ": unknown kind \"" << f[1] << "\"; kinds are F, B, BI, BW, SEND_ACT, RECV_ACT, SEND_GRAD, "
                          "RECV_GRAD");
  Action a{*kind, int_parse(f[2], "micro", 0, L.micro - 1, where), int_parse(f[3], "chunk", 0, L.chunks - 1, where)};
  MT_CHECK(a.is_compute() == (f.size() == 4),
           where << ": " << f[1] << (a.is_compute() ? " names no peer" : " needs the peer rank") << "; a line is "
                 << kActionFormat);
  if (!a.is_compute()) a.peer = int_parse(f[4], "peer", 0, L.pp - 1, where);
  return a;
}

}  // namespace

std::string schedule_to_text(const Schedule& s) {
  const PipeLayout& L = s.layout;
  std::ostringstream out;
  out << "# meshtrain pipeline schedule: " << s.name << "\n"
      << "layout,pp=" << L.pp << ",chunks=" << L.chunks << ",microbatches=" << L.micro
      << ",stages=" << (L.placement == Placement::vee ? "v" : "loop") << "\n# " << kActionFormat << "\n";
  for (int r = 0; r < static_cast<int>(s.ranks.size()); ++r)
    for (const Action& a : s.ranks[r]) {
      out << r << "," << action_kind_name(a.kind) << "," << a.micro << "," << a.chunk;
      if (!a.is_compute()) out << "," << a.peer;
      out << "\n";
    }
  return out.str();
}

Schedule schedule_from_text(const std::string& text, const std::string& source) {
  Schedule s;
  s.name = source;
  bool layout_seen = false;
  std::istringstream in(text);
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string body = trim(line.substr(0, line.find('#')));
    if (body.empty()) continue;
    const std::string where = source + ":" + std::to_string(number);
    const std::vector<std::string> f = fields_split(body);
    if (f[0] == "layout") {
      MT_CHECK(!layout_seen, where << ": a second layout line");
      s.layout = layout_parse(f, where);
      s.ranks.resize(s.layout.pp);
      layout_seen = true;
      continue;
    }
    MT_CHECK(layout_seen, where << ": the layout line must come before the actions: " << kLayoutFormat);
    int rank = 0;
    const Action a = action_parse(f, s.layout, &rank, where);
    s.ranks[rank].push_back(a);
  }
  MT_CHECK(layout_seen, source << ": no layout line; the first line is " << kLayoutFormat);
  return s;
}

Schedule schedule_read(const std::string& path) {
  const std::string kind = not_regular_kind(path);  // a FIFO would block the open below
  MT_CHECK(kind.empty(), path << " is " << kind << ", not a schedule file");
  std::ifstream f(path);
  MT_CHECK(f, "cannot open the schedule file " << path << ": " << std::strerror(errno));
  std::stringstream text;
  text << f.rdbuf();
  return schedule_from_text(text.str(), path);
}

void schedule_write(const std::string& path, const Schedule& s) {
  std::ofstream f(path);
  f << schedule_to_text(s);
  MT_CHECK(f.good(), "cannot write the schedule file " << path);
}

}  // namespace mt
