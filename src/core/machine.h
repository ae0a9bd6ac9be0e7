// This machine's cores as a process sees them, and how many threads a rank takes of them.
#pragma once

namespace mt {

// The CPUs this process may run on (its affinity mask: a cgroup's or a scheduler's binding
// counts, where the machine's total would not); 1 where unknown.
int affinity_cpus();

// A rank's threads where neither OMP_NUM_THREADS nor training.threads says: the CPUs shared
// among the job's ranks on this machine, at least 1.
int threads_per_rank(int ranks_on_machine);

// An on/off switch in the environment (MESHTRAIN_CPU_BF16, MESHTRAIN_FUSED_GELU): true where
// it is unset, empty, on or 1, false where it is off or 0 (any case); another value fails,
// naming the variable and what it takes (OFF and false were a silent "on").
bool env_switch_on(const char* name);

}  // namespace mt
