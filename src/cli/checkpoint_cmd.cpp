// meshtrain checkpoint info DIR [--json]: what a checkpoint holds and whether it is intact,
// without loading it. DIR is a step directory or a run's checkpoint.dir (its newest).
// Prints the step, the layout and configuration it was written with, the model, every
// unit and parameter (whole, as it loads at any layout), the elements and bytes per saved
// tensor kind, the data position, and each file checked against meta.json (size and
// CRC-32; meta.json's own CRC-32). Exit status 1, with a message naming the file and what to
// do, when a file is corrupt or missing (a step directory without meta.json included) or the
// directory holds no checkpoint.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"              // MT_CHECK
#include "data/token_file.h"         // kTokenFileMagic
#include "train/checkpoint.h"        // checkpoint_inspect, _list, _damaged, _saved_config, _damage_advice
#include "train/config.h"            // config_to_json

namespace fs = std::filesystem;

namespace mt {

namespace {

constexpr int64_t kBytesPerElement = 4;  // checkpoints hold float32

std::string bytes_text(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, unit[u]);
  return buf;
}

// The training tokens of a token file as the trainer splits them (the tail that
// data.val_fraction holds out is not trained on), from its header alone; -1 if unreadable.
int64_t training_tokens(const Config& c) {
  std::ifstream f(c.data.path, std::ios::binary);
  int32_t head[3] = {0, 0, 0};
  if (!f.read(reinterpret_cast<char*>(head), sizeof head) || head[0] != kTokenFileMagic) return -1;
  int64_t n = head[2];
  const int64_t n_val = static_cast<int64_t>(n * c.data.val_fraction);
  if (c.data.val_path.empty() && c.data.val_fraction > 0 && n_val >= 2 && n - n_val >= 2) n -= n_val;
  return n;
}

// Which sequences the next step reads: the sampler is layout-independent, so the position
// is the step times the global batch (data/loader.h).
nlohmann::json data_position(const Config& c, int64_t step) {
  const int64_t read = step * c.training.global_batch;
  nlohmann::json j = {{"path", c.data.path.empty() ? "built-in tasks" : c.data.path},
                      {"shuffle", c.data.shuffle},
                      {"seed", c.training.seed},
                      {"sequences_read", read},
                      {"tokens_read", read * c.model.seq_len}};
  if (c.data.path.empty()) return j;  // generated from the seed: no file to count
  const int64_t n = training_tokens(c);
  if (n < 0) return j;  // not readable from here
  const int64_t per_epoch = std::max<int64_t>(1, n / c.model.seq_len);
  j["sequences_per_epoch"] = per_epoch;
  j["epoch"] = read / per_epoch;
  return j;
}

// The whole report as one JSON object; its text form is printed from it.
nlohmann::json info_json(const CheckpointInfo& info, const std::string& root) {
  nlohmann::json j;
  j["dir"] = info.dir;
  nlohmann::json list = nlohmann::json::array();
  for (const std::string& d : checkpoint_list(root)) list.push_back(fs::path(d).filename().string());
  j["checkpoints"] = list;
  nlohmann::json files = nlohmann::json::array();
  for (const CheckpointFile& f : info.files) {
    nlohmann::json e = {{"name", f.name}, {"bytes", f.bytes}, {"status", f.problem.empty() ? "ok" : "damaged"}};
    if (f.rank >= 0) e["rank"] = f.rank;
    if (!f.problem.empty()) e["problem"] = f.problem;
    files.push_back(e);
  }
  j["files"] = files;
  j["coverage_problems"] = info.coverage_problems;
  j["intact"] = info.intact();
  if (info.meta.is_null()) return j;

  const nlohmann::json& meta = info.meta;
  const Config c = checkpoint_saved_config(info.dir, meta);
  const nlohmann::json cj = config_to_json(c);
  const int64_t step = meta.at("step").get<int64_t>();
  j["step"] = step;
  j["optimizer"] = meta.at("optimizer");
  if (meta.contains("rank_state")) j["rank_state"] = meta["rank_state"].at("layout");  // gradient compression's
  nlohmann::json layout = cj["parallel"];  // every parallel key the checkpoint's configuration has
  layout.erase("test_fault");
  layout["world_size"] = meta.value("world_size", 1);
  j["layout"] = layout;
  const int64_t micro_per_step = c.training.global_batch / (int64_t{c.parallel.dp} * c.training.micro_batch);
  j["batch"] = {{"global_batch", c.training.global_batch}, {"micro_batch", c.training.micro_batch},
                {"micro_batches_per_step", micro_per_step}, {"seq_len", c.model.seq_len}};
  j["precision"] = {{"precision", c.model.precision}, {"grad_dtype", c.model.grad_dtype}, {"device", c.training.device}};
  j["optim"] = cj["optim"];  // the settings a resume must keep (or change with checkpoint.allow_change)
  nlohmann::json model = cj["model"];
  nlohmann::json units = nlohmann::json::array();
  int64_t parameters = 0;
  for (const auto& u : meta.at("units")) {
    nlohmann::json params = nlohmann::json::array();
    for (const auto& p : u.at("params")) {
      int64_t n = 1;
      for (const auto& d : p.at("shape")) n *= d.get<int64_t>();
      params.push_back({{"name", p.at("name")}, {"shape", p.at("shape")}, {"elements", n}, {"bytes", n * kBytesPerElement}});
    }
    const int64_t n = u.at("numel").get<int64_t>();
    parameters += n;
    units.push_back({{"name", u.at("name")}, {"elements", n}, {"bytes", n * kBytesPerElement}, {"params", params}});
  }
  model["parameters"] = parameters;
  model["kv_heads"] = c.model.kv_heads();  // n_kv_head and d_ff resolved (0 in the keys: the family's default)
  model["ff_dim"] = c.model.ff_dim();
  j["model"] = model;
  j["units"] = units;
  nlohmann::json totals, state = {{"elements", 0}, {"bytes", 0}, {"tensors", nlohmann::json::object()}};
  for (const auto& [kind, n] : info.elements) {
    if (kind == "params") {
      totals["params"] = {{"elements", n}, {"bytes", n * kBytesPerElement}};
      continue;
    }
    state["tensors"][kind] = n;
    state["elements"] = state["elements"].get<int64_t>() + n;
    state["bytes"] = state["bytes"].get<int64_t>() + n * kBytesPerElement;
  }
  totals["optimizer_state"] = state;
  j["totals"] = totals;
  j["data"] = data_position(c, step);
  return j;
}

// "key=value key=value ...": an object's fields, but `skip`.
std::string key_values(const nlohmann::json& o, const std::string& skip = "") {
  std::string text;
  for (auto it = o.begin(); it != o.end(); ++it)
    if (it.key() != skip) text += (text.empty() ? "" : " ") + it.key() + "=" + it->dump();
  return text;
}

void print_text(const nlohmann::json& j) {
  auto line = [](const char* label, const std::string& text) { std::printf("%-11s %s\n", label, text.c_str()); };
  std::string others;
  for (const auto& d : j["checkpoints"]) others += (others.empty() ? "" : ", ") + d.get<std::string>();
  line("checkpoint", j["dir"].get<std::string>() + (others.empty() ? "" : "  (in its directory: " + others + ")"));
  if (j.contains("step")) {
    const auto& o = j["optimizer"];
    line("step", std::to_string(j["step"].get<int64_t>()) + "; optimizer " + o.value("name", "?") + ", " +
                     std::to_string(o.value("steps_taken", int64_t{0})) + " steps taken" +
                     (o.contains("loss_scale") ? "; fp16 loss scale " + o["loss_scale"].dump() : ""));
    const auto& L = j["layout"];
    const int world = L["world_size"].get<int>();
    std::string lay = std::to_string(world) + (world == 1 ? " rank" : " ranks") + ": dp " + L["dp"].dump();
    if (L.value("cp", 1) > 1) lay += " x cp " + L["cp"].dump();  // context parallelism, where the configuration has it
    lay += " x tp " + L["tp"].dump() + " x pp " + L["pp"].dump();
    if (L["pp"].get<int>() > 1) lay += " (" + L["pp_schedule"].get<std::string>() + ", " + L["pp_chunks"].dump() + " chunks per rank)";
    lay += ", ZeRO " + L["zero"].dump();
    if (!L["sharding"].get<std::string>().empty()) lay += " (" + L["sharding"].get<std::string>() + ")";
    line("layout", lay);
    line("parallel", key_values(L, "world_size"));
    const auto& b = j["batch"];
    line("batch", "global " + b["global_batch"].dump() + " sequences x " + b["seq_len"].dump() + " tokens; micro-batch " +
                      b["micro_batch"].dump() + " per rank, " + b["micro_batches_per_step"].dump() +
                      (b["micro_batches_per_step"] == 1 ? " micro-batch" : " micro-batches") + " per rank per step");
    const auto& pr = j["precision"];
    line("precision", pr["precision"].get<std::string>() + ", gradients " + pr["grad_dtype"].get<std::string>() +
                          ", trained on " + pr["device"].get<std::string>());
    line("optim", key_values(j["optim"]));
    const auto& m = j["model"];
    line("model", m["family"].get<std::string>() + ": " + m["n_layer"].dump() + " layers, d_model " + m["d_model"].dump() +
                      ", " + m["n_head"].dump() + " heads (" + m["kv_heads"].dump() + " key/value), d_ff " +
                      m["ff_dim"].dump() + ", vocabulary " + m["vocab_size"].dump() + ", seq_len " + m["seq_len"].dump() +
                      (m["tie_embeddings"].get<bool>() ? ", tied embeddings" : ", untied head") + "; " +
                      m["parameters"].dump() + " parameters");
    const auto& d = j["data"];
    std::string pos = d["path"].get<std::string>() + (d["shuffle"].get<bool>() ? " (shuffled, seed " : " (in order, seed ") +
                      d["seed"].dump() + "): " + d["sequences_read"].dump() + " sequences read (step x global batch), " +
                      d["tokens_read"].dump() + " tokens";
    if (d.contains("epoch")) pos += "; epoch " + d["epoch"].dump() + " of " + d["sequences_per_epoch"].dump() + " sequences";
    line("data", pos);
    std::printf("units       whole, as they load at any layout\n");
    for (const auto& u : j["units"]) {
      std::printf("  %-26s %12lld elements %11s\n", u["name"].get<std::string>().c_str(),
                  static_cast<long long>(u["elements"].get<int64_t>()), bytes_text(u["bytes"].get<double>()).c_str());
      for (const auto& p : u["params"])
        std::printf("    %-40s %-14s %10lld %11s\n", p["name"].get<std::string>().c_str(), p["shape"].dump().c_str(),
                    static_cast<long long>(p["elements"].get<int64_t>()), bytes_text(p["bytes"].get<double>()).c_str());
    }
    const auto& t = j["totals"];
    if (t.contains("params"))
      std::printf("totals      params %lld elements, %s\n", static_cast<long long>(t["params"]["elements"].get<int64_t>()),
                  bytes_text(t["params"]["bytes"].get<double>()).c_str());
    std::string kinds;
    for (auto it = t["optimizer_state"]["tensors"].begin(); it != t["optimizer_state"]["tensors"].end(); ++it)
      kinds += (kinds.empty() ? "" : ", ") + it.key() + " " + it->dump();
    if (!kinds.empty()) kinds = " (" + kinds + ")";
    std::printf("            optimizer state %lld elements, %s%s\n",
                static_cast<long long>(t["optimizer_state"]["elements"].get<int64_t>()),
                bytes_text(t["optimizer_state"]["bytes"].get<double>()).c_str(), kinds.c_str());
  }
  if (j.contains("rank_state"))
    std::printf("rank state  gradient compression residuals, one file per rank: %s\n",
                j["rank_state"].get<std::string>().c_str());
  std::printf("files       checked against meta.json (size, CRC-32)\n");
  for (const auto& f : j["files"]) {
    const std::string rank = f.contains("rank") ? "rank " + f["rank"].dump() : "";
    std::printf("  %-30s %-9s %11s  %s\n", f["name"].get<std::string>().c_str(), rank.c_str(),
                bytes_text(f["bytes"].get<double>()).c_str(),
                f["status"] == "ok" ? "OK" : f["problem"].get<std::string>().c_str());
  }
  for (const auto& p : j["coverage_problems"]) std::printf("  incomplete: %s\n", p.get<std::string>().c_str());
  for (const auto& d : j.value("damaged_checkpoints", nlohmann::json::array()))
    std::printf("damaged     %s (no meta.json)\n", d.get<std::string>().c_str());
}

// What to do about a damaged checkpoint: resuming falls back to the one before it once
// this one is deleted (a misnamed one: its own advice).
std::string damage_message(const CheckpointInfo& info) {
  std::string what;
  for (const CheckpointFile& f : info.files)
    if (!f.problem.empty()) what += (what.empty() ? "" : "; ") + info.dir + "/" + f.name + " is " + f.problem;
  for (const std::string& p : info.coverage_problems) what += (what.empty() ? "" : "; ") + p;
  if (!info.advice.empty()) return "checkpoint " + info.dir + " is refused: " + what + ": " + info.advice;
  return "checkpoint " + info.dir + " is damaged: " + what + ". Training cannot resume from it; " +
         checkpoint_damage_advice(info.dir, /*resuming=*/true);
}

}  // namespace

