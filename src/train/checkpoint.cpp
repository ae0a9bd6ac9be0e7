#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

constexpr const char* kFormat = "meshtrain-checkpoint";
constexpr int kVersion = 1;

uint32_t crc32_file(const std::string& path) {
  static uint32_t table[256];
  static bool init = false;
  if (!init) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    init = true;
  }
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f, "cannot read checkpoint file " << path);
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0xFFFFFFFFu;
  while (f) {
    f.read(buf.data(), buf.size());
    for (std::streamsize i = 0; i < f.gcount(); ++i) crc = table[(crc ^ static_cast<uint8_t>(buf[i])) & 0xFF] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFu;
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

nlohmann::json read_meta(const std::string& dir) {
  std::ifstream f(dir + "/meta.json");
  MT_CHECK(f, "checkpoint " << dir << " has no meta.json; it is incomplete or not a meshtrain checkpoint");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    MT_FAIL("checkpoint " << dir << "/meta.json is corrupt (" << e.what() << "); delete " << dir
                          << " to resume from an earlier checkpoint");
  }
  MT_CHECK(j.value("format", "") == kFormat, dir << "/meta.json is not a meshtrain checkpoint");
  MT_CHECK(j.value("version", 0) == kVersion, dir << "/meta.json has checkpoint version " << j.value("version", 0)
                                                  << "; this meshtrain reads version " << kVersion);
  return j;
}

}  // namespace

std::string checkpoint_save(const std::string& root, int64_t step, const Config& cfg, const std::vector<Unit>& units,
                            const Optimizer* opt, int keep) {
  std::error_code ec;
  fs::create_directories(root, ec);
  MT_CHECK(!ec, "cannot create checkpoint.dir " << root << ": " << ec.message());
  const std::string final_dir = root + "/" + step_name(step);
  const std::string tmp = root + "/.tmp-" + step_name(step) + "-" + std::to_string(getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  // The shard: every unit's parameters and optimizer state, whole (a single rank holds all).
  std::vector<std::pair<std::string, Shape>> list;
  for (size_t i = 0; i < units.size(); ++i) {
    list.emplace_back(units[i].name + ".params", Shape{units[i].numel});
    if (opt)
      for (auto& [name, t] : opt->state(static_cast<int>(i))) list.emplace_back(units[i].name + "." + name, Shape{units[i].numel});
  }
  const std::string shard = "shard_00000.safetensors";
  {
    SafetensorsWriter w(tmp + "/" + shard, list);
    for (size_t i = 0; i < units.size(); ++i) {
      w.write(units[i].name + ".params", units[i].w.f32());
      if (opt)
        for (auto& [name, t] : opt->state(static_cast<int>(i))) w.write(units[i].name + "." + name, t.f32());
    }
    w.finish();
  }

  nlohmann::json meta;
  meta["format"] = kFormat;
  meta["version"] = kVersion;
  meta["step"] = step;
  meta["optimizer"] = opt ? nlohmann::json{{"name", cfg.optim.name}, {"steps_taken", opt->steps_taken()}} : nlohmann::json();
  meta["config"] = config_to_json(cfg);
  meta["world_size"] = 1;
  nlohmann::json ju = nlohmann::json::array();
  nlohmann::json ranges = nlohmann::json::array();
  for (const Unit& u : units) {
    nlohmann::json params = nlohmann::json::array();
    for (const ParamSpec& p : u.params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
    ju.push_back({{"name", u.name}, {"numel", u.numel}, {"params", params}});
    ranges.push_back({{"unit", u.name}, {"begin", 0}, {"end", u.numel}});
  }
  meta["units"] = ju;
  const std::string shard_path = tmp + "/" + shard;
  meta["shards"] = nlohmann::json::array(
      {{{"rank", 0}, {"file", shard}, {"bytes", fs::file_size(shard_path)}, {"crc32", crc32_file(shard_path)},
        {"ranges", ranges}}});
  {
    std::ofstream f(tmp + "/meta.json");
    f << meta.dump(1) << "\n";
    MT_CHECK(f.good(), "cannot write " << tmp << "/meta.json (disk full?)");
  }
  // Replace an existing checkpoint of the same step only once the new one is complete.
  if (fs::exists(final_dir)) {
    const std::string old = final_dir + ".old-" + std::to_string(getpid());
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }

  if (keep > 0) {
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && e.path().filename().string().rfind("step_", 0) == 0) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    for (size_t i = 0; i + keep < dirs.size(); ++i) fs::remove_all(dirs[i]);
  }
  return final_dir;
}

std::string checkpoint_latest(const std::string& root) {
  if (fs::exists(root + "/meta.json")) return root;
  if (!fs::is_directory(root)) return "";
  std::vector<std::string> dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step_", 0) == 0 && name.find(".old") == std::string::npos &&
        fs::exists(e.path() / "meta.json"))
      dirs.push_back(e.path().string());
  }
  if (dirs.empty()) return "";
  std::sort(dirs.begin(), dirs.end());
  return dirs.back();
}

