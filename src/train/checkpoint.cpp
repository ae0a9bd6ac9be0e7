#include "train/checkpoint.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/safetensors.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

constexpr const char* kFormat = "meshtrain-checkpoint";
// 3: the row-parallel weights (attention output, MLP down projection) are stored [in, out],
//    and a shard's tensors are named by unit, tensor and first element.
constexpr int kVersion = 3;

}  // namespace

// Slicing by 8: table[k][b] is the CRC of byte b followed by k zero bytes, so 8 bytes are
// folded in with 8 lookups at once instead of one after another (several GB/s instead of
// about 0.4: a 500 MB checkpoint checked in a fraction of a second instead of over one).
uint32_t crc32_update(uint32_t crc, const void* bytes, size_t n) {
  static const auto table = [] {
    std::vector<std::array<uint32_t, 256>> t(8);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(bytes);
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;  // the next 8 bytes, little-endian words (x86-64)
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^ table[4][lo >> 24] ^
          table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^ table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = table[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

namespace {

uint32_t crc32_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f, "cannot read checkpoint file " << path);
  std::vector<char> buf(1 << 20);
  uint32_t crc = 0;
  while (f) {
    f.read(buf.data(), buf.size());
    crc = crc32_update(crc, buf.data(), static_cast<size_t>(f.gcount()));
  }
  return crc;
}

// meta.json carries the CRC-32 of its own compact text without the "meta_crc32" key: a
// flipped digit in a recorded CRC, size or optimizer step count would otherwise be read as
// valid. Parsing and dumping again gives the same text (keys sorted, doubles printed
// shortest round-trip), so the reader recomputes it from the parsed object.
uint32_t meta_crc(nlohmann::json meta) {
  meta.erase("meta_crc32");
  const std::string text = meta.dump();
  return crc32_update(0, text.data(), text.size());
}

std::string shard_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "shard_%05d", rank);
  return buf;
}

std::string rank_state_name(int rank) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank_state_%05d.safetensors", rank);
  return buf;
}

// What is wrong with a checkpoint file against the size and CRC-32 meta.json records for
// it ("" when nothing).
std::string file_problem(const std::string& path, const nlohmann::json& recorded) {
  if (!fs::exists(path)) return "missing";
  const uint64_t bytes = recorded.at("bytes").get<uint64_t>();
  if (fs::file_size(path) != bytes)
    return "corrupt: " + std::to_string(fs::file_size(path)) + " bytes, meta.json records " + std::to_string(bytes);
  if (const uint32_t crc = crc32_file(path); crc != recorded.at("crc32").get<uint32_t>()) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "corrupt: CRC-32 %08x, meta.json records %08x", crc, recorded.at("crc32").get<uint32_t>());
    return buf;
  }
  return "";
}

// Writes this rank's state file into the temporary directory; returns what meta.json
// records of it (null: none).
nlohmann::json write_rank_state(const std::string& tmp, int rank, const RankState& state) {
  if (state.tensors.empty()) return nullptr;
  const std::string name = rank_state_name(rank);
  std::vector<std::pair<std::string, Shape>> list;
  for (const auto& [n, t] : state.tensors) list.emplace_back(n, Shape{t.numel()});
  {
    SafetensorsWriter w(tmp + "/" + name, list);
    for (const auto& [n, t] : state.tensors) w.write(n, t.f32());
    w.finish();
  }
  return {{"rank", rank}, {"file", name}, {"bytes", fs::file_size(tmp + "/" + name)}, {"crc32", crc32_file(tmp + "/" + name)}};
}

// The fields of a parsed meta.json against the kinds checkpoint_save writes, each that
// this file and `checkpoint info` read; the first problem is kept, named by its path
// ("has shards[0].ranges[2].begin = -1, not an element index").
struct MetaFields {
  using J = nlohmann::json;
  using Kind = bool (*)(const J&);
  std::string problem;

  // obj[key], when it is there and of the kind; else null (and the problem, the first).
  const J* need(const J& obj, const std::string& path, const char* key, Kind ok, const char* kind) {
    if (!problem.empty()) return nullptr;
    if (!obj.contains(key)) {
      problem = "has no " + path + key;
      return nullptr;
    }
    if (ok(obj[key])) return &obj[key];
    const std::string v = obj[key].dump();
    problem = "has " + path + key + " = " + (v.size() > 40 ? v.substr(0, 37) + "..." : v) + ", not " + kind;
    return nullptr;
  }
  // check(element, its path) for each element of a list, each an object.
  template <class Check>
  void each(const J* list, const std::string& path, Check check) {
    for (size_t i = 0; list && problem.empty() && i < list->size(); ++i) {
      const std::string at = path + "[" + std::to_string(i) + "]";
      if ((*list)[i].is_object()) check((*list)[i], at + ".");
      else problem = "has " + at + ", not an object";
    }
  }
  void file_record(const J& f, const std::string& path) {  // a shard's or a state file's
    need(f, path, "file", file_name, "a file name");
    need(f, path, "rank", count, "a rank");
    need(f, path, "bytes", count, "a byte count");
    need(f, path, "crc32", [](const J& v) { return v.is_number_unsigned() && v.get<uint64_t>() <= 0xFFFFFFFFu; },
         "a CRC-32");
  }

