// meshtrain schedule: makes a pipeline schedule (or reads one from a file), checks it,
// simulates it and prints each rank's timeline, the step time, the bubble and the
// activations each rank holds. --compare does the same for every named schedule the layout
// allows and prints a table; --svg draws the timelines, --json prints them for programs,
// --csv writes the schedule as a file to edit and load back (file:PATH).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"                // MT_CHECK
#include "parallel/schedule.h"         // schedule_make, schedule_read, schedule_layout_issue
#include "parallel/schedule_sim.h"     // schedule_simulate
#include "parallel/schedule_svg.h"     // schedule_svg
#include "train/metrics.h"             // output_parent_create
#include "train/start_checks.h"        // output_paths_check

namespace mt {

namespace {

constexpr int kDefaultPp = 4, kDefaultMicro = 8;

// "--costs F=1,B=2,BI=1,BW=1,SEND=0,RECV=0": any of them, each once, from 0 to kMaxCost (a
// step's sum of them stays finite); the rest keep their defaults.
ActionCosts costs_parse(const std::string& text) {
  constexpr double kMaxCost = 1e9;
  ActionCosts c;
  std::stringstream ss(text);
  std::string item;
  std::set<std::string> given;
  while (std::getline(ss, item, ',')) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    double* slot = key == "F" ? &c.f : key == "B" ? &c.b : key == "BI" ? &c.bi : key == "BW" ? &c.bw
                 : key == "SEND" ? &c.send : key == "RECV" ? &c.recv : nullptr;
    MT_CHECK(slot && eq != std::string::npos,
             "--costs: \"" << item << "\" is not ACTION=TIME with ACTION one of F, B, BI, BW, SEND, RECV");
    size_t used = 0;
    try {
      *slot = std::stod(item.substr(eq + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MT_CHECK(used > 0 && used == item.size() - eq - 1, "--costs: \"" << item.substr(eq + 1) << "\" is not a number");
    MT_CHECK(*slot >= 0 && *slot <= kMaxCost,
             "--costs: " << item << ": a time must be from 0 to " << kMaxCost << " (any unit; only ratios matter)");
    MT_CHECK(given.insert(key).second, "--costs: " << key << " is given twice; give each action once");
  }
  return c;
}

std::string issue_message(const LayoutIssue& issue, int chunks, int micro) {
  const bool c = issue.knob == LayoutIssue::chunks;
  const std::string flag = c ? "--chunks" : "--microbatches";
  return flag + " " + std::to_string(c ? chunks : micro) + ": " + issue.why + "; use " + flag + " " +
         std::to_string(issue.use);
}

// The file's layout decides; a flag that says otherwise is a mistake worth naming.
void file_layout_agrees(const ScheduleOptions& o, const PipeLayout& L, const std::string& path) {
  auto agree = [&](const std::optional<int>& flag, int value, const char* name, const char* key) {
    MT_CHECK(!flag || *flag == value, name << " " << *flag << " differs from " << path << "'s layout (" << key << "="
                                           << value << "); leave " << name << " out");
  };
  agree(o.pp, L.pp, "--pp", "pp");
  agree(o.chunks, L.chunks, "--chunks", "chunks");
  agree(o.micro, L.micro, "--microbatches", "microbatches");
}

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string layout_line(const PipeLayout& L) {
  return "pp " + std::to_string(L.pp) + ", " + std::to_string(L.chunks) + (L.chunks == 1 ? " chunk" : " chunks") +
         " per rank, " + std::to_string(L.micro) + (L.micro == 1 ? " micro-batch" : " micro-batches");
}

std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

// One line per rank: compute actions in order ("BI3", or "F3c1" for chunk 1 when there are
// several), "(t)" where the rank computes nothing for t time units; wrapped at 110 columns.
void timeline_print(const Simulation& s) {
  std::printf("timeline (action and micro-batch%s; (t): t time units without compute):\n",
              s.layout.chunks > 1 ? ", cN: chunk N" : "");
  for (int r = 0; r < s.layout.pp; ++r) {
    std::string line = "  rank " + std::to_string(r) + " |";
    const size_t indent = line.size();
    double t = 0;
    auto token = [&](const std::string& tok) {
      if (line.size() + 1 + tok.size() > 110) {
        std::printf("%s\n", line.c_str());
        line = std::string(indent, ' ');
      }
      line += " " + tok;
    };
    for (const TimedAction& a : s.ranks[r]) {
      if (!a.action.is_compute()) continue;
      if (a.start > t + 1e-9) token("(" + fmt(a.start - t) + ")");
      token(std::string(action_kind_name(a.action.kind)) + std::to_string(a.action.micro) +
            (s.layout.chunks > 1 ? "c" + std::to_string(a.action.chunk) : ""));
      t = a.end;
    }
    if (s.step_time > t + 1e-9) token("(" + fmt(s.step_time - t) + ")");
    std::printf("%s\n", line.c_str());
  }
}

void summary_print(const Simulation& s) {
  const int v = s.layout.chunks;
  std::printf("step time %s, bubble %.4f (the %d ranks are idle %.1f%% of the step)\n", fmt(s.step_time).c_str(),
              s.bubble, s.layout.pp, 100 * s.bubble);
  std::printf("peak activations in flight per rank (F done, B/BI not%s): %s\n",
              v > 1 ? ("; micro-batch chunks, each 1/" + std::to_string(v) + " of a rank's layers").c_str() : "",
              list(s.peak_in_flight).c_str());
  std::printf("  counting until B/BW (BW still needs the layer inputs): %s\n", list(s.peak_until_weight).c_str());
}

// One row per schedule. Activations held are those of the busiest rank, in micro-batches
// through a whole rank's layers (chunk counts / v), so that schedules with different v compare.
void compare_print(const std::vector<Simulation>& sims, const std::vector<std::pair<std::string, std::string>>& not_run) {
  std::printf("%-24s %6s %8s %8s  %10s %10s\n", "schedule", "chunks", "step", "bubble", "held B/BI", "held B/BW");
  for (const Simulation& s : sims) {
    auto busiest = [&](const std::vector<int>& peaks) {
      return fmt(static_cast<double>(*std::max_element(peaks.begin(), peaks.end())) / s.layout.chunks);
    };
    std::printf("%-24s %6d %8s %8.4f  %10s %10s\n", s.name.c_str(), s.layout.chunks, fmt(s.step_time).c_str(), s.bubble,
                busiest(s.peak_in_flight).c_str(), busiest(s.peak_until_weight).c_str());
  }
  std::printf("held: the most micro-batches whose activations one rank holds until their B/BI, and until B/BW\n"
              "(a chunk's count as 1/v of a micro-batch through the rank's layers)\n");
  for (const auto& [name, why] : not_run) std::printf("not run: %s: %s\n", name.c_str(), why.c_str());
}

nlohmann::json sim_json(const Simulation& s) {
  const ActionCosts& c = s.costs;
  nlohmann::json j = {{"schedule", s.name},
                      {"pp", s.layout.pp},
                      {"chunks", s.layout.chunks},
                      {"microbatches", s.layout.micro},
                      {"costs", {{"F", c.f}, {"B", c.b}, {"BI", c.bi}, {"BW", c.bw}, {"SEND", c.send}, {"RECV", c.recv}}},
                      {"step_time", s.step_time},
                      {"bubble", s.bubble},
                      {"peak_activations", s.peak_in_flight},
                      {"peak_activations_until_bw", s.peak_until_weight}};
  nlohmann::json ranks = nlohmann::json::array();
  for (const std::vector<TimedAction>& line : s.ranks) {
    nlohmann::json actions = nlohmann::json::array();
    for (const TimedAction& t : line) {
      nlohmann::json a = {{"kind", action_kind_name(t.action.kind)},
                          {"micro", t.action.micro},
                          {"chunk", t.action.chunk},
                          {"start", t.start},
                          {"end", t.end}};
      if (!t.action.is_compute()) a["peer"] = t.action.peer;
      actions.push_back(a);
    }
    ranks.push_back(actions);
  }
  j["ranks"] = ranks;
  return j;
}

}  // namespace

void schedule_options_add(CLI::App* cmd, ScheduleOptions* o) {
  cmd->add_option("--schedule", o->schedule, "gpipe, 1f1b, interleaved, zb-h1, zbv, or file:PATH")->capture_default_str();
  cmd->add_option("--pp", o->pp, "pipeline ranks (default 4)");
  cmd->add_option("--chunks", o->chunks, "model chunks per rank (default: 2 for interleaved and zbv, else 1)");
  cmd->add_option("--microbatches", o->micro, "micro-batches per step (default 8)");
  cmd->add_flag("--compare", o->compare, "every schedule that takes the layout, in a table (and one picture)");
  cmd->add_flag("--json", o->json, "print one JSON object: timelines, bubble, peak activations");
  cmd->add_option("--svg", o->svg, "draw the timeline(s) to this SVG file");
  cmd->add_option("--csv", o->csv, "write the schedule as text, to edit and load with file:PATH");
  cmd->add_option("--costs", o->costs, "action times, e.g. F=1,B=2,BI=1,BW=1,SEND=0,RECV=0 (these are the defaults)");
}

int cmd_schedule(const ScheduleOptions& o) {
  auto at_least_one = [](const std::optional<int>& value, const char* flag) {
    MT_CHECK(!value || *value >= 1, flag << " " << *value << ": must be at least 1");
  };
  at_least_one(o.pp, "--pp");
  at_least_one(o.chunks, "--chunks");
  at_least_one(o.micro, "--microbatches");
  const bool from_file = o.schedule.rfind("file:", 0) == 0;
  const auto& names = schedule_names();
  MT_CHECK(from_file || std::find(names.begin(), names.end(), o.schedule) != names.end(),
           "--schedule " << o.schedule << ": no such schedule; use gpipe, 1f1b, interleaved, zb-h1, zbv or file:PATH");
  MT_CHECK(!o.compare || o.csv.empty(), "--csv writes one schedule; leave out --compare");
  const ActionCosts costs = costs_parse(o.costs);
  output_paths_check({{"--svg", o.svg, ""}, {"--csv", o.csv, ""}},
                     {{"--schedule", from_file ? o.schedule : "", from_file ? o.schedule.substr(5) : ""}});

  std::vector<Schedule> schedules;
  std::vector<std::pair<std::string, std::string>> not_run;  // (schedule, why)
  if (from_file) {
    schedules.push_back(schedule_read(o.schedule.substr(5)));
    file_layout_agrees(o, schedules[0].layout, o.schedule.substr(5));
  }
  const int pp = from_file ? schedules[0].layout.pp : o.pp.value_or(kDefaultPp);
  const int micro = from_file ? schedules[0].layout.micro : o.micro.value_or(kDefaultMicro);
  // The timelines (JSON, pictures) grow with every action: a bound far above any pipeline
  // a person reads, far below the memory a million micro-batches' timelines take.
  const auto too_large = [&](int chunks) -> std::optional<std::string> {
    constexpr int64_t kMaxDrawn = 1 << 16;
    if (schedule_within(pp, chunks, micro, kMaxDrawn)) return std::nullopt;
    return "pp x chunks x micro-batches = " + std::to_string(pp) + " x " + std::to_string(chunks) + " x " +
           std::to_string(micro) + " forward passes, more than the " + std::to_string(kMaxDrawn) + " this command " +
           "simulates and draws: use fewer micro-batches, chunks or pipeline ranks (the bubble follows the " +
           "micro-batches per pipeline rank, which smaller counts show)";
  };
  if (auto why = from_file ? too_large(schedules[0].layout.chunks) : std::nullopt) MT_FAIL(*why);
  std::vector<std::string> named;  // the named schedules to make
  if (o.compare) named = names;
  else if (!from_file) named = {o.schedule};
  for (const std::string& name : named) {
    const int chunks = o.chunks.value_or(schedule_default_chunks(name));
    if (auto why = too_large(chunks)) {
      MT_CHECK(o.compare, *why);
      not_run.push_back({name, *why});
      continue;
    }
    if (auto issue = schedule_layout_issue(name, pp, chunks, micro)) {
      MT_CHECK(o.compare, issue_message(*issue, chunks, micro));
      not_run.push_back({name, issue_message(*issue, chunks, micro)});
      continue;
    }
    schedules.push_back(schedule_make(name, pp, chunks, micro));
  }
  MT_CHECK(!schedules.empty(), "no schedule takes this layout: " << not_run.front().second);

  std::vector<Simulation> sims;
  for (const Schedule& s : schedules) sims.push_back(schedule_simulate(s, costs));
  if (!o.csv.empty()) {
    output_parent_create(o.csv, "--csv");
    schedule_write(o.csv, schedules[0]);
  }
  if (!o.svg.empty()) {
    output_parent_create(o.svg, "--svg");
    std::ofstream f(o.svg);
    f << schedule_svg(sims);
    MT_CHECK(f.good(), "cannot write --svg " << o.svg);
  }
  if (o.json) {
    nlohmann::json j;
    if (o.compare) {
      j["schedules"] = nlohmann::json::array();
      for (const Simulation& s : sims) j["schedules"].push_back(sim_json(s));
      j["not_run"] = nlohmann::json::array();
      for (const auto& [name, why] : not_run) j["not_run"].push_back({{"schedule", name}, {"reason", why}});
    } else {
      j = sim_json(sims[0]);
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("costs per micro-batch through a rank's layers: F %s, B %s, BI %s, BW %s, send %s, receive %s\n",
              fmt(costs.f).c_str(), fmt(costs.b).c_str(), fmt(costs.bi).c_str(), fmt(costs.bw).c_str(),
              fmt(costs.send).c_str(), fmt(costs.recv).c_str());
  if (o.compare) {
    std::printf("pp %d, %d micro-batch%s\n", pp, micro, micro == 1 ? "" : "es");
    compare_print(sims, not_run);
  } else {
    std::printf("%s: %s\n", sims[0].name.c_str(), layout_line(sims[0].layout).c_str());
    timeline_print(sims[0]);
    summary_print(sims[0]);
  }
  if (!o.svg.empty()) std::printf("wrote %s\n", o.svg.c_str());
  if (!o.csv.empty()) std::printf("wrote %s\n", o.csv.c_str());
  return 0;
}

}  // namespace mt