void checkpoint_options_add(CLI::App* cmd, CheckpointOptions* o) {
  cmd->require_subcommand(1);
  auto* info = cmd->add_subcommand("info", "what a checkpoint holds; checks every file's CRC-32");
  info->add_option("DIR", o->dir, "a checkpoint directory, or a run's checkpoint.dir (its newest)")->required();
  info->add_flag("--json", o->json, "print one JSON object");
}

int cmd_checkpoint(const CheckpointOptions& o) {
  std::string arg = fs::path(o.dir).lexically_normal().string();
  if (arg.size() > 1 && arg.back() == '/') arg.pop_back();
  MT_CHECK(fs::exists(arg), "checkpoint info: " << arg << " does not exist; pass a checkpoint directory (step_N) or a "
                                                << "run's checkpoint.dir");
  // The newest complete checkpoint (checkpoint_latest refuses where a damaged one is newer;
  // here that one is reported, below).
  const std::vector<std::string> complete = fs::exists(arg + "/meta.json") ? std::vector<std::string>{arg}
                                                                            : checkpoint_list(arg);
  std::string dir = complete.empty() ? "" : complete.back();
  // A step directory without meta.json is a damaged checkpoint, reported as one (its
  // meta.json missing) rather than passed over for an older one: given directly, or the
  // newest under a run's checkpoint.dir. Older damaged ones are named after the report.
  const bool step_dir = checkpoint_step_name(fs::path(arg).lexically_normal().filename().string());
  std::vector<std::string> damaged = dir == arg || step_dir ? std::vector<std::string>{} : checkpoint_damaged(arg);
  if (dir.empty() && step_dir) dir = arg;
  if (!damaged.empty() && (dir.empty() || fs::path(damaged.back()).filename() > fs::path(dir).filename())) {
    dir = damaged.back();
    damaged.pop_back();
  }
  MT_CHECK(!dir.empty(), "checkpoint info: " << arg << " holds no checkpoint (no step_* directory with a meta.json); "
                                             << "pass a checkpoint directory or a run's checkpoint.dir");
  // A step directory given directly: its siblings are the run's other checkpoints.
  const std::string root = dir == arg ? fs::path(dir).parent_path().string() : arg;
  const CheckpointInfo info = checkpoint_inspect(dir);
  nlohmann::json j = info_json(info, root);
  j["damaged_checkpoints"] = nlohmann::json::array();
  for (const std::string& d : damaged) j["damaged_checkpoints"].push_back(fs::path(d).filename().string());
  if (o.json) std::printf("%s\n", j.dump(1).c_str());
  else print_text(j);
  std::fflush(stdout);
  MT_CHECK(info.intact(), damage_message(info));
  std::string others;
  for (const std::string& d : damaged) others += (others.empty() ? "" : "; ") + d + "/meta.json is missing";
  MT_CHECK(others.empty(), "checkpoint.dir " << root << " holds damaged checkpoints beside " << dir << ": " << others
                                             << ". They are older than " << dir << ", which training resumes "
                                             << "from; restore each whole from a copy, or delete it");
  return 0;
}

}  // namespace mt