  static bool count(const J& v) { return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0); }
  static bool text(const J& v) { return v.is_string(); }
  static bool object(const J& v) { return v.is_object(); }
  static bool list(const J& v) { return v.is_array(); }
  static bool file_name(const J& v) {  // a file of the checkpoint's own directory: a name a file system takes
    if (!v.is_string()) return false;
    const std::string& n = v.get_ref<const std::string&>();
    return !n.empty() && n.size() <= 255 && n != "." && n != ".." &&
           n.find_first_of(std::string("/\0", 2)) == std::string::npos;
  }
  template <Kind element>
  static bool list_of(const J& v) {
    return v.is_array() && std::all_of(v.begin(), v.end(), element);
  }
  static bool number(const J& v) { return v.is_number(); }
};

// What is wrong with a parsed meta.json's fields ("" when nothing): one that parses but was
// edited, or written by another tool (an older one carries no CRC of its own), is so named
// as damaged before a reader meets a missing key or a wrong type.
std::string meta_fields_problem(const nlohmann::json& meta) {
  using J = nlohmann::json;
  using M = MetaFields;
  MetaFields m;
  m.need(meta, "", "step", M::count, "a step number");
  if (meta.contains("world_size"))
    m.need(meta, "", "world_size", [](const J& v) { return v.is_number_integer() && v.get<int64_t>() > 0; },
           "a rank count");
  if (const J* c = m.need(meta, "", "config", M::object, "an object"))
    for (auto s = c->begin(); s != c->end(); ++s) m.need(*c, "config.", s.key().c_str(), M::object, "an object of keys");
  if (const J* o = m.need(meta, "", "optimizer", M::object, "an object")) {
    m.need(*o, "optimizer.", "name", M::text, "a string");
    m.need(*o, "optimizer.", "steps_taken", M::count, "a count of steps");
    if (o->contains("loss_scale")) m.need(*o, "optimizer.", "loss_scale", M::number, "a number");
    if (o->contains("loss_scale_clean")) m.need(*o, "optimizer.", "loss_scale_clean", M::count, "a count of steps");
    if (o->contains("spike_guard"))
      if (const J* g = m.need(*o, "optimizer.", "spike_guard", M::object, "an object")) {
        m.need(*g, "optimizer.spike_guard.", "loss", M::list_of<M::number>, "a list of numbers");
        m.need(*g, "optimizer.spike_guard.", "grad_norm", M::list_of<M::number>, "a list of numbers");
        m.need(*g, "optimizer.spike_guard.", "skips_in_a_row", M::count, "a count");
      }
  }
  m.each(m.need(meta, "", "units", M::list, "a list"), "units", [&](const J& u, const std::string& at) {
    m.need(u, at, "name", M::text, "a string");
    const J* numel = m.need(u, at, "numel", M::count, "an element count");
    m.each(m.need(u, at, "params", M::list, "a list"), at + "params", [&](const J& p, const std::string& pat) {
      m.need(p, pat, "name", M::text, "a string");
      const J* shape = m.need(p, pat, "shape", M::list_of<M::count>, "a list of sizes");
      const J* offset = m.need(p, pat, "offset", M::count, "an element offset");
      if (!numel || !shape || !offset) return;
      // The tensor lies within its unit (its element count taken without overflow).
      const int64_t room = numel->get<int64_t>() - std::min(offset->get<int64_t>(), numel->get<int64_t>());
      int64_t n = 1;
      for (const J& d : *shape) n = d.get<int64_t>() == 0 ? 0 : n > room / d.get<int64_t>() ? room + 1 : n * d.get<int64_t>();
      if (offset->get<int64_t>() > numel->get<int64_t>() || n > room)
        m.problem = "has " + pat + "shape = " + shape->dump() + " at offset " + offset->dump() + ", past its unit's " +
                    numel->dump() + " elements";
    });
  });
  m.each(m.need(meta, "", "shards", M::list, "a list"), "shards", [&](const J& sh, const std::string& at) {
    m.file_record(sh, at);
    m.each(m.need(sh, at, "ranges", M::list, "a list"), at + "ranges", [&](const J& rg, const std::string& rat) {
      m.need(rg, rat, "unit", M::text, "a unit's name");
      const J* begin = m.need(rg, rat, "begin", M::count, "an element index");
      const J* end = m.need(rg, rat, "end", M::count, "an element index");
      if (begin && end && end->get<int64_t>() < begin->get<int64_t>())
        m.problem = "has " + rat + "end = " + end->dump() + ", before its begin " + begin->dump();
      m.need(rg, rat, "tensors", M::list_of<M::text>, "a list of names");
    });
  });
  if (meta.contains("rank_state"))
    if (const J* r = m.need(meta, "", "rank_state", M::object, "an object")) {
      m.need(*r, "rank_state.", "layout", M::text, "a string");
      m.each(m.need(*r, "rank_state.", "files", M::list, "a list"), "rank_state.files",
             [&](const J& f, const std::string& at) { m.file_record(f, at); });
    }
  return m.problem;
}

