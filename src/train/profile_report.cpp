#include "train/profile_report.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace mt {

namespace {

using nlohmann::json;

// This rank's measurements as JSON: [[name, calls, self_s, total_s], ...] per table, and
// its events (times shifted to the trace's origin).
json rank_json(const Profiler& p, bool with_events, double trace_origin) {
  json j = {{"steps", p.steps()}, {"step_s", p.step_seconds()}, {"rows", json::array()}, {"async", json::array()}};
  for (const Profiler::Row& r : p.rows()) j["rows"].push_back({r.name, r.calls, r.self_s, r.total_s});
  for (const Profiler::Row& r : p.async_rows()) j["async"].push_back({r.name, r.calls, r.self_s, r.total_s});
  if (!with_events) return j;
  const double shift = p.origin() - trace_origin;
  json ev = json::array();  // flat: name, lane, start, end, ...
  for (const Profiler::Event& e : p.events()) {
    ev.push_back(e.name);
    ev.push_back(e.thread);
    ev.push_back(e.start + shift);
    ev.push_back(e.end + shift);
  }
  j["names"] = p.names();
  j["lanes"] = p.lanes();
  j["events"] = std::move(ev);
  return j;
}

// One table's rows over ranks: per name, per rank [calls, self_s, total_s].
struct Merged {
  std::string name;
  std::vector<double> calls, self_s, total_s;
  double mean_self() const {
    double s = 0;
    for (double x : self_s) s += x;
    return s / self_s.size();
  }
};

std::vector<Merged> merge(const std::vector<json>& ranks, const char* table) {
  const size_t R = ranks.size();
  std::map<std::string, Merged> by_name;
  for (size_t k = 0; k < R; ++k)
    for (const json& row : ranks[k][table]) {
      Merged& m = by_name[row[0].get<std::string>()];
      if (m.calls.empty()) m.name = row[0], m.calls.assign(R, 0), m.self_s.assign(R, 0), m.total_s.assign(R, 0);
      m.calls[k] = row[1], m.self_s[k] = row[2], m.total_s[k] = row[3];
    }
  std::vector<Merged> r;
  for (auto& [name, m] : by_name) r.push_back(std::move(m));
  std::stable_sort(r.begin(), r.end(), [](const Merged& a, const Merged& b) { return a.mean_self() > b.mean_self(); });
  return r;
}

double mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return x.empty() ? 0 : s / x.size();
}

json ms(const std::vector<double>& seconds) {
  json a = json::array();
  for (double s : seconds) a.push_back(s * 1e3);
  return a;
}

// One printed row: name, calls, self ms, % of step, self ms per call, inclusive ms, and
// with several ranks the least and most busy rank's self ms.
std::string table_line(const std::string& name, const std::string& calls, double self_ms, double pct, double per_call,
                       double total_ms, int ranks, double min_ms, double max_ms, int max_rank) {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "  %-24s %8s %11.2f %7.1f%% %9.3f %11.2f", name.c_str(), calls.c_str(), self_ms,
                        pct, per_call, total_ms);
  if (ranks > 1 && n > 0)
    std::snprintf(buf + n, sizeof buf - n, " %10.2f %10.2f (%d)", min_ms, max_ms, max_rank);
  return buf;
}

std::string calls_text(double c) {
  char buf[32];
  std::snprintf(buf, sizeof buf, c == static_cast<int64_t>(c) ? "%.0f" : "%.1f", c);
  return buf;
}

// Chrome trace events of one rank: a process per rank, threads "ops" and one per lane.
void rank_events(const json& j, int rank, json& out) {
  const int pid = 1000 + rank;
  auto tid = [&](int lane) { return 100000 + 64 * rank + lane; };  // unique over processes, never 0
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid(0)},
                 {"args", {{"name", "rank " + std::to_string(rank) + " profile"}}}});
  out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid(0)}, {"args", {{"name", "ops"}}}});
  const json& lanes = j["lanes"];
  for (size_t k = 0; k < lanes.size(); ++k)
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid(static_cast<int>(k + 1))},
                   {"args", {{"name", lanes[k]}}}});
  const json& names = j["names"];
  const json& ev = j["events"];
  for (size_t i = 0; i + 3 < ev.size(); i += 4) {
    const int lane = ev[i + 1];
    const double start = ev[i + 2], end = ev[i + 3];
    out.push_back({{"name", names[ev[i].get<int>()]}, {"cat", lane ? "communication" : "op"}, {"ph", "X"},
                   {"ts", start * 1e6}, {"dur", (end - start) * 1e6}, {"pid", pid}, {"tid", tid(lane)}});
  }
}

}  // namespace