Config checkpoint_config(const std::string& dir) { return config_from_json(read_meta(dir).at("config")); }

int64_t checkpoint_load(const std::string& dir, const ModelConfig& model, std::vector<Unit>& units, Optimizer* opt) {
  nlohmann::json meta = read_meta(dir);
  // The model's shape must be the one saved (init_from does not matter once trained).
  Config saved = config_from_json(meta.at("config"));
  Config now;
  now.model = model;
  nlohmann::json a = config_to_json(saved)["model"], b = config_to_json(now)["model"];
  a.erase("init_from");
  b.erase("init_from");
  for (auto it = a.begin(); it != a.end(); ++it)
    MT_CHECK(b[it.key()] == *it, "checkpoint " << dir << " was saved with model." << it.key() << " = " << it->dump()
                                               << " but this run has " << b[it.key()].dump()
                                               << "; use the checkpoint's model settings or a new checkpoint.dir");

  for (const auto& sh : meta.at("shards")) {
    const std::string path = dir + "/" + sh.at("file").get<std::string>();
    MT_CHECK(fs::exists(path), "checkpoint shard " << path << " is missing; the checkpoint is incomplete — delete "
                                                   << dir << " to resume from an earlier one");
    MT_CHECK(fs::file_size(path) == sh.at("bytes").get<uint64_t>() && crc32_file(path) == sh.at("crc32").get<uint32_t>(),
             "checkpoint shard " << path << " is corrupt (size or CRC-32 differs from meta.json); delete " << dir
                                 << " to resume from an earlier checkpoint");
    SafetensorsReader r(path);
    for (const auto& range : sh.at("ranges")) {
      const std::string uname = range.at("unit").get<std::string>();
      const int64_t begin = range.at("begin"), end = range.at("end");
      auto u = std::find_if(units.begin(), units.end(), [&](const Unit& x) { return x.name == uname; });
      MT_CHECK(u != units.end(), "checkpoint " << dir << " has unit " << uname << " that this model does not have");
      MT_CHECK(begin == 0 && end == u->numel, "checkpoint " << dir << ": unit " << uname << " range [" << begin << ", "
                                                            << end << ") does not cover the unit of " << u->numel);
      r.read_f32(uname + ".params", u->w.f32(), u->numel);
      if (opt) {
        int idx = static_cast<int>(u - units.begin());
        for (auto& [name, t] : opt->state(idx)) {
          MT_CHECK(r.has(uname + "." + name), "checkpoint " << dir << " has no " << name << " state for " << uname
                                                            << " (saved with optim.name = "
                                                            << meta["optimizer"].value("name", "none")
                                                            << "); resume with the same optimizer");
          r.read_f32(uname + "." + name, t.f32(), u->numel);
        }
      }
    }
  }
  if (opt) opt->set_steps_taken(meta.at("optimizer").at("steps_taken").get<int64_t>());
  return meta.at("step").get<int64_t>();
}

}  // namespace mt
