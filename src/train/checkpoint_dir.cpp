#include "train/checkpoint_dir.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "core/error.h"
#include "parallel/data_parallel.h"  // check_same_hash
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace mt {

void checkpoint_dir_check(const CheckpointConfig& c) {
  if (c.dir.empty()) return;
  if (fs::exists(fs::path(c.dir) / "meta.json")) {
    fs::path step = fs::path(c.dir).lexically_normal();
    if (!step.has_filename()) step = step.parent_path();  // "D/step_00000005/"
    const std::string parent = step.has_parent_path() ? step.parent_path().string() : ".";
    MT_FAIL("checkpoint.dir = " << c.dir << " is itself one checkpoint (it holds meta.json), not a run's directory "
                                << "of checkpoints: the run would write its checkpoints inside it and every resume "
                                << "would go back to it. Set checkpoint.dir = " << parent
                                << " (checkpoint.resume=true continues from its newest checkpoint)");
  }
  const std::vector<std::string> damaged = checkpoint_damaged(c.dir);
  if (damaged.empty()) return;
  std::string list;
  for (const std::string& d : damaged) list += (list.empty() ? "" : ", ") + d;
  MT_FAIL("checkpoint.dir " << c.dir << " holds " << list << " without meta.json: a damaged checkpoint or a partial "
                            << "copy (meshtrain checkpoint info " << c.dir << " says more). Training will not go "
                            << "back past it to an older checkpoint and later overwrite it: restore it whole (its "
                            << "meta.json and every shard) or remove it, then run again");
}

void checkpoint_dir_prepare(const std::string& dir, Communicator& world) {
  if (dir.empty()) return;
  std::string problem;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      problem = "cannot create checkpoint.dir = " + dir + ": " + ec.message();
    } else {
      // A directory that exists can still refuse files: permissions, a read-only mount, quota.
      const std::string probe = dir + "/.meshtrain-write-probe-" + std::to_string(getpid());
      {
        std::ofstream f(probe);
        if (!(f << "probe\n" << std::flush))
          problem = "cannot write in checkpoint.dir = " + dir + ": " + std::strerror(errno);
      }
      if (!fs::remove(probe, ec) && ec && problem.empty())
        problem = "cannot remove files in checkpoint.dir = " + dir + ": " + ec.message();
    }
    if (!problem.empty()) problem += "; choose another checkpoint.dir (every rank must write there)";
  }
  if (world.size() > 1) problem = allgather_strings(world, problem)[0];  // rank 0's verdict, on every rank
  MT_CHECK(problem.empty(), problem);
}

std::string checkpoint_resume_point(const Config& c, Communicator& world, MetricsLog& log) {
  std::string from;
  if (c.checkpoint.resume) from = checkpoint_latest(c.checkpoint.dir);
  if (world.size() > 1)
    check_same_hash(world, std::hash<std::string>{}(from), "newest checkpoint (" + from + ")",
                    "checkpoint.dir must be one directory shared by all ranks, given as an absolute path");
  if (c.checkpoint.dir.empty()) return from;
  if (!c.checkpoint.resume) {
    const std::string old = checkpoint_latest(c.checkpoint.dir);
    MT_CHECK(old.empty(), "checkpoint.dir " << c.checkpoint.dir << " already holds checkpoints of another run (newest "
                                            << old << "); set checkpoint.resume=true to continue it, or choose "
                                            << "another checkpoint.dir (nothing was overwritten)");
  }
  if (world.rank() == 0)  // before any rank saves: the set-up ends with a barrier
    for (const std::string& t : checkpoint_remove_incomplete(c.checkpoint.dir))
      log.message("removed " + t + ", an incomplete checkpoint left by an interrupted save");
  return from;
}

}  // namespace mt
