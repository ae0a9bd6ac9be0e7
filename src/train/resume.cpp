#include "train/resume.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include "core/error.h"
#include "core/message.h"
#include "train/checkpoint.h"
#include "train/checkpoint_dir.h"

namespace mt {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Keys checkpoint.allow_change may name: a new data file, learning rate, seed, norm epsilon
// or RoPE theta still continues the saved model and optimizer state. The model's shape, the
// optimizer's kind (its state tensors) and the global batch (the data position is step x
// global_batch) may not.
bool may_change(const std::string& key) {
  return resume_key_must_match(key) && !checkpoint_model_key_fixed(key) && key != "optim.name" &&
         key != "training.global_batch";
}

std::vector<std::string> allowed_changes(const std::string& list) {
  std::vector<std::string> keys;
  const std::vector<std::string> known = config_keys();
  size_t at = 0;
  while (at <= list.size()) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    std::string k = list.substr(at, comma - at);
    k.erase(0, k.find_first_not_of(' '));
    k.erase(k.find_last_not_of(' ') + 1);
    at = comma + 1;
    if (k.empty()) continue;
    MT_CHECK(std::find(known.begin(), known.end(), k) != known.end(),
             "checkpoint.allow_change names " << k << ", which is not a configuration key");
    MT_CHECK(may_change(k), "checkpoint.allow_change cannot take " << k << ": "
                                << (resume_key_must_match(k) ? "a resumed run cannot change it (the model's shape, the "
                                                               "optimizer's state tensors and the data position depend on it)"
                                                             : "it is not a key a resumed run must keep, so it may change anyway"));
    keys.push_back(k);
  }
  return keys;
}

// "8 ranks = dp 2 x tp 2 x pp 2 (1f1b), ZeRO 1, micro-batch 1". Context parallelism is read
// through the keys (parallel.cp, where the configuration has it) and named when it splits.
std::string layout_text(const Config& c, int world_size) {
  const nlohmann::json p = config_to_json(c)["parallel"];
  std::string s = std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks") + " = dp " + p["dp"].dump();
  if (p.value("cp", 1) > 1) s += " x cp " + p["cp"].dump();
  s += " x tp " + p["tp"].dump() + " x pp " + p["pp"].dump();
  if (c.parallel.pp > 1)
    s += " (" + c.parallel.pp_schedule +
         (c.parallel.pp_chunks > 1 ? ", " + std::to_string(c.parallel.pp_chunks) + " chunks per rank" : "") + ")";
  if (c.parallel.zero > 0) s += ", ZeRO " + std::to_string(c.parallel.zero);
  return s + ", micro-batch " + std::to_string(c.training.micro_batch);
}

// The keys that must match and differ, as "key = saved (this run: value)", and any key
// changed with checkpoint.allow_change, as a note.
std::vector<std::string> compare_keys(const Config& saved, const Config& now, std::vector<std::string>& notes) {
  const std::vector<std::string> allowed = allowed_changes(now.checkpoint.allow_change);
  nlohmann::json a = config_to_json(saved), b = config_to_json(now);
  // data.val_fraction counts where it holds out the tail of data.path (no data.val_path).
  auto held_out = [](const Config& c) { return c.data.val_path.empty() ? c.data.val_fraction : 0.0; };
  a["data"]["val_fraction"] = held_out(saved);
  b["data"]["val_fraction"] = held_out(now);
  // The files, not the words typed (a relative path in an older checkpoint is read from here).
  for (const char* key : {"path", "val_path"}) {
    a["data"][key] = path_absolute(a["data"][key].get<std::string>());
    b["data"][key] = path_absolute(b["data"][key].get<std::string>());
  }
  // fp16's loss-scaling keys do nothing in the other precisions: they must match only where
  // both runs scale the loss (a change of precision is noted by the caller).
  const bool both_scale = saved.model.precision == "fp16" && now.model.precision == "fp16";
  std::vector<std::string> differ;
  for (const std::string& key : config_keys()) {
    if (!resume_key_must_match(key)) continue;
    if (!both_scale && (key == "optim.loss_scale" || key == "optim.loss_scale_window")) continue;
    const std::string sec = key.substr(0, key.find('.')), name = key.substr(key.find('.') + 1);
    const nlohmann::json &was = a[sec][name], &is = b[sec][name];
    if (was == is) continue;
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end())
      notes.push_back(key + " = " + is.dump() + " instead of the checkpoint's " + was.dump() +
                      " (checkpoint.allow_change)");
    else
      differ.push_back(key + " = " + was.dump() + " (this run: " + is.dump() + ")");
  }
  return differ;
}