// "line 3, column 7" of byte `at` (0-based) of text.
std::string text_position(const std::string& text, size_t at) {
  const size_t line = 1 + std::count(text.begin(), text.begin() + std::min(at, text.size()), '\n');
  const size_t start = at == 0 ? 0 : text.rfind('\n', at - 1);
  const size_t column = start == std::string::npos || at == 0 ? at + 1 : at - start;
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

// meta.json's text parsed into j; what is wrong with it in meshtrain's words ("" when
// nothing). One JSON object and whitespace after it (the writer ends it with a newline):
// text appended after the object is refused, since the CRC-32 covers only the object.
std::string meta_parse(const std::string& text, nlohmann::json& j) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return text.empty() ? "empty" : "empty (whitespace only)";
  std::istringstream in(text);
  try {
    in >> j;  // one value; the stream left just after it
  } catch (const nlohmann::json::parse_error& e) {
    if (e.byte > text.size())  // the parser ran out of text inside the value
      return "cut short: its " + std::to_string(text.size()) + " bytes end inside its JSON object";
    return "not valid JSON (at " + text_position(text, e.byte - 1) + ")";
  }
  const std::streamoff end = in.tellg();
  const size_t after = end < 0 ? text.size() : text.find_first_not_of(" \t\r\n", static_cast<size_t>(end));
  if (after != std::string::npos)
    return "not what meshtrain writes: " + std::to_string(text.size() - after) + " bytes follow its JSON object (from " +
           text_position(text, after) + ")";
  return "";
}

