#include "train/start_checks.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/message.h"  // not_regular_kind
#include "data/tokenizer.h"
#include "plan/hardware.h"
#include "plan/memory.h"
#include "plan/search.h"        // knobs
#include "train/checkpoint.h"   // checkpoint_step_name
#include "train/metrics.h"      // output_parent_create
#include "train/plan_report.h"  // run_layout

namespace fs = std::filesystem;

namespace mt {

std::string plot_path(const Config& c) {
  const std::string& plot = c.logging.plot;
  if (plot != "auto") return plot;
  const std::string& m = c.logging.metrics;
  if (m.empty()) return "";
  const size_t dot = m.rfind('.'), slash = m.rfind('/');
  return (dot != std::string::npos && (slash == std::string::npos || dot > slash) ? m.substr(0, dot) : m) + ".svg";
}

// A file that was not there is removed again, so a run that fails leaves none.
void output_try(const std::string& path, const std::string& key) {
  output_parent_create(path, key);
  std::error_code ec;
  const bool existed = fs::exists(path, ec);
  FILE* f = std::fopen(path.c_str(), "a");
  MT_CHECK(f, "cannot write the " << key << " file " << path << ": " << std::strerror(errno) << "; choose another "
                                  << key);
  std::fclose(f);
  if (!existed) fs::remove(path, ec);
}

std::string output_replaceable(const std::string& path, const std::string& key) {
  MT_CHECK(!path.empty(), key << " is empty; give the path of a file");
  MT_CHECK(path.back() != '/', key << " " << path << " names a directory; give the path of a file");
  const std::string kind = not_regular_kind(path);
  MT_CHECK(kind.empty(), key << " " << path << " is " << kind << ": the file is written beside it and renamed into "
                             << "place, which would replace it; give the path of a file");
  std::error_code ec;
  if (!fs::is_symlink(path, ec)) return path;
  fs::path target = path;  // followed link by link: a link to a file not yet there names where to write it
  for (int hops = 0; fs::is_symlink(target, ec); ++hops) {
    MT_CHECK(hops < 40, "the " << key << " link " << path << " goes round in a loop of links; give the path of a file");
    const fs::path next = fs::read_symlink(target, ec);
    MT_CHECK(!ec, "cannot read the " << key << " link " << path << ": " << ec.message());
    target = next.is_absolute() ? next : target.parent_path() / next;
  }
  return fs::weakly_canonical(fs::absolute(target)).string();
}

namespace {

const std::string& file_of(const NamedPath& p) { return p.path.empty() ? p.given : p.path; }

// "logging.metrics = m.json", "--out t.bin", "logging.plot = auto (m.svg)"
std::string shown(const NamedPath& p) {
  std::string s = p.key + (p.key.rfind("--", 0) == 0 ? " " : " = ") + p.given;
  return file_of(p) == p.given ? s : s + " (" + file_of(p) + ")";
}

// The path absolute, its symbolic links resolved as far as it exists.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  const fs::path abs = fs::absolute(p, ec);
  if (ec) return p.lexically_normal();
  const fs::path r = fs::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal() : r;
}

// One file under two names: the same inode where both exist (a hard or symbolic link, a
// path through ..), else the same resolved path (a file the run has not made yet).
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  if (fs::exists(a, ea) && fs::exists(b, eb)) {
    const bool same = fs::equivalent(a, b, ea);
    if (!ea) return same;
  }
  return resolved(a) == resolved(b);
}

bool step_name(const fs::path& p) { return checkpoint_step_name(p.filename().string()); }  // step_ and digits
bool save_tmp_name(const fs::path& p) { return p.filename().string().rfind(".tmp-step_", 0) == 0; }  // a save's, removed