// The micro-batch for this layout (see resume.h): cfg resolved with it, and a note when it
// is not the one asked for.
void fit_micro_batch(Config& cfg, int world_size, int64_t saved_micro, std::vector<std::string>& notes) {
  const int64_t asked = cfg.training.micro_batch;  // 0: the layout's default
  Config first = cfg;
  std::optional<Error> error;
  try {
    first.resolve_layout(world_size);
  } catch (const Error& e) {
    error = e;
  }
  const int64_t cap = asked > 0 ? asked : saved_micro;
  if (!error && first.training.micro_batch <= cap) {
    cfg = first;
    return;
  }
  for (int64_t b = cap; b >= 1; --b) {
    Config t = cfg;
    t.training.micro_batch = b;
    try {
      t.resolve_layout(world_size);
    } catch (const Error&) {
      continue;
    }
    const int64_t per_rank = t.training.global_batch / t.parallel.dp;
    if (asked > 0)
      notes.push_back("training.micro_batch = " + std::to_string(asked) + " does not fit this layout (global batch " +
                      std::to_string(t.training.global_batch) + " over dp " + std::to_string(t.parallel.dp) + ": " +
                      std::to_string(per_rank) + " per rank" + (t.parallel.pp > 1 ? ", through a pipeline" : "") +
                      "); using " + std::to_string(b));
    else
      notes.push_back("training.micro_batch = " + std::to_string(b) + ": this layout's default (" +
                      std::to_string(first.training.micro_batch) + ") is larger than the checkpoint's " +
                      std::to_string(saved_micro) + ", the most the saved run held in one forward");
    cfg = t;
    return;
  }
  if (error) {  // no micro-batch fits: the layout itself does not (world size, global batch)
    // The global batch is the checkpoint's (the data position is step x global_batch): where
    // the ranks' dp does not divide it, what may change is the layout, and the message says
    // which data-parallel sizes do.
    const int64_t G = cfg.training.global_batch;
    const int64_t model_ranks = int64_t{cfg.parallel.tp} * cfg.parallel.pp * cfg.parallel.cp;
    const int64_t dp = cfg.parallel.dp > 0                                     ? cfg.parallel.dp
                       : model_ranks > 0 && world_size % model_ranks == 0 ? world_size / model_ranks
                                                                          : 0;
    if (dp == 0 || G % dp == 0) throw *error;
    const std::string dps = values_text(divisors(G), 8);
    throw Error(std::string(error->what()) + ". A resumed run keeps the checkpoint's training.global_batch = " +
                std::to_string(G) + ": choose the ranks (and parallel.tp, pp, cp) so that dp divides it (dp " + dps +
                ")");
  }
  cfg = first;
}

}  // namespace

bool resume_key_must_match(const std::string& key) {
  if (key == "model.init_from") return false;  // read only at step 0
  // Validation data and the tokenizer (for sample) do not change what is trained.
  if (key == "data.val_path" || key == "data.tokenizer") return false;
  return starts_with(key, "model.") || starts_with(key, "data.") || starts_with(key, "optim.") ||
         key == "training.global_batch" || key == "training.seed";
}

// A SentencePiece model by its absolute path; "byte" (and "", which the start-up checks
// refuse) as they are.
std::string tokenizer_absolute(const std::string& tokenizer) {
  return tokenizer == "byte" ? tokenizer : path_absolute(tokenizer);
}

std::string path_absolute(const std::string& path) {
  return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
}