// What is wrong with the model settings of a parsed meta.json against its tensor table
// (units and their parameters' names, shapes and offsets, which checkpoint_save takes from
// model_layout of the same settings); "" when they agree. A configuration meshtrain does not
// take is left to checkpoint_saved_config to name.
std::string meta_model_problem(const nlohmann::json& meta) {
  Config c;
  try {
    c = config_from_json(meta.at("config"));
    c.model.validate();
  } catch (const Error&) {
    return "";
  }
  const nlohmann::json& m = meta["config"]["model"];
  std::string keys;
  for (const char* k : {"family", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff", "vocab_size", "tie_embeddings"})
    if (m.contains(k)) keys += std::string(keys.empty() ? "" : ", ") + k + " = " + m[k].dump();
  const std::string settings = "its model settings (model." + keys + ")";
  std::vector<Unit> want;
  try {
    want = model_layout(c.model);
  } catch (const Error& e) {
    return settings + " make no model (" + e.what() + ")";
  }
  const nlohmann::json& units = meta.at("units");
  if (units.size() != want.size())
    return settings + " make " + std::to_string(want.size()) + " units, its tensor table holds " +
           std::to_string(units.size());
  for (size_t u = 0; u < want.size(); ++u) {
    const nlohmann::json& saved = units[u];
    const nlohmann::json& params = saved.at("params");
    if (saved.at("name") != want[u].name || params.size() != want[u].params.size())
      return settings + " make unit " + want[u].name + " of " + std::to_string(want[u].params.size()) +
             " parameters, its tensor table has " + saved.at("name").dump() + " of " + std::to_string(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const ParamSpec& p = want[u].params[i];
      if (params[i].at("name") != p.name || params[i].at("shape") != nlohmann::json(p.shape) ||
          params[i].at("offset") != p.offset)
        return settings + " make " + p.name + " " + nlohmann::json(p.shape).dump() + " at offset " +
               std::to_string(p.offset) + ", its tensor table has " + params[i].at("name").get<std::string>() + " " +
               params[i].at("shape").dump() + " at offset " + params[i].at("offset").dump();
    }
    if (saved.at("numel") != want[u].numel)
      return settings + " make unit " + want[u].name + " of " + std::to_string(want[u].numel) +
             " elements, its tensor table has " + saved.at("numel").dump();
  }
  return "";
}

// meta.json of a checkpoint directory, parsed and checked. problem says what is wrong
// ("" when nothing); damaged: the file is missing or corrupt (not merely another format);
// advice: what to do, where it is not the damaged checkpoint's (a misnamed directory).
struct MetaRead {
  nlohmann::json j;
  std::string problem;
  bool damaged = false;
  std::string advice = {};
};

MetaRead meta_read(const std::string& dir) {
  std::ifstream f(dir + "/meta.json", std::ios::binary);
  if (!f) return {{}, "missing", true};
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  nlohmann::json j;
  if (const std::string p = meta_parse(text, j); !p.empty()) return {{}, "corrupt (" + p + ")", true};
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat) return {{}, "not a meshtrain checkpoint's meta.json", false};
  if (!j.contains("version") || j["version"] != kVersion)
    return {{}, "of checkpoint version " + j.value("version", nlohmann::json()).dump() + "; this meshtrain reads version " +
                    std::to_string(kVersion),
            false};
  // Checkpoints written before meta.json carried its CRC have none to check.
  if (j.contains("meta_crc32") && j["meta_crc32"] != meta_crc(j))
    return {{}, "corrupt (its CRC-32 differs from the one it records)", true};
  if (const std::string p = meta_fields_problem(j); !p.empty()) return {{}, "corrupt (it " + p + ")", true};
  if (const std::string p = meta_model_problem(j); !p.empty())
    return {{}, "corrupt (" + p + ": edited, or written by another tool)", true};
  // A copied or renamed directory: a resume takes the newest name for the newest step, went
  // back to the step inside it, and pruned the real newer ones by checkpoint.keep.
  const int64_t step = j["step"].get<int64_t>(), named = checkpoint_name_step(dir);
  if (named >= 0 && named != step) {
    const fs::path right = fs::path(dir).lexically_normal().parent_path() / checkpoint_step_dir(step);
    return {{},
            "misnamed: it records step " + std::to_string(step) + " but its directory's name says step " +
                std::to_string(named),
            false,
            "a copied or renamed checkpoint, which training would take for step " + std::to_string(named) +
                " (a resume would go back to step " + std::to_string(step) + " and remove newer checkpoints). " +
                (fs::exists(right) ? "Remove it (" + right.string() + " is there already)"
                                   : "Rename it " + right.string() + ", or remove it")};
  }
  return {std::move(j), "", false};
}

nlohmann::json read_meta(const std::string& dir, bool resuming = false) {
  MetaRead m = meta_read(dir);
  MT_CHECK(m.problem.empty(), "checkpoint file " << dir << "/meta.json is " << m.problem
                                                 << (!m.advice.empty() ? ": " + m.advice
                                                     : m.damaged      ? "; " + checkpoint_damage_advice(dir, resuming)
                                                                      : std::string()));
  return std::move(m.j);
}

// A shard file's tensor for one range of a unit: "block.3.adam_m@1024" (a rank may hold
// several ranges of a unit: its tensor-parallel pieces).
std::string tensor_name(const std::string& unit, const std::string& tensor, int64_t begin) {
  return unit + "." + tensor + "@" + std::to_string(begin);
}

// Removes directory `dir` of `root` (if there) by renaming it to a .tmp- name first, so that
// a save killed while removing it leaves what the next start removes, not a step directory
// without meta.json (damaged).
void remove_as_incomplete(const std::string& root, const std::string& dir) {
  if (!fs::exists(dir)) return;
  const std::string doomed = root + "/.tmp-" + fs::path(dir).filename().string();
  fs::remove_all(doomed);
  fs::rename(dir, doomed);
  fs::remove_all(doomed);
}

// Rank 0, once the temporary directory tmp is complete: renames it to final_dir (replacing
// an existing checkpoint of the same step only now) and removes the oldest others beyond
// `keep`. A filesystem error (a read-only or full filesystem) names checkpoint.dir, the
// path and the reason; the checkpoints already there stay.
void put_in_place(const std::string& root, const std::string& tmp, const std::string& final_dir, int keep) {
  try {
    if (fs::exists(final_dir)) {
      const std::string old = final_dir + ".old";
      remove_as_incomplete(root, old);
      fs::rename(final_dir, old);
      fs::rename(tmp, final_dir);
      remove_as_incomplete(root, old);
    } else {
      fs::rename(tmp, final_dir);
    }
    if (keep <= 0) return;
    // The oldest others go; the checkpoint just written always stays.
    std::vector<std::string> dirs;
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && checkpoint_step_name(n) && e.path().string() != fs::path(final_dir).string())
        dirs.push_back(e.path());
    }
    std::sort(dirs.begin(), dirs.end());
    for (size_t i = 0; i + keep < dirs.size() + 1; ++i) {
      remove_as_incomplete(root, dirs[i] + ".old");  // a copy a killed save left beside it
      remove_as_incomplete(root, dirs[i]);
    }
  } catch (const fs::filesystem_error& e) {
    MT_FAIL("checkpoint.dir = " << root << ": cannot put " << final_dir << " in place (" << e.path1().string() << ": "
                                << e.code().message() << "); make it writable (or free space) and run again with "
                                << "checkpoint.resume=true, which continues from the newest checkpoint in it");
  }
}

}  // namespace