// Refuses an output at or inside a checkpoint (a step_ directory, an input or a save
// directory, holding meta.json), or inside a step_ directory of a save directory that holds
// none yet: the save of that step would replace it (or fail); or inside a save's temporary
// directory (.tmp-step_...), which the start of a run removes.
void check_not_in_checkpoint(const NamedPath& out, const std::vector<NamedPath>& inputs,
                             const std::vector<NamedPath>& save_dirs) {
  std::error_code ec;
  std::vector<fs::path> read, saved;
  for (const NamedPath& in : inputs) read.push_back(resolved(file_of(in)));
  for (const NamedPath& d : save_dirs) saved.push_back(resolved(file_of(d)));
  const auto among = [](const std::vector<fs::path>& v, const fs::path& a) { return std::find(v.begin(), v.end(), a) != v.end(); };
  for (fs::path a = resolved(file_of(out)); !a.empty(); a = a.parent_path()) {
    const bool checkpoint = fs::exists(a / "meta.json", ec);
    MT_CHECK(!checkpoint || !(step_name(a) || among(read, a) || among(saved, a)),
             shown(out) << " lies inside the checkpoint " << a.string() << ": writing it would damage the "
                        << "checkpoint; choose another " << out.key << ", outside it");
    for (size_t i = 0; i < saved.size() && step_name(a); ++i)
      MT_CHECK(a.parent_path() != saved[i],
               shown(out) << " lies inside " << a.string() << ", the directory where " << shown(save_dirs[i])
                          << " saves that step's checkpoint (the save would replace it, or fail); choose another "
                          << out.key << ", outside the step_ directories");
    for (size_t i = 0; i < saved.size() && save_tmp_name(a); ++i)
      MT_CHECK(a.parent_path() != saved[i],
               shown(out) << " lies inside " << a.string() << ", a temporary directory of " << shown(save_dirs[i])
                          << "'s saves, which the run removes; choose another " << out.key << ", outside it");
    if (a == a.parent_path()) break;
  }
}

}  // namespace

void output_paths_check(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs,
                        const std::vector<NamedPath>& save_dirs) {
  const auto given = [](std::vector<NamedPath> v) {  // empty paths: none
    v.erase(std::remove_if(v.begin(), v.end(), [](const NamedPath& p) { return file_of(p).empty(); }), v.end());
    return v;
  };
  const std::vector<NamedPath> outs = given(outputs), ins = given(inputs), saves = given(save_dirs);
  for (size_t i = 0; i < outs.size(); ++i) {
    const NamedPath& out = outs[i];
    for (const NamedPath& in : ins)
      MT_CHECK(!same_file(file_of(out), file_of(in)),
               shown(out) << " is the same file as " << shown(in) << ": writing it would destroy what " << in.key
                          << " holds; choose another " << out.key);
    for (size_t j = 0; j < i; ++j)
      MT_CHECK(!same_file(file_of(out), file_of(outs[j])),
               shown(out) << " and " << shown(outs[j]) << " are the same file: one would overwrite the other; "
                          << "give " << out.key << " and " << outs[j].key << " different paths");
    check_not_in_checkpoint(out, ins, saves);
  }
}

void check_train_paths(const Config& c) {
  std::vector<NamedPath> outputs = {{"logging.metrics", c.logging.metrics, ""}, {"logging.trace", c.logging.trace, ""}};
  if (!c.logging.trace.empty()) outputs.push_back({"logging.trace", c.logging.trace, c.logging.trace + ".svg"});
  if (const std::string plot = plot_path(c); !plot.empty()) outputs.push_back({"logging.plot", c.logging.plot, plot});
  std::vector<NamedPath> inputs = {{"data.path", c.data.path, ""}, {"data.val_path", c.data.val_path, ""}};
  std::error_code ec;
  if (c.data.tokenizer != "byte") inputs.push_back({"data.tokenizer", c.data.tokenizer, ""});
  if (fs::is_regular_file(c.logging.hardware, ec)) inputs.push_back({"logging.hardware", c.logging.hardware, ""});
  if (!c.model.init_from.empty()) {  // a directory stands for its model.safetensors
    const bool dir = fs::is_directory(c.model.init_from, ec);
    inputs.push_back({"model.init_from", c.model.init_from, dir ? c.model.init_from + "/model.safetensors" : ""});
  }
  if (c.parallel.pp_schedule.rfind("file:", 0) == 0)
    inputs.push_back({"parallel.pp_schedule", c.parallel.pp_schedule, c.parallel.pp_schedule.substr(5)});
  output_paths_check(outputs, inputs, {{"checkpoint.dir", c.checkpoint.dir, ""}});
}

