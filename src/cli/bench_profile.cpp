// meshtrain bench profile: measures this machine as a hardware profile for `meshtrain plan`
// (plan/hardware.h): matrix FLOP/s, memory size and bandwidth, collective bandwidth and
// latency between its ranks, and the fraction of peak a training step reaches. Writes the
// profile file (default hardware_profile.toml; --out - prints it instead).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "plan/hardware.h"
#include "train/config.h"
#include "train/metrics.h"
#include "train/start_checks.h"  // output_paths_check, output_try

namespace mt {

namespace {

constexpr const char* kUsage =
    "usage: [meshtrain launch -n N] meshtrain bench profile [--out FILE.toml] [--seconds S] [--config FILE.toml]\n"
    "  measures this machine, one device per rank, and writes a hardware profile for\n"
    "  `meshtrain plan --hardware FILE.toml`\n"
    "  --out FILE.toml   where to write it (default hardware_profile.toml; - prints it)\n"
    "  --seconds S       about how long to measure (default 20)\n"
    "  --config FILE     the model whose training step calibrates `efficiency`, at its\n"
    "                    training.micro_batch (default: configs/gpt2_bench.toml's model, micro-batch 8)";

// What the command line asks for, checked (every rank reads the same arguments).
struct ProfileOptions {
  bool help = false;
  std::string out = "hardware_profile.toml", config;
  plan::MeasureOptions measure;
  std::vector<std::string> cautions;  // what makes the profile less than the user may think
};

ProfileOptions profile_options(const std::vector<std::string>& args, bool lead) {
  ProfileOptions o;
  const std::map<std::string, std::function<void(const std::string&)>> options = {
      {"--out", [&](const std::string& v) { o.out = v; }},
      {"--config", [&](const std::string& v) { o.config = v; }},
      {"--seconds", [&](const std::string& v) {
         char* end = nullptr;
         o.measure.seconds = std::strtod(v.c_str(), &end);
         MT_CHECK(!v.empty() && !*end && o.measure.seconds > 0 && o.measure.seconds <= 3600,
                  "bench profile: --seconds " << v << ": expected a number of seconds, more than 0 and at most 3600");
       }}};
  std::map<std::string, std::string> given;  // an option given twice would drop its first value
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    const auto option = options.find(a);
    MT_CHECK(option != options.end(), "bench profile: unknown option " << a << "\n" << kUsage);
    MT_CHECK(i + 1 < args.size(), "bench profile: option " << a << " needs a value");
    MT_CHECK(!given.count(a), "bench profile: " << a << " given twice (" << given[a] << " and " << args[i + 1]
                                                << "); give it once");
    given[a] = args[i + 1];
    option->second(args[++i]);
  }
  // The file is written after minutes of measuring: a place it cannot go is named first.
  const std::string& out = o.out;
  MT_CHECK(!out.empty(), "bench profile: --out is empty; give a file name, e.g. --out hardware_profile.toml");
  MT_CHECK(!std::filesystem::is_directory(out), "bench profile: --out " << out << " is a directory; give a file "
                                                << "name, e.g. --out " << (std::filesystem::path(out) / "hardware_profile.toml").string());
  if (o.measure.seconds < 5) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", o.measure.seconds);
    o.cautions.push_back(std::string("--seconds ") + secs + " is a short measurement: its rates vary from run to run " +
                         "(the default, 20 s, is steadier)");
  }
  if (!o.config.empty()) {
    const Config c = config_load(o.config, {});
    o.measure.model = c.model;
    o.measure.micro_batch = static_cast<int>(c.training.micro_batch > 0 ? c.training.micro_batch : c.training.global_batch);
    if (c.training.device == "cuda")
      o.cautions.push_back("--config " + o.config + " trains on GPUs (training.device = cuda), but this profile " +
                           "measures the CPUs; for GPUs, plan has profiles built in (--hardware h100, h200, a100-80gb, "
                           "a100-40gb)");
  }
  if (lead && out != "-") {  // opened as train opens its outputs: one that cannot be made is found now
    output_paths_check({{"--out", out, ""}}, {{"--config", o.config, ""}});
    output_try(out, "--out");
  }
  return o;
}

}  // namespace

int cmd_bench_profile(const std::vector<std::string>& args, Communicator& world) {
  const bool lead = world.rank() == 0;
  ProfileOptions po;
  agreed(world, [&] { po = profile_options(args, lead); });  // a bad option: said once, no rank aborted
  if (po.help) {
    if (lead) std::printf("%s\n", kUsage);
    return 0;
  }
  const std::string& out = po.out;
  const std::vector<std::string>& cautions = po.cautions;
  const plan::MeasureOptions& o = po.measure;
  // Progress goes to stdout, or to stderr when the profile itself does.
  FILE* talk = out == "-" ? stderr : stdout;
  if (lead)
    std::fprintf(talk, "# meshtrain bench profile: %d rank%s, about %.0f s\n", world.size(), world.size() > 1 ? "s" : "",
                 o.seconds);
  if (lead)
    for (const std::string& c : cautions) std::fprintf(talk, "note: %s\n", c.c_str());
  plan::Measured m = plan::hardware_measure(world, o, [&](const std::string& line) {
    std::fprintf(talk, "%s\n", line.c_str());
    std::fflush(talk);
  });
  if (!lead) return 0;
  for (const std::string& c : cautions) m.notes.header.push_back("note: " + c);
  const std::string text = plan::hardware_to_toml(m.hw, m.notes);
  std::fprintf(talk, "\nprofile %s (per rank):\n", m.hw.name.c_str());
  for (const std::string& l : m.summary) std::fprintf(talk, "  %s\n", l.c_str());
  if (out == "-") {
    std::printf("%s", text.c_str());
    return 0;
  }
  FILE* f = std::fopen(out.c_str(), "w");
  MT_CHECK(f, "bench profile: cannot write --out " << out << ": " << std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int write_errno = errno;
  MT_CHECK(std::fclose(f) == 0 && ok, "bench profile: cannot write --out " << out << ": "
                                                                            << std::strerror(ok ? errno : write_errno));
  std::printf("wrote %s: meshtrain plan --hardware %s ...\n", out.c_str(), out.c_str());
  return 0;
}

}  // namespace mt