std::string checkpoint_save(const std::string& root, int64_t step, const Config& cfg, const std::vector<Unit>& layout,
                            const std::vector<CheckpointSlice>& slices, const OptimizerProgress& optimizer,
                            Communicator& world, int keep, const RankState& rank_state) {
  const std::string final_dir = root + "/" + checkpoint_step_dir(step);
  const std::string tmp = root + "/.tmp-" + checkpoint_step_dir(step);
  const bool lead = world.rank() == 0;
  const std::string nonce = std::to_string(std::hash<std::string>{}(final_dir) ^ static_cast<size_t>(now_seconds() * 1e6));
  // Rank 0 makes the temporary directory and writes the nonce in it; where it cannot (a
  // read-only or full filesystem), every rank stops with the path and the reason.
  agreed(world, [&] {
    if (!lead) return;
    const std::string then = "; make it writable (or free space) and run again with checkpoint.resume=true, "
                             "which continues from the newest checkpoint in it";
    std::error_code ec;
    fs::create_directories(root, ec);
    MT_CHECK(!ec, "cannot create checkpoint.dir = " << root << ": " << ec.message() << then);
    fs::remove_all(tmp, ec);  // a save that died half-way
    if (!ec) fs::create_directories(tmp, ec);
    MT_CHECK(!ec, "cannot create " << tmp << " in checkpoint.dir = " << root << ": " << ec.message() << then);
    std::ofstream f(tmp + "/nonce");
    MT_CHECK(f << nonce << std::flush, "cannot write " << tmp << "/nonce in checkpoint.dir = " << root << ": "
                                                       << std::strerror(errno) << then);
  });
  // Every writer must see the directory rank 0 made: checkpoint.dir has to be shared.
  const std::string lead_nonce = allgather_strings(world, nonce)[0];
  if (!slices.empty()) {
    std::ifstream f(tmp + "/nonce");
    std::string seen;
    f >> seen;
    MT_CHECK(seen == lead_nonce, "rank " << world.rank() << " does not see the checkpoint directory rank 0 made in "
                                        << root << "; checkpoint.dir must be one directory shared by all ranks "
                                        << "(a network filesystem), given as an absolute path");
  }

  // This rank's shard: its slices' tensors; what they hold goes to rank 0 by all-gather.
  nlohmann::json side;
  if (!slices.empty()) {
    const std::string name = shard_name(world.rank()) + ".safetensors";
    std::vector<std::pair<std::string, Shape>> list;
    nlohmann::json ranges = nlohmann::json::array();
    for (const CheckpointSlice& s : slices) {
      nlohmann::json names = nlohmann::json::array();
      for (const auto& [t, ptr] : s.tensors) {
        list.emplace_back(tensor_name(s.unit, t, s.begin), Shape{s.end - s.begin});
        names.push_back(t);
      }
      ranges.push_back({{"unit", s.unit}, {"begin", s.begin}, {"end", s.end}, {"tensors", names}});
    }
    {
      SafetensorsWriter w(tmp + "/" + name, list);
      for (const CheckpointSlice& s : slices)
        for (const auto& [t, ptr] : s.tensors) w.write(tensor_name(s.unit, t, s.begin), ptr);
      w.finish();
    }
    const std::string path = tmp + "/" + name;
    side = {{"rank", world.rank()}, {"file", name}, {"bytes", fs::file_size(path)}, {"crc32", crc32_file(path)},
            {"ranges", ranges}};
  }
  const nlohmann::json state_side = write_rank_state(tmp, world.rank(), rank_state);
  // parallel.test_fault = "slow_save:R": rank R pauses here, the temporary directory and
  // its shard in place, so that tests can signal or kill a job in the middle of a save.
  if (cfg.parallel.test_fault == "slow_save:" + std::to_string(world.rank()))
    std::this_thread::sleep_for(std::chrono::seconds(3));
  world.barrier_slow();  // the writers may take a while
  // Each rank's [shard, state file] (null where it wrote none), on the lead.
  const std::vector<std::string> written = allgather_strings(world, nlohmann::json::array({side, state_side}).dump());

  if (lead) {
    nlohmann::json meta;
    meta["format"] = kFormat;
    meta["version"] = kVersion;
    meta["step"] = step;
    meta["optimizer"] = {{"name", cfg.optim.name}, {"steps_taken", optimizer.steps_taken}};
    if (optimizer.loss_scale > 0) {
      meta["optimizer"]["loss_scale"] = optimizer.loss_scale;
      meta["optimizer"]["loss_scale_clean"] = optimizer.loss_scale_clean;
    }
    if (const auto& g = optimizer.spike_guard)  // doubles are written shortest round-trip: read back exactly
      meta["optimizer"]["spike_guard"] = {{"loss", g->loss}, {"grad_norm", g->norm},
                                          {"skips_in_a_row", g->skips_in_a_row}};
    meta["config"] = config_to_json(cfg);
    meta["world_size"] = world.size();
    nlohmann::json ju = nlohmann::json::array();
    for (const Unit& u : layout) {
      nlohmann::json params = nlohmann::json::array();
      for (const ParamSpec& p : u.params) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
      ju.push_back({{"name", u.name}, {"numel", u.numel}, {"params", params}});
    }
    meta["units"] = ju;
    nlohmann::json shards = nlohmann::json::array();
    std::map<std::string, int64_t> covered;
    nlohmann::json states = nlohmann::json::array();
    for (const std::string& text : written) {
      nlohmann::json both = nlohmann::json::parse(text);
      if (!both[1].is_null()) states.push_back(std::move(both[1]));
      if (both[0].is_null()) continue;  // a rank that holds a replica writes no shard
      nlohmann::json& j = both[0];
      for (const auto& rg : j["ranges"]) covered[rg["unit"]] += rg["end"].get<int64_t>() - rg["begin"].get<int64_t>();
      shards.push_back(std::move(j));
    }
    fs::remove(tmp + "/nonce");
    for (const Unit& u : layout)
      MT_CHECK(covered[u.name] == u.numel, "internal: checkpoint shards cover " << covered[u.name] << " of " << u.numel
                                                                             << " elements of unit " << u.name);
    meta["shards"] = shards;
    if (!states.empty()) meta["rank_state"] = {{"layout", rank_state.layout}, {"files", states}};
    meta["meta_crc32"] = meta_crc(meta);
    {
      std::ofstream f(tmp + "/meta.json");
      f << meta.dump(1) << "\n";
      MT_CHECK(f.good(), "cannot write " << tmp << "/meta.json (disk full?)");
    }
    put_in_place(root, tmp, final_dir, keep);
  }
  world.barrier_slow();  // rank 0 finished writing meta.json and renaming
  return final_dir;
}

