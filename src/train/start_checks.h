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

// A file a command reads or writes, for output_paths_check: the key or option that names it
// ("logging.metrics", "--out"), the value given, and the file itself where it differs (the
// trace's .svg, logging.plot's auto, a tokenizer prefix's .model).
struct NamedPath {
  std::string key;
  std::string given;
  std::string path;  // "": given
};

// Refuses, before any work, an output that would destroy data: one that is the same file as
// an input or as another output (std::filesystem::equivalent where both exist, else the same
// weakly_canonical path), or that lies at or inside a checkpoint (a directory holding
// meta.json that is named step_<digits>, is an input, or is one of save_dirs), or inside a
// step_<digits> directory of save_dirs (where a run saves its checkpoints). Empty paths are
// left out. Throws mt::Error naming both keys (or options) and what to change.
void output_paths_check(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs,
                        const std::vector<NamedPath>& save_dirs = {});

// A train run's outputs and inputs as output_paths_check takes them (logging.metrics, .plot,
// .trace and its .svg, checkpoint.dir; data.path, data.val_path, data.tokenizer,
// logging.hardware, model.init_from, a pp_schedule file) and checks them.
void check_train_paths(const Config& c);

// Creates path's directory and opens path for appending, which keeps what an existing file
// holds; a file that was not there is removed again. Throws mt::Error naming key, the path
// and the system's reason.
void output_try(const std::string& path, const std::string& key);

// An output written beside and renamed into place (prepare's token files, export's files):
// the rename would replace a device, FIFO or directory of that name, and a symbolic link
// itself rather than write through it. Refuses an empty path, one ending in '/', and one
// naming something other than a regular file, naming key; returns the file to write (a
// link's target, else path).
std::string output_replaceable(const std::string& path, const std::string& key);

// Rank 0 refuses outputs that would destroy data (check_train_paths), then creates the
// directories of logging.metrics, logging.trace (and its .svg) and
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
// the run, checkpoint.every or keep without checkpoint.dir, more recompute_blocks than a
// chunk holds. The run says so in its header.
std::vector<std::string> settings_without_effect(const Config& c);

// Every rank must run the same configuration (seed, files, layout): a rank whose resolved
// configuration differs from rank 0's stops every rank with the keys that differ, named.
void check_same_config(const Config& c, Communicator& world);

}  // namespace mt