std::vector<std::string> resume_resolve(Config& cfg, int world_size) {
  allowed_changes(cfg.checkpoint.allow_change);  // a typo is an error on any run
  checkpoint_dir_check(cfg.checkpoint);  // not one step directory, no damaged ones
  const std::string dir = cfg.checkpoint.resume ? checkpoint_latest(cfg.checkpoint.dir) : "";
  if (dir.empty()) {
    cfg.resolve_layout(world_size);
    return {};
  }
  // Damage found before any work, with what to do as training says it: meta.json, and each
  // file it records there at its size (their CRC-32s are checked as they load).
  const nlohmann::json meta = checkpoint_meta(dir, /*resuming=*/true);
  const Config saved = checkpoint_saved_config(dir, meta, /*resuming=*/true);
  const std::string missing = checkpoint_files_problem(dir, meta);
  MT_CHECK(missing.empty(), missing << "; " << checkpoint_damage_advice(dir, /*resuming=*/true));
  // A checkpoint past training.steps is refused (the run cannot go back to it); one at it
  // is a complete run, said in a note, and trains no step (as a rerun of a finished job).
  const int64_t step = meta.at("step").get<int64_t>();
  MT_CHECK(step <= cfg.training.steps,
           "checkpoint " << dir << " is at step " << step << ", past training.steps = " << cfg.training.steps
                         << ": a resumed run continues it and cannot go back. Set training.steps above " << step
                         << " to train further (meshtrain export and sample read it as it is)");
  std::vector<std::string> notes;
  const std::vector<std::string> differ = compare_keys(saved, cfg, notes);
  if (!differ.empty()) {
    std::string list;
    bool model = false;
    for (const std::string& d : differ) {
      list += (list.empty() ? "" : ", ") + d;
      model = model || checkpoint_model_key_fixed(d.substr(0, d.find(' ')));
    }
    if (model)
      MT_FAIL("checkpoint " << dir << " was saved with " << list << "; the model's shape cannot change when resuming: "
                            << "use the checkpoint's model settings or a new checkpoint.dir");
    // checkpoint.allow_change is offered only where it can take every key that differs
    const bool allowable = std::all_of(differ.begin(), differ.end(),
                                       [](const std::string& d) { return may_change(d.substr(0, d.find(' '))); });
    MT_FAIL("checkpoint " << dir << " was saved with " << list << ". A resumed run continues the saved one, so its "
                          << "model, data and optimizer keys, training.global_batch and training.seed must be the "
                          << "checkpoint's: drop or correct these options (meshtrain checkpoint info " << dir
                          << " lists the saved values), "
                          << (allowable ? "set checkpoint.allow_change to the keys to change them on purpose, " : "")
                          << "or use a new checkpoint.dir");
  }
  fit_micro_batch(cfg, world_size, saved.training.micro_batch, notes);
  // The precision may change (checkpoints hold fp32 masters and optimizer state): said, with
  // what does not carry over.
  if (cfg.model.precision != saved.model.precision || cfg.model.grad_dtype != saved.model.grad_dtype) {
    std::string what = "training.precision = " + cfg.model.precision + ", grad_dtype = " + cfg.model.grad_dtype +
                       " instead of the checkpoint's " + saved.model.precision + ", " + saved.model.grad_dtype +
                       ": the fp32 parameters and optimizer state carry over";
    if (saved.model.precision == "fp16" && cfg.model.precision != "fp16") what += "; fp16's loss scale is dropped";
    if (cfg.model.precision == "fp16" && saved.model.precision != "fp16")
      what += "; the loss scale starts at optim.loss_scale";
    notes.push_back(what);
  }
  // The tokenizer may change (a moved file), but one left out of the command line is the
  // default byte, which then goes into this run's checkpoints: said, with what keeps it.
  // (A relative path in an older checkpoint is read from this directory.)
  const std::string saved_tokenizer = tokenizer_absolute(saved.data.tokenizer);
  if (tokenizer_absolute(cfg.data.tokenizer) != saved_tokenizer)
    notes.push_back("data.tokenizer = " + cfg.data.tokenizer + " instead of the checkpoint's " + saved_tokenizer +
                    ": this run's checkpoints record " + cfg.data.tokenizer + ", which sample decodes with; pass " +
                    "--data.tokenizer=" + saved_tokenizer + " to keep the checkpoint's");

  const int saved_world = meta.value("world_size", 1);
  const std::string was = layout_text(saved, saved_world), is = layout_text(cfg, world_size);
  if (was != is) {
    const int64_t G = cfg.training.global_batch, M = cfg.training.micro_batch;
    const int64_t n = G / (int64_t{cfg.parallel.dp} * M);
    notes.insert(notes.begin(), "elastic restart: saved at " + was + "; resumed at " + is + ". The global batch stays " +
                                    std::to_string(G) + " sequences (now " + std::to_string(n) + " micro-batch" +
                                    (n == 1 ? "" : "es") + " of " + std::to_string(M) + " per rank), and step " +
                                    std::to_string(step) + " reads from sequence " + std::to_string(step * G) +
                                    " on, as it would have");
  }
  if (step == cfg.training.steps) {  // the schedule's note would say nothing true: no step runs
    notes.push_back("checkpoint " + dir + " is at step " + std::to_string(step) + " = training.steps: the run is " +
                    "complete and trains no step; set training.steps above " + std::to_string(step) +
                    " to train further");
    return notes;
  }
  const bool decays = cfg.optim.schedule == "cosine" || cfg.optim.schedule == "linear";
  if (decays && cfg.training.steps != saved.training.steps)
    notes.push_back("training.steps = " + std::to_string(cfg.training.steps) + " (the checkpoint's run had " +
                    std::to_string(saved.training.steps) + "): the " + cfg.optim.schedule +
                    " learning-rate schedule now runs to step " + std::to_string(cfg.training.steps));
  return notes;
}

}  // namespace mt