std::vector<CheckpointSlice> checkpoint_param_slices(const std::vector<Unit>& units) {
  std::vector<CheckpointSlice> r;
  for (const Unit& u : units) {
    MT_CHECK(u.numel == u.global_numel, "internal: unit " << u.name << " is a tensor-parallel share, not whole");
    r.push_back({u.name, 0, u.numel, {{"params", u.w.f32()}}});
  }
  return r;
}

std::vector<CheckpointSlice> checkpoint_unit_slices(const Unit& u, int64_t begin, int64_t end,
                                                    const std::vector<std::pair<std::string, float*>>& tensors,
                                                    bool primary_only) {
  std::vector<CheckpointSlice> r;
  for (const UnitPiece& piece : u.pieces_within(begin, end, primary_only)) {
    CheckpointSlice slice{u.name, piece.global, piece.global + piece.n, tensors};
    for (auto& t : slice.tensors) t.second += piece.local - begin;
    r.push_back(std::move(slice));
  }
  return r;
}

bool checkpoint_model_key_fixed(const std::string& key) {
  return key.rfind("model.", 0) == 0 && key != "model.norm_eps" && key != "model.rope_theta" &&
         key != "model.init_from";
}

std::string checkpoint_files_problem(const std::string& dir, const nlohmann::json& meta) {
  std::vector<const nlohmann::json*> files;
  for (const auto& sh : meta.at("shards")) files.push_back(&sh);
  if (meta.contains("rank_state"))
    for (const auto& st : meta["rank_state"].at("files")) files.push_back(&st);
  for (const nlohmann::json* f : files) {
    const std::string path = dir + "/" + f->at("file").get<std::string>();
    std::error_code ec;
    const uint64_t bytes = fs::file_size(path, ec), want = f->at("bytes").get<uint64_t>();
    if (ec && !fs::exists(path)) return "checkpoint file " + path + " is missing: the checkpoint is incomplete";
    if (ec) return "checkpoint file " + path + " cannot be read: " + ec.message();
    if (bytes != want)
      return "checkpoint file " + path + " is corrupt: " + std::to_string(bytes) + " bytes, meta.json records " +
             std::to_string(want);
  }
  return "";
}