namespace {

void check_outputs(const Config& c) {
  check_train_paths(c);  // before any directory is made or file tried
  if (!c.logging.metrics.empty()) output_try(c.logging.metrics, "logging.metrics");
  if (!c.logging.trace.empty()) {
    output_try(c.logging.trace, "logging.trace");
    output_try(c.logging.trace + ".svg", "logging.trace");  // its picture, written beside it
  }
  if (const std::string plot = plot_path(c); !plot.empty()) output_try(plot, "logging.plot");
  if (!c.logging.hardware.empty()) {
    try {
      plan::hardware_get(c.logging.hardware);
    } catch (const Error& e) {
      MT_FAIL("logging.hardware = " << c.logging.hardware << ": " << e.what()
                                    << " (or leave logging.hardware empty for no step-time prediction)");
    }
  }
  // `sample` reads the tokenizer from the checkpoint's configuration: one that cannot load,
  // or a SentencePiece model with more pieces than the model has ids, would be found only
  // then. (The byte tokenizer's size is not compared with model.vocab_size: its 257 pieces
  // name more ids than a token file of a small vocabulary uses.)
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = tokenizer_make(c.data.tokenizer);
  } catch (const Error& e) {
    MT_FAIL("data.tokenizer = " << c.data.tokenizer << ": " << e.what());
  }
  MT_CHECK(c.data.tokenizer == "byte" || tok->vocab_size() <= c.model.vocab_size,
           "data.tokenizer = " << c.data.tokenizer << " has " << tok->vocab_size() << " tokens but model.vocab_size = "
                               << c.model.vocab_size << ": the model has no ids for the rest. Set model.vocab_size="
                               << tok->vocab_size() << " (or more), or set data.tokenizer to the model that made "
                               << "data.path");
}

// The first number in a file ("max" and a missing file: none).
double number_in(const std::string& path) {
  std::ifstream f(path);
  double x = 0;
  return f >> x ? x : 0;
}

}  // namespace

MachineMemory machine_memory(const std::string& root) {
  MachineMemory m;
  std::ifstream info(root + "/proc/meminfo");
  for (std::string key; info >> key;) {
    double kb = 0;
    if (key == "MemTotal:" && info >> kb) {
      m.bytes = kb * 1024;
      break;
    }
  }
  // A container's or a job's memory cgroup: version 2 (the process's own group, as
  // /proc/self/cgroup names it, or the root of a namespaced view), or version 1.
  std::vector<std::string> limits = {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
  std::ifstream groups(root + "/proc/self/cgroup");
  for (std::string line; std::getline(groups, line);) {
    const size_t v1 = line.find(":memory:/");
    if (line.rfind("0::/", 0) == 0 && line.size() > 4) limits.push_back("/sys/fs/cgroup" + line.substr(3) + "/memory.max");
    if (v1 != std::string::npos && line.size() > v1 + 9)
      limits.push_back("/sys/fs/cgroup/memory" + line.substr(v1 + 8) + "/memory.limit_in_bytes");
  }
  for (const std::string& path : limits)
    if (const double limit = number_in(root + path); limit > 0 && (m.bytes <= 0 || limit < m.bytes)) {
      m.bytes = limit;
      m.source = root + path;
    }
  return m;
}

namespace {

// The ranks of the job on this machine, as the launcher says (1 where none does).
int ranks_here() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
    if (const char* n = std::getenv(v); n && std::atoi(n) > 0) return std::atoi(n);
  return 1;
}

// A CPU run whose ranks on this machine need more than its memory, by the planner's count of
// what the busiest rank allocates (exact per tag; BLAS, MPI and the heap come on top), is
// refused before it allocates for minutes and is killed. A GPU's memory is its allocator's.
void check_memory(const Config& c) {
  if (c.training.device != "cpu" || c.parallel.pp_schedule.rfind("file:", 0) == 0) return;
  plan::Memory m;
  try {
    const plan::Precisions prec = plan::Precisions::trained(c.model.precision, c.model.grad_working());
    m = plan::memory_per_rank(c.model, run_layout(c), prec, c.optim.name, plan::knobs(c));
  } catch (const std::exception&) {
    return;  // a layout the engine refuses: its own check says so, with its own words
  }
  const MachineMemory machine = machine_memory();
  const double total = machine.bytes, here = ranks_here(), gib = 1 << 30;
  if (total <= 0 || m.peak * here <= total) return;
  char need[480];
  std::snprintf(need, sizeof need, "the run needs %.1f GiB per rank (parameters %.1f, gradients %.1f, optimizer %.1f, "
                "activations %.1f, buffers %.1f, staging %.1f) x %.0f rank%s on this machine, more than its %.1f GiB%s%s",
                m.peak / gib, m.params / gib, m.grads / gib, m.optim / gib, m.activations / gib, m.comm / gib,
                m.other / gib, here, here > 1 ? "s" : "", total / gib,
                machine.source.empty() ? "" : " (the memory limit in ", machine.source.empty() ? "" : (machine.source + ")").c_str());
  MT_FAIL(need << "; use a smaller model (model.n_layer, model.d_model, model.vocab_size) or training.micro_batch, "
               << "training.recompute=true, parallel.zero=3, or more machines (meshtrain plan helps choose)");
}

}  // namespace

