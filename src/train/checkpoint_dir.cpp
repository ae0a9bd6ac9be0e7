#include "train/checkpoint_dir.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "core/error.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace mt {

void checkpoint_dir_check(const CheckpointConfig& c) {
  if (c.dir.empty()) return;
  std::error_code ec;
  const bool exists = fs::exists(c.dir, ec);
  const fs::path real = exists && !ec ? fs::canonical(c.dir, ec) : fs::path();
  MT_CHECK(!ec, "checkpoint.dir = " << c.dir << ": " << ec.message() << "; choose another checkpoint.dir");
  if (!exists) return;
  const std::string name = real.filename().string();
  if (checkpoint_step_name(name))
    MT_FAIL("checkpoint.dir = " << c.dir << " is itself one checkpoint (" << real.string() << "), not a run's "
                                << "directory of checkpoints: the run would write its checkpoints inside it and every "
                                << "resume would go back to it. Set checkpoint.dir = " << real.parent_path().string()
                                << " (checkpoint.resume=true continues from its newest checkpoint)");
  if (fs::exists(real / "meta.json", ec)) {  // a checkpoint under another name: a resume reads step_ directories only
    std::string step_dir = "step_NNNNNNNN (its step in 8 digits)";
    try {
      step_dir = checkpoint_step_dir(checkpoint_meta(real.string())["step"].get<int64_t>());
    } catch (const std::exception&) {  // a damaged meta.json: the form, without the step
    }
    const fs::path run = real.parent_path() / (name + "_run");
    MT_FAIL("checkpoint.dir = " << c.dir << " is itself one checkpoint (" << real.string() << "), not a run's "
                                << "directory of checkpoints, and a resume reads only the step_NNNNNNNN directories of "
                                << "one: move it to " << (run / step_dir).string() << " and set checkpoint.dir = "
                                << run.string() << " (checkpoint.resume=true continues from it)");
  }
  // Damaged ones newer than the newest complete checkpoint: a resume would go back past them
  // and later overwrite them. Older ones are no such loss (checkpoint info names them all).
  std::string newest, list;
  try {
    newest = fs::path(checkpoint_latest(c.dir)).filename().string();
    for (const std::string& d : checkpoint_damaged(c.dir))
      if (fs::path(d).filename().string() > newest) list += (list.empty() ? "" : ", ") + d;
  } catch (const fs::filesystem_error& e) {  // unreadable: no permission, a directory gone meanwhile
    MT_FAIL("checkpoint.dir = " << c.dir << ": " << e.code().message() << " (" << e.path1().string()
                                << "); choose another checkpoint.dir");
  }
  if (list.empty()) return;
  MT_FAIL("checkpoint.dir " << c.dir << " holds " << list << " without meta.json: a damaged checkpoint or a partial "
                            << "copy (meshtrain checkpoint info " << c.dir << " says more), newer than "
                            << (newest.empty() ? std::string("any complete checkpoint") : newest)
                            << ". Training will not go back past it and later overwrite it: restore it whole (its "
                            << "meta.json and every shard) or remove it, then run again");
}

void checkpoint_dir_prepare(const std::string& dir, Communicator& world) {
  if (dir.empty()) return;
  // Rank 0 creates the directory, as a save would, and writes a probe file holding a nonce;
  // every rank reads it back (the directory must be one shared by all ranks), then rank 0
  // removes it (pruning old checkpoints removes files too).
  const std::string probe = dir + "/.meshtrain-write-probe";
  std::string problem, nonce;
  agreed(world, [&] {
    if (world.rank() != 0) return;
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    nonce = std::to_string(getpid()) + "-" + std::to_string(now);
    std::error_code ec;
    fs::create_directories(dir, ec);
    MT_CHECK(!ec, "cannot create checkpoint.dir = " << dir << ": " << ec.message() << "; choose another checkpoint.dir");
    std::ofstream f(probe);
    MT_CHECK(f << nonce << std::flush,
             "cannot write in checkpoint.dir = " << dir << ": " << std::strerror(errno) << "; choose another checkpoint.dir");
  });
  if (world.size() > 1) {
    nonce = allgather_strings(world, nonce)[0];
    std::ifstream f(probe);
    const std::string seen((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (seen != nonce)
      problem = "cannot see the file rank 0 wrote in checkpoint.dir = " + dir +
                ": it must be one directory shared by all ranks (a shared filesystem), given as an absolute path";
    problem = first_problem(world, problem);  // every rank has read it
  }
  std::error_code ec;
  if (world.rank() == 0 && problem.empty() && !fs::remove(probe, ec))
    problem = "cannot remove files in checkpoint.dir = " + dir + ": " + ec.message() +
              "; choose another checkpoint.dir";
  if (world.rank() == 0 && !problem.empty()) fs::remove(probe, ec);
  problem = first_problem(world, problem);
  if (!problem.empty()) throw AgreedError(problem);
}

std::string checkpoint_resume_point(const Config& c, Communicator& world, MetricsLog& log) {
  // What the directory holds, read by every rank; the verdict agreed and said once.
  std::string from;
  agreed(world, [&] {
    if (c.checkpoint.resume) from = checkpoint_latest(c.checkpoint.dir);
    if (c.checkpoint.resume || c.checkpoint.dir.empty()) return;
    const std::string old = checkpoint_latest(c.checkpoint.dir);
    MT_CHECK(old.empty(), "checkpoint.dir " << c.checkpoint.dir << " already holds checkpoints of another run (newest "
                                            << old << "); set checkpoint.resume=true to continue it, or choose "
                                            << "another checkpoint.dir (nothing was overwritten)");
  });
  if (world.size() > 1) {  // every rank compares every rank's: the same verdict everywhere
    const std::vector<std::string> all = allgather_strings(world, from);
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0])
        throw AgreedError("rank " + std::to_string(r) + " resumes from " + (all[r].empty() ? "no checkpoint" : all[r]) +
                          ", rank 0 from " + (all[0].empty() ? "no checkpoint" : all[0]) +
                          ": checkpoint.dir must be one directory shared by all ranks, given as an absolute path");
  }
  if (c.checkpoint.dir.empty()) return from;
  if (world.rank() == 0)  // before any rank saves: the set-up ends with a barrier
    for (const std::string& t : checkpoint_remove_incomplete(c.checkpoint.dir))
      log.message("removed " + t + ", an incomplete checkpoint left by an interrupted save");
  return from;
}

}  // namespace mt
