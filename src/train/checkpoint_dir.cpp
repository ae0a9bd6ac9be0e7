#include "train/checkpoint_dir.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
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

// The names and listing of checkpoint directories (train/checkpoint.h).

std::string checkpoint_step_dir(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

bool checkpoint_step_name(const std::string& name, bool old) {
  const std::string n = old && name.size() > 4 && name.ends_with(".old") ? name.substr(0, name.size() - 4) : name;
  return n.size() > 5 && n.rfind("step_", 0) == 0 && n.find_first_not_of("0123456789", 5) == std::string::npos;
}

std::vector<std::string> checkpoint_list(const std::string& root) {
  std::vector<std::string> dirs;
  if (!fs::is_directory(root)) return dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string name = e.path().filename().string();
    if (!e.is_directory() || !checkpoint_step_name(name, true) || !fs::exists(e.path() / "meta.json")) continue;
    // step_N.old is the previous copy of step N, complete; it counts only if a save died
    // between its two renames and step_N is missing.
    const size_t old = name.find(".old");
    if (old != std::string::npos && fs::exists(root + "/" + name.substr(0, old))) continue;
    dirs.push_back(e.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

std::string checkpoint_latest(const std::string& root) {
  if (fs::exists(root + "/meta.json")) return root;
  MT_CHECK(checkpoint_name_step(root) < 0 || !fs::is_directory(root),
           "checkpoint " << root << " has no meta.json: a damaged checkpoint or a partial copy (meshtrain checkpoint "
                         << "info " << root << " says more); restore it whole (its meta.json and every shard) from a "
                         << "copy, or pass another checkpoint");
  const std::vector<std::string> dirs = checkpoint_list(root);
  const std::vector<std::string> damaged = checkpoint_damaged(root);
  const std::string newest = dirs.empty() ? "" : dirs.back();
  if (!damaged.empty() && (newest.empty() || fs::path(damaged.back()).filename() > fs::path(newest).filename()))
    MT_FAIL(root << " holds " << damaged.back() << " without meta.json, newer than "
                 << (newest.empty() ? std::string("any complete checkpoint") : newest)
                 << ": a damaged checkpoint or a partial copy, never passed over for an older one (meshtrain checkpoint "
                 << "info " << root << " says more). Restore it whole (its meta.json and every shard) or remove it"
                 << (newest.empty() ? std::string() : "; or pass " + newest + " to read that one"));
  return newest;
}

std::string checkpoint_given(const std::string& given, const std::string& advice) {
  std::error_code ec;
  MT_CHECK(!given.empty(), "--checkpoint is empty; give a checkpoint directory (step_N) or a run's checkpoint.dir");
  MT_CHECK(fs::exists(given, ec), "--checkpoint " << given << " is not there; " << advice);
  MT_CHECK(fs::is_directory(given, ec), "--checkpoint " << given << " is a file, not a checkpoint directory; give a "
                                                        << "checkpoint directory (step_N) or a run's checkpoint.dir");
  const std::string dir = checkpoint_latest(given);
  MT_CHECK(!dir.empty(), "no checkpoint in " << given << "; " << advice);
  return dir;
}

std::vector<std::string> checkpoint_damaged(const std::string& root) {
  std::vector<std::string> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec) || fs::exists(root + "/meta.json", ec)) return dirs;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory(ec) || !checkpoint_step_name(name, true) || fs::exists(e.path() / "meta.json", ec)) continue;
    const size_t old = name.find(".old");
    if (old != std::string::npos && fs::exists(root + "/" + name.substr(0, old), ec)) continue;
    if (!fs::exists(e.path(), ec)) continue;  // renamed away meanwhile: pruned by a running save
    dirs.push_back(e.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

std::vector<std::string> checkpoint_remove_incomplete(const std::string& root) {
  std::vector<std::string> removed;
  if (!fs::is_directory(root)) return removed;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && e.path().filename().string().rfind(".tmp-step_", 0) == 0) removed.push_back(e.path());
  std::sort(removed.begin(), removed.end());
  for (const std::string& d : removed) fs::remove_all(d);
  return removed;
}

int64_t checkpoint_name_step(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(dir, ec);
  if (ec) p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  std::string name = p.filename().string();
  if (!checkpoint_step_name(name, true)) return -1;
  if (name.ends_with(".old")) name.resize(name.size() - 4);
  const std::string digits = name.substr(5);
  return digits.size() > 18 ? -1 : std::stoll(digits);
}

std::string checkpoint_damage_advice(const std::string& dir, bool resuming) {
  // The checkpoint before it: the newest complete one beside it with an older name.
  const fs::path d = fs::path(dir).lexically_normal();
  const fs::path step = d.filename().empty() ? d.parent_path() : d;
  std::string before;
  if (checkpoint_step_name(step.filename().string(), true)) {
    std::error_code ec;
    for (const std::string& c : checkpoint_list(step.parent_path().string()))
      if (fs::path(c).filename() < step.filename() && !fs::equivalent(c, step, ec)) before = c;
  }
  const std::string check = " (check it with meshtrain checkpoint info " + before + ")";
  if (resuming)
    return "restore the file from a copy, or delete " + dir + " so that checkpoint.resume=true continues from " +
           (before.empty() ? std::string("step 0 (no earlier checkpoint is left)") : before + check);
  if (before.empty()) return "restore the file from a copy (no earlier checkpoint is left beside it)";
  return "restore the file from a copy, or pass --checkpoint " + before + ", the checkpoint before it" + check;
}


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
    const std::vector<std::string> complete = checkpoint_list(c.dir);  // checkpoint_latest would refuse with its words
    if (!complete.empty()) newest = fs::path(complete.back()).filename().string();
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