nlohmann::json checkpoint_meta(const std::string& dir, bool resuming) { return read_meta(dir, resuming); }

Config checkpoint_saved_config(const std::string& dir, const nlohmann::json& meta, bool resuming) {
  Config c;
  try {
    c = config_from_json(meta.at("config"));
    c.model.validate();  // an edited model.seq_len = -1 reached the model's buffers
  } catch (const Error& e) {
    MT_FAIL("checkpoint file " << dir << "/meta.json records a configuration this meshtrain does not take (" << e.what()
                               << "); " << checkpoint_damage_advice(dir, resuming));
  }
  // A run saves the layout it resolved: its dp and micro-batch, never 0 ("derive it").
  MT_CHECK(c.parallel.dp >= 1 && c.training.micro_batch >= 1,
           "checkpoint file " << dir << "/meta.json is corrupt (it records parallel.dp = " << c.parallel.dp
                              << " and training.micro_batch = " << c.training.micro_batch << ", not the layout a run "
                              << "resolved); " << checkpoint_damage_advice(dir, resuming));
  return c;
}

Config checkpoint_config(const std::string& dir) { return checkpoint_saved_config(dir, read_meta(dir)); }

int64_t checkpoint_load(const std::string& dir, const ModelConfig& model, const std::vector<CheckpointSlice>& slices,
                        OptimizerProgress* optimizer, bool resuming) {
  nlohmann::json meta = read_meta(dir, resuming);
  // The model's shape must be the one saved (init_from does not matter once trained).
  Config saved = checkpoint_saved_config(dir, meta, resuming);
  Config now;
  now.model = model;
  nlohmann::json a = config_to_json(saved)["model"], b = config_to_json(now)["model"];
  for (auto it = a.begin(); it != a.end(); ++it)
    MT_CHECK(!checkpoint_model_key_fixed("model." + it.key()) || b[it.key()] == *it, "checkpoint " << dir << " was saved with model." << it.key() << " = " << it->dump()
                                               << " but this run has " << b[it.key()].dump()
                                               << "; use the checkpoint's model settings or a new checkpoint.dir");

  std::map<std::string, std::unique_ptr<SafetensorsReader>> open;  // shard files checked and opened once
  auto reader = [&](const nlohmann::json& sh) -> SafetensorsReader& {
    const std::string path = dir + "/" + sh.at("file").get<std::string>();
    auto it = open.find(path);
    if (it != open.end()) return *it->second;
    const std::string problem = file_problem(path, sh);
    MT_CHECK(problem.empty(), "checkpoint shard " << path << " is " << problem
                                                  << (problem == "missing" ? ": the checkpoint is incomplete" : "")
                                                  << "; " << checkpoint_damage_advice(dir, resuming));
    return *(open[path] = std::make_unique<SafetensorsReader>(path));
  };
  for (const CheckpointSlice& want : slices) {
    for (const auto& [tname, dst] : want.tensors) {
      int64_t filled = 0;
      for (const auto& sh : meta.at("shards"))
        for (const auto& rg : sh.at("ranges")) {
          if (rg.at("unit") != want.unit) continue;
          const auto& names = rg.at("tensors");
          if (std::find(names.begin(), names.end(), tname) == names.end()) continue;
          const int64_t lo = std::max(want.begin, rg.at("begin").get<int64_t>());
          const int64_t hi = std::min(want.end, rg.at("end").get<int64_t>());
          if (lo >= hi) continue;
          const int64_t begin = rg.at("begin").get<int64_t>();
          reader(sh).read_f32_range(tensor_name(want.unit, tname, begin), lo - begin, hi - lo, dst + (lo - want.begin));
          filled += hi - lo;
        }
      MT_CHECK(filled == want.end - want.begin,
               "checkpoint " << dir << " has no " << tname << " for elements [" << want.begin << ", " << want.end
                             << ") of unit " << want.unit << " (saved with optim.name = "
                             << meta["optimizer"].value("name", "?") << "); resume with the same optimizer");
    }
  }
  if (optimizer) {
    const nlohmann::json& o = meta.at("optimizer");
    optimizer->steps_taken = o.at("steps_taken").get<int64_t>();
    optimizer->loss_scale = o.value("loss_scale", 0.0);
    optimizer->loss_scale_clean = o.value("loss_scale_clean", 0);
    optimizer->spike_guard.reset();
    if (o.contains("spike_guard")) {
      const nlohmann::json& g = o["spike_guard"];
      optimizer->spike_guard = SpikeGuard::State{g.at("loss").get<std::vector<double>>(),
                                                 g.at("grad_norm").get<std::vector<double>>(),
                                                 g.at("skips_in_a_row").get<int>()};
    }
  }
  return meta.at("step").get<int64_t>();
}

