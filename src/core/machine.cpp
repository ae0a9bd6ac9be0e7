#include "core/machine.h"

#include <sched.h>

#include <algorithm>

namespace mt {

int affinity_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;  // unknown: assume the least
  return std::max(1, CPU_COUNT(&set));
}

int threads_per_rank(int ranks_on_machine) { return std::max(1, affinity_cpus() / std::max(1, ranks_on_machine)); }

}  // namespace mt
