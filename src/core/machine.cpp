#include "core/machine.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace mt {

int affinity_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;  // unknown: assume the least
  return std::max(1, CPU_COUNT(&set));
}

int threads_per_rank(int ranks_on_machine) { return std::max(1, affinity_cpus() / std::max(1, ranks_on_machine)); }

bool env_switch_on(const char* name) {
  const char* e = std::getenv(name);
  std::string v = e ? e : "";
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v.empty() || v == "on" || v == "1") return true;
  MT_CHECK(v == "off" || v == "0", name << "=" << e << " is not a switch: set it to off (or 0), or leave it unset");
  return false;
}

}  // namespace mt