std::vector<std::string> settings_without_effect(const Config& c) {
  std::vector<std::string> notes;
  const ParallelConfig& p = c.parallel;
  if (p.grad_compression != "none" && p.dp * p.cp == 1)
    notes.push_back("parallel.grad_compression = " + p.grad_compression + " does nothing here: there is one " +
                    "data-parallel rank, no gradient is reduced");
  const OptimConfig unset;
  if (c.model.precision != "fp16" &&
      (c.optim.loss_scale != unset.loss_scale || c.optim.loss_scale_window != unset.loss_scale_window))
    notes.push_back("optim.loss_scale and optim.loss_scale_window apply to training.precision = fp16 only (this run: " +
                    c.model.precision + ")");
  std::error_code ec;
  if (!c.data.val_path.empty() && !c.data.path.empty() && fs::equivalent(c.data.val_path, c.data.path, ec))
    notes.push_back("data.val_path = " + c.data.val_path + " is data.path's file: validation reads the tokens the run "
                    "trains on and says nothing of unseen text; use data.val_fraction to hold out its tail, or another "
                    "file");
  const CheckpointConfig& ck = c.checkpoint;  // the checkpoint keys do nothing without a directory
  const CheckpointConfig no_ck;
  if (ck.dir.empty() && ck.every != no_ck.every)
    notes.push_back("checkpoint.every = " + std::to_string(ck.every) + " without checkpoint.dir: nothing is saved; "
                    "set checkpoint.dir=DIR");
  if (ck.dir.empty() && ck.keep != no_ck.keep)
    notes.push_back("checkpoint.keep = " + std::to_string(ck.keep) + " without checkpoint.dir: nothing is saved or "
                    "kept; set checkpoint.dir=DIR");
  // The first N blocks of each model chunk recompute: N past the most a chunk can hold
  // (n_layer less a block for each other chunk) is every block, as N = 0 says.
  const int chunks = p.pp * std::max(1, p.pp_chunks), most = c.model.n_layer - (chunks - 1);
  if (c.training.recompute && c.training.recompute_blocks > most && most >= 1)
    notes.push_back("training.recompute_blocks = " + std::to_string(c.training.recompute_blocks) + " is more than " +
                    (chunks == 1 ? "the " + std::to_string(most) + " blocks of the model (model.n_layer)"
                                 : "the " + std::to_string(most) + " blocks any of its " + std::to_string(chunks) +
                                       " chunks holds (model.n_layer = " + std::to_string(c.model.n_layer) + ")") +
                    ": every block recomputes, as with recompute_blocks = 0");
  if (c.optim.warmup_steps > c.training.steps && c.training.steps > 0)
    notes.push_back("optim.warmup_steps = " + std::to_string(c.optim.warmup_steps) + " is more than " +
                    "training.steps = " + std::to_string(c.training.steps) + ": the learning rate never reaches " +
                    "its peak");
  return notes;
}

void check_same_config(const Config& c, Communicator& world) {
  if (world.size() == 1) return;
  const nlohmann::json mine = config_to_json(c);
  const std::vector<std::string> all = allgather_strings(world, mine.dump());
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const nlohmann::json lead = nlohmann::json::parse(all[0]), other = nlohmann::json::parse(all[r]);
    std::string keys;
    for (const auto& [section, values] : lead.items())
      for (const auto& [key, value] : values.items()) {
        const nlohmann::json theirs = other.value(section, nlohmann::json::object()).value(key, nlohmann::json());
        if (theirs != value)
          keys += (keys.empty() ? "" : ", ") + section + "." + key + " = " + theirs.dump() + " (rank 0: " +
                  value.dump() + ")";
      }
    throw AgreedError("rank " + std::to_string(r) + " runs another configuration than rank 0: " + keys +
                      "; start every rank with the same config file and options");
  }
}

void outputs_prepare(const Config& c, Communicator& world) {
  agreed(world, [&] {  // rank 0 alone tries; every rank then stops with its message
    if (world.rank() != 0) return;
    check_outputs(c);
    check_memory(c);
  });
}

}  // namespace mt
