// Hardware profiles: the built-in table and profile files (measuring: hardware_measure.cpp).
#include "plan/hardware.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <toml++/toml.h>

#include "core/error.h"
#include "core/message.h"  // not_regular_kind

namespace mt::plan {

// ---- the built-in profiles ---------------------------------------------------------------

namespace {

constexpr double T = 1e12, G = 1e9;

// Sources: ../shared/reference/published-figures.md ("the table": its Hardware section)
// and the vendor's datasheets where the table has no value.
//   flops_bf16: the table (A100 312, H100 SXM and H200 989 TFLOP/s dense); A100 40 GB has
//               A100 80 GB's compute (vendor's datasheet).
//   flops_fp16: equal to bf16 on these GPUs (the table's Megatron-LM section: "312 TFLOP/s
//               bf16/fp16 dense"; H100/H200: vendor's datasheet).
//   flops_fp32: the vendor's datasheet, without tensor cores (A100 19.5, H100 SXM and H200
//               67 TFLOP/s; TF32 tensor-core products, 156 / 494.5 TFLOP/s dense, are not
//               what fp32 training runs by default).
//   mem_bytes:  the table (GB = 1e9 bytes); A100 40 GB: the vendor's datasheet.
//   mem_bw:     the table (2.0, 3.35, 4.8 TB/s); A100 40 GB SXM: the vendor's datasheet,
//               1.555 TB/s.
//   intra_node_bw: NVLink per GPU, one direction: the table (300 GB/s A100, 450 GB/s
//               H100/H200); A100 40 GB has A100 80 GB's NVLink (vendor's datasheet).
//   inter_node_bw: the network per GPU: A100 clusters 200 Gb/s per GPU = 25 GB/s (the
//               table's Megatron-LM section: 8 x 200 Gb/s InfiniBand per node of 8);
//               H100/H200 400 Gb/s per GPU = 50 GB/s (the table's torchtitan section;
//               NVIDIA measures 46-48 GB/s per NDR NIC).
//   latency_s:  5 us, an estimate of a small collective's latency (a few microseconds),
//               not a published figure.
//   efficiency: calibrated once per GPU generation against a published run (the tests
//               check both): A100 0.548 reproduces Megatron-LM's Table 1 (four rows, within
//               15%; test_plan_time), H100/H200 0.31 torchtitan's Llama 3.1 8B on 8 H100s
//               (FSDP, local batch 2 x 8192 tokens: 5,762 tokens/s per GPU; its selective
//               recompute counted as none, since it recomputes no matrix product;
//               test_plan_search). The two differ as the runs do: Megatron's large
//               tensor-parallel products against FSDP on one node.
Hardware gpu(const std::string& name, double fp32, double bf16, double mem, double bw, double nvlink, double net,
             double efficiency) {
  Hardware h;
  h.name = name;
  h.gpu = true;
  h.flops_fp32 = fp32;
  h.flops_bf16 = bf16;
  h.flops_fp16 = bf16;
  h.mem_bytes = mem;
  h.mem_bw = bw;
  h.intra_node_bw = nvlink;
  h.inter_node_bw = net;
  h.latency_s = 5e-6;
  h.efficiency = efficiency;
  return h;
}

const std::vector<Hardware>& builtins() {
  static const std::vector<Hardware> all = {
      gpu("a100-40gb", 19.5 * T, 312 * T, 40 * G, 1.555 * T, 300 * G, 25 * G, 0.548),
      gpu("a100-80gb", 19.5 * T, 312 * T, 80 * G, 2.0 * T, 300 * G, 25 * G, 0.548),
      gpu("h100", 67 * T, 989 * T, 80 * G, 3.35 * T, 450 * G, 50 * G, 0.31),
      gpu("h200", 67 * T, 989 * T, 141 * G, 4.8 * T, 450 * G, 50 * G, 0.31),
  };
  return all;
}

// Other names people use for the built-ins (lowercase, '-' separated).
const std::map<std::string, std::string>& aliases() {
  static const std::map<std::string, std::string> all = {
      {"a100", "a100-80gb"},      {"a100-80g", "a100-80gb"},  {"a100-sxm", "a100-80gb"},
      {"a100-80gb-sxm", "a100-80gb"}, {"a100-sxm-80gb", "a100-80gb"}, {"a100-40g", "a100-40gb"},
      {"a100-40gb-sxm", "a100-40gb"}, {"a100-sxm-40gb", "a100-40gb"}, {"h100-sxm", "h100"},
      {"h100-sxm5", "h100"},      {"h100-80gb", "h100"},      {"h100-sxm-80gb", "h100"},
      {"h200-sxm", "h200"},       {"h200-141gb", "h200"},     {"h200-sxm-141gb", "h200"},
  };
  return all;
}

std::string normalized(const std::string& name) {
  std::string s = name;
  for (char& c : s) c = c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string builtin_list() {
  std::string s;
  for (const std::string& n : hardware_builtin_names()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

std::vector<std::string> hardware_builtin_names() {
  std::vector<std::string> names;
  for (const Hardware& h : builtins()) names.push_back(h.name);
  return names;
}

Hardware hardware_get(const std::string& name_or_file) {
  std::string key = normalized(name_or_file);
  if (auto a = aliases().find(key); a != aliases().end()) key = a->second;
  for (const Hardware& h : builtins())
    if (h.name == key) return h;
  const bool looks_like_file = name_or_file.find('/') != std::string::npos ||
                               (name_or_file.size() > 5 && name_or_file.ends_with(".toml"));
  if (looks_like_file || std::filesystem::exists(name_or_file)) return hardware_read(name_or_file);
  std::string alias_list;
  for (const auto& [a, n] : aliases()) alias_list += (alias_list.empty() ? "" : ", ") + a;
  MT_FAIL("unknown hardware \"" << name_or_file << "\": the built-in profiles are " << builtin_list()
                                << " (also " << alias_list << "); or give a profile file, --hardware FILE.toml "
                                << "(`meshtrain bench profile` writes one for this machine)");
}

// ---- profile files -------------------------------------------------------------------

namespace {

enum class Kind { text, flag, number };

// Every field of a profile file: what it holds (with its unit and range) and where it goes.
// A number must lie in [lo, hi].
struct Field {
  const char* name;
  Kind kind;
  const char* holds;
  std::string Hardware::*text = nullptr;
  bool Hardware::*flag = nullptr;
  double Hardware::*number = nullptr;
  double lo = 0, hi = 0;
};

// The ranges are far wider than any device: every built-in profile lies inside them, and so
// does whatever `meshtrain bench profile` measures on any machine (one slow CPU core does
// 1e9 FLOP/s; a rank's share of a machine's memory is over 1e8 bytes; a collective through
// shared memory moves over 1e6 bytes/s and takes well under a second; a step reaches over
// 1e-3 of the products' peak). Their purpose is that every time and rate the planner
// derives stays finite and prints whole: flops x efficiency >= 1e2 FLOP/s, bandwidths >= 1e3
// bytes/s, latency <= 10 s.
//   flops_*:        1e6 .. 1e18 FLOP/s (an H100's bf16 is 9.89e14)
//   mem_bytes:      1e6 .. 1e15 bytes (a 1 PB device)
//   *_bw:           1e3 .. 1e15 bytes/s (an H200's memory, 4.8e12)
//   latency_s:      0 .. 10 s
//   efficiency:     1e-4 .. 1
const std::vector<Field>& fields() {
  using H = Hardware;
  constexpr Kind N = Kind::number;
  static const std::vector<Field> all = {
      {"name", Kind::text, "the profile's name (a string)", &H::name},
      {"gpu", Kind::flag, "whether the device is a GPU (true or false)", nullptr, &H::gpu},
      {"flops_fp32", N, "dense matrix FLOP/s per device in fp32 (a number from 1e6 to 1e18, FLOP/s)", nullptr,
       nullptr, &H::flops_fp32, 1e6, 1e18},
      {"flops_bf16", N, "dense matrix FLOP/s per device in bf16 (a number from 1e6 to 1e18, FLOP/s)", nullptr,
       nullptr, &H::flops_bf16, 1e6, 1e18},
      {"flops_fp16", N, "dense matrix FLOP/s per device in fp16 (a number from 1e6 to 1e18, FLOP/s)", nullptr,
       nullptr, &H::flops_fp16, 1e6, 1e18},
      {"mem_bytes", N, "memory per device (a number from 1e6 to 1e15, bytes)", nullptr, nullptr, &H::mem_bytes, 1e6,
       1e15},
      {"mem_bw", N, "memory bandwidth per device (a number from 1e3 to 1e15, bytes/s)", nullptr, nullptr, &H::mem_bw,
       1e3, 1e15},
      {"intra_node_bw", N,
       "bandwidth per device to the others of its node, one direction (a number from 1e3 to 1e15, bytes/s)", nullptr,
       nullptr, &H::intra_node_bw, 1e3, 1e15},
      {"inter_node_bw", N, "bandwidth per device across nodes, one direction (a number from 1e3 to 1e15, bytes/s)",
       nullptr, nullptr, &H::inter_node_bw, 1e3, 1e15},
      {"latency_s", N, "latency per collective or point-to-point message (a number from 0 to 10, seconds)", nullptr,
       nullptr, &H::latency_s, 0, 10},
      {"efficiency", N,
       "the fraction of peak FLOP/s a training step's matrix work reaches (a number from 1e-4 to 1)", nullptr,
       nullptr, &H::efficiency, 1e-4, 1},
  };
  return all;
}

std::string field_list() {
  std::string s;
  for (const Field& f : fields()) s += (s.empty() ? "" : ", ") + std::string(f.name);
  return s;
}

// Sets one field from its TOML value; false when the value does not fit the field.
bool set_field(Hardware& hw, const Field& f, const toml::node& v) {
  if (f.kind == Kind::text) {
    auto s = v.as_string();
    if (!s || s->get().empty()) return false;
    hw.*f.text = s->get();
    return true;
  }
  if (f.kind == Kind::flag) {
    auto b = v.as_boolean();
    if (!b) return false;
    hw.*f.flag = b->get();
    return true;
  }
  double x = 0;
  if (auto i = v.as_integer()) x = static_cast<double>(i->get());
  else if (auto d = v.as_floating_point()) x = d->get();
  else return false;
  if (!(x >= f.lo && x <= f.hi)) return false;  // NaN too
  hw.*f.number = x;
  return true;
}

// The shortest decimal text that reads back as exactly x.
std::string number_text(double x) {
  char buf[40];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof buf, "%.*g", p, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

// Text as comment lines of at most about 100 characters, broken at spaces and newlines.
std::string wrapped(const std::string& text, const std::string& prefix) {
  std::string out;
  std::istringstream paragraphs(text);
  for (std::string p; std::getline(paragraphs, p);) {
    std::istringstream words(p);
    std::string line;
    for (std::string w; words >> w;) {
      if (!line.empty() && prefix.size() + line.size() + 1 + w.size() > 100) out += prefix + line + "\n", line.clear();
      line += (line.empty() ? "" : " ") + w;
    }
    out += prefix + line + "\n";
  }
  return out;
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\', q += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char u[8];
      std::snprintf(u, sizeof u, "\\u%04x", c);
      q += u;
    } else q += c;
  }
  return q + "\"";
}

// A TOML value as a message shows it.
std::string node_text(const toml::node& n) {
  if (auto v = n.as_string()) return quoted(v->get());
  if (auto v = n.as_integer()) return std::to_string(v->get());
  if (auto v = n.as_floating_point()) return number_text(v->get());
  if (auto v = n.as_boolean()) return v->get() ? "true" : "false";
  return n.is_table() ? "a table" : n.is_array() ? "an array" : "a date or time";
}

}  // namespace

Hardware hardware_read(const std::string& path) {
  const std::string kind = not_regular_kind(path);  // a FIFO would block the read below
  MT_CHECK(kind.empty(), "hardware profile " << path << " is " << kind << "; give a built-in name (" << builtin_list()
                                             << ") or a profile file");
  toml::table tbl;
  try {
    tbl = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    const std::string what(e.description());
    if (!std::ifstream(path).good())
      MT_FAIL("cannot read hardware profile " << path << ": no such file; give a built-in name (" << builtin_list()
                                              << ") or a profile file (`meshtrain bench profile --out " << path
                                              << "` writes one for this machine)");
    MT_FAIL("hardware profile " << path << ": " << what << " (line " << e.source().begin.line << ")");
  }
  for (auto&& [key, node] : tbl)
    MT_CHECK(key.str() == "hardware", "hardware profile " << path << ": unknown top-level key \"" << key.str()
                                                          << "\"; a profile is one [hardware] table with the fields "
                                                          << field_list());
  const toml::table* hw_tbl = tbl["hardware"].as_table();
  MT_CHECK(hw_tbl, "hardware profile " << path << ": no [hardware] table; a profile is one [hardware] table with the "
                                       << "fields " << field_list());
  for (auto&& [key, node] : *hw_tbl) {
    const std::string k(key.str());
    const bool known = std::any_of(fields().begin(), fields().end(), [&](const Field& f) { return k == f.name; });
    MT_CHECK(known, "hardware profile " << path << ": unknown field [hardware]." << k << " (line "
                                        << node.source().begin.line << "); the fields are " << field_list());
  }
  Hardware hw;
  for (const Field& f : fields()) {
    const toml::node* v = hw_tbl->get(f.name);
    MT_CHECK(v, "hardware profile " << path << ": field [hardware]." << f.name << " is missing; it holds " << f.holds);
    MT_CHECK(set_field(hw, f, *v), "hardware profile " << path << ": bad value " << node_text(*v) << " for [hardware]."
                                                       << f.name << " (line " << v->source().begin.line
                                                       << "); it holds " << f.holds);
  }
  return hw;
}

std::string hardware_to_toml(const Hardware& hw, const HardwareNotes& notes) {
  std::ostringstream s;
  s << "# meshtrain hardware profile: `meshtrain plan --hardware FILE.toml`. Rates are per device (on CPU, per\n"
       "# rank), link bandwidths one direction; every field is required.\n";
  for (const std::string& h : notes.header) s << wrapped(h, "# ");
  s << "[hardware]\n";
  for (const Field& f : fields()) {
    std::string value = f.kind == Kind::text   ? quoted(hw.*f.text)
                        : f.kind == Kind::flag ? std::string(hw.*f.flag ? "true" : "false")
                                               : number_text(hw.*f.number);
    std::string line = std::string(f.name) + " = " + value;
    s << line << std::string(line.size() < 28 ? 28 - line.size() : 1, ' ') << "# " << f.holds << "\n";
    if (auto n = notes.field.find(f.name); n != notes.field.end()) s << wrapped(n->second, "#   ");
  }
  return s.str();
}

}  // namespace mt::plan
