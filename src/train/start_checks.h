// Checks of a run's inputs and outputs made before any work: a bad output path or a missing
// profile found after hours of training would cost the run its end (the summary line, the
// trace), so the files the run will write and read are tried at start-up.
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "train/config.h"

namespace mt {

// The loss curve's file: logging.plot, its "auto" resolved beside logging.metrics; "" for none.
std::string plot_path(const Config& c);

// Rank 0 creates the directories of logging.metrics, logging.trace (and its .svg) and
// logging.plot, tries opening those files for writing (an existing file is kept as it is),
// loads logging.hardware and data.tokenizer, and refuses a CPU run whose ranks on this
// machine need more memory than it has (the planner's count of the layout c resolves to:
// c is resolved, as train() resolves it); every rank then throws AgreedError with rank 0's
// message, which names the key and what to change.
void outputs_prepare(const Config& c, Communicator& world);

// The memory this process may use: the machine's (MemTotal), or its memory cgroup's limit
// where that is less (a container, a job's allocation), with the file that set it. Paths
// under `root` (tests).
struct MachineMemory {
  double bytes = 0;    // 0: unknown
  std::string source;  // the cgroup file, where the limit is the cgroup's
};
MachineMemory machine_memory(const std::string& root = "");

// Settings this resolved configuration accepts but that change nothing, each with why:
// compression with one data-parallel rank, loss scaling without fp16, a warmup longer than
// the run. The run says so in its header.
std::vector<std::string> settings_without_effect(const Config& c);

// Every rank must run the same configuration (seed, files, layout): a rank whose resolved
// configuration differs from rank 0's stops every rank with the keys that differ, named.
void check_same_config(const Config& c, Communicator& world);

}  // namespace mt