std::string checkpoint_load_rank_state(const std::string& dir, int rank, const RankState& state) {
  const nlohmann::json meta = read_meta(dir, /*resuming=*/true);
  if (!meta.contains("rank_state")) return "";
  const nlohmann::json& saved = meta["rank_state"];
  const std::string layout = saved.at("layout").get<std::string>();
  if (layout != state.layout || state.tensors.empty()) return layout;
  const auto& files = saved.at("files");
  const auto it = std::find_if(files.begin(), files.end(), [&](const nlohmann::json& f) { return f.at("rank") == rank; });
  MT_CHECK(it != files.end(), "checkpoint " << dir << " holds no " << rank_state_name(rank) << " though rank " << rank
                                            << " wrote state at this layout; " << checkpoint_damage_advice(dir, true));
  const std::string path = dir + "/" + it->at("file").get<std::string>();
  const std::string problem = file_problem(path, *it);
  MT_CHECK(problem.empty(), "checkpoint file " << path << " is " << problem << "; "
                                               << checkpoint_damage_advice(dir, true));
  SafetensorsReader reader(path);
  MT_CHECK(reader.entries().size() == state.tensors.size(), "internal: " << path << " holds " << reader.entries().size()
                                                                         << " tensors, this rank's state "
                                                                         << state.tensors.size());
  for (const auto& [name, t] : state.tensors) {
    MT_CHECK(reader.has(name) && shape_numel(reader.entries().at(name).shape) == t.numel(),
             "internal: " << path << " has no tensor " << name << " of " << t.numel() << " elements");
    reader.read_f32(name, t.f32(), t.numel());
  }
  return layout;
}

CheckpointInfo checkpoint_inspect(const std::string& dir) {
  CheckpointInfo info;
  info.dir = dir;
  MetaRead m = meta_read(dir);
  std::error_code ec;
  const uint64_t bytes = fs::file_size(dir + "/meta.json", ec);
  info.files.push_back({"meta.json", -1, ec ? 0 : bytes, m.problem});
  info.advice = m.advice;
  if (!m.problem.empty()) return info;  // nothing else can be checked without it
  info.meta = std::move(m.j);
  // Each shard against the size and CRC-32 that meta.json records for it, then what its
  // ranges cover: every unit whole, for every tensor kind saved.
  std::map<std::string, std::map<std::string, int64_t>> covered;  // unit -> kind -> elements
  for (const auto& sh : info.meta.at("shards")) {
    CheckpointFile f{sh.at("file").get<std::string>(), sh.at("rank").get<int>(), sh.at("bytes").get<uint64_t>(), ""};
    f.problem = file_problem(dir + "/" + f.name, sh);
    info.files.push_back(f);
    for (const auto& rg : sh.at("ranges")) {
      const int64_t n = rg.at("end").get<int64_t>() - rg.at("begin").get<int64_t>();
      for (const auto& t : rg.at("tensors")) {
        info.elements[t.get<std::string>()] += n;
        covered[rg.at("unit").get<std::string>()][t.get<std::string>()] += n;
      }
    }
  }
  if (info.meta.contains("rank_state"))
    for (const auto& st : info.meta["rank_state"].at("files")) {
      const std::string name = st.at("file").get<std::string>();
      info.files.push_back({name, st.at("rank").get<int>(), st.at("bytes").get<uint64_t>(), file_problem(dir + "/" + name, st)});
    }
  for (const auto& u : info.meta.at("units"))
    for (const auto& [kind, total] : info.elements) {
      const int64_t got = covered[u.at("name").get<std::string>()][kind], want = u.at("numel").get<int64_t>();
      if (got != want)
        info.coverage_problems.push_back("the shards hold " + std::to_string(got) + " of " + std::to_string(want) +
                                         " elements of " + kind + " for unit " + u.at("name").get<std::string>());
    }
  return info;
}

bool CheckpointInfo::intact() const {
  for (const CheckpointFile& f : files)
    if (!f.problem.empty()) return false;
  return coverage_problems.empty();
}

}  // namespace mt