ProfileReport profile_gather(const Profiler& p, Communicator& world, bool with_events, double trace_origin) {
  std::vector<json> ranks;
  for (const std::string& s : allgather_strings(world, rank_json(p, with_events, trace_origin).dump()))
    ranks.push_back(json::parse(s));
  const int R = world.size();
  std::vector<double> step_s(R), other_s(R);
  for (int k = 0; k < R; ++k) step_s[k] = ranks[k]["step_s"];
  const std::vector<Merged> rows = merge(ranks, "rows"), async = merge(ranks, "async");
  for (int k = 0; k < R; ++k) {
    other_s[k] = step_s[k];
    for (const Merged& m : rows) other_s[k] -= m.self_s[k];
  }

  ProfileReport rep;
  json& js = rep.summary;
  js = {{"event", "profile"}, {"steps", ranks[0]["steps"]}, {"ranks", R}, {"step_ms", ms(step_s)},
        {"other_ms", ms(other_s)}, {"rows", json::array()}, {"comm_threads", json::array()}};
  for (const Merged& m : rows)
    js["rows"].push_back({{"name", m.name}, {"calls", m.calls}, {"self_ms", ms(m.self_s)}, {"total_ms", ms(m.total_s)}});
  for (const Merged& m : async) js["comm_threads"].push_back({{"name", m.name}, {"calls", m.calls}, {"ms", ms(m.self_s)}});

  const double step_ms = mean(step_s) * 1e3;
  const int64_t steps = ranks[0]["steps"];
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "profile: %lld steps%s, %.1f ms per step; self times (a scope's time minus the scopes inside it): the "
                "rows add up to the steps' time",
                static_cast<long long>(steps), R > 1 ? (", mean over " + std::to_string(R) + " ranks").c_str() : "",
                steps ? step_ms / steps : 0.0);
  rep.lines.push_back(buf);
  auto header = [&](const char* self_name) {
    std::snprintf(buf, sizeof buf, "  %-24s %8s %11s %8s %9s %11s", "name", "calls", self_name, "% step", "mean ms",
                  "total ms");
    std::string h = buf;
    if (R > 1) h += "     min ms     max ms (rank)";
    rep.lines.push_back(h);
  };
  auto add = [&](const Merged& m, double pct_of) {
    const double self = mean(m.self_s) * 1e3, calls = mean(m.calls);
    const auto mx = std::max_element(m.self_s.begin(), m.self_s.end());
    rep.lines.push_back(table_line(m.name, calls ? calls_text(calls) : "-", self, 100 * self / pct_of, calls ? self / calls : 0,
                                   mean(m.total_s) * 1e3, R, *std::min_element(m.self_s.begin(), m.self_s.end()) * 1e3,
                                   *mx * 1e3, static_cast<int>(mx - m.self_s.begin())));
  };
  const double whole = std::max(step_ms, 1e-9);
  header("self ms");
  for (const Merged& m : rows) add(m, whole);
  add({"other (unprofiled)", std::vector<double>(R, 0), other_s, other_s}, whole);
  add({"step", std::vector<double>(R, static_cast<double>(steps)), step_s, step_s}, whole);
  if (!async.empty()) {
    rep.lines.push_back("communication threads (each group's collectives as its thread ran them, beside the compute; "
                        "not in the sum above):");
    header("busy ms");
    for (const Merged& m : async) add(m, whole);
  }
  rep.trace_events = json::array();
  if (with_events)
    for (int k = 0; k < R; ++k) rank_events(ranks[k], k, rep.trace_events);
  return rep;
}

}  // namespace mt
