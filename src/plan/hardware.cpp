// Hardware profiles: the built-in table, profile files, and measuring this machine.
#include "plan/hardware.h"

#include <dlfcn.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cblas.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <toml++/toml.h>

#include "core/allocator.h"
#include "core/error.h"
#include "nn/model.h"
#include "ops/gemm.h"

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
  if (looks_like_file || std::ifstream(name_or_file).good()) return hardware_read(name_or_file);
  std::string alias_list;
  for (const auto& [a, n] : aliases()) alias_list += (alias_list.empty() ? "" : ", ") + a;
  MT_FAIL("unknown hardware \"" << name_or_file << "\": the built-in profiles are " << builtin_list()
                                << " (also " << alias_list << "); or give a profile file, --hardware FILE.toml "
                                << "(`meshtrain bench profile` writes one for this machine)");
}

// ---- profile files -------------------------------------------------------------------

namespace {

enum class Kind { text, flag, positive, non_negative, fraction };

// Every field of a profile file: what it holds (with its unit) and where it goes.
struct Field {
  const char* name;
  Kind kind;
  const char* holds;
  std::string Hardware::*text = nullptr;
  bool Hardware::*flag = nullptr;
  double Hardware::*number = nullptr;
};

const std::vector<Field>& fields() {
  using H = Hardware;
  static const std::vector<Field> all = {
      {"name", Kind::text, "the profile's name (a string)", &H::name},
      {"gpu", Kind::flag, "whether the device is a GPU (true or false)", nullptr, &H::gpu},
      {"flops_fp32", Kind::positive, "dense matrix FLOP/s per device in fp32 (a positive number, FLOP/s)", nullptr,
       nullptr, &H::flops_fp32},
      {"flops_bf16", Kind::positive, "dense matrix FLOP/s per device in bf16 (a positive number, FLOP/s)", nullptr,
       nullptr, &H::flops_bf16},
      {"flops_fp16", Kind::positive, "dense matrix FLOP/s per device in fp16 (a positive number, FLOP/s)", nullptr,
       nullptr, &H::flops_fp16},
      {"mem_bytes", Kind::positive, "memory per device (a positive number, bytes)", nullptr, nullptr, &H::mem_bytes},
      {"mem_bw", Kind::positive, "memory bandwidth per device (a positive number, bytes/s)", nullptr, nullptr,
       &H::mem_bw},
      {"intra_node_bw", Kind::positive,
       "bandwidth per device to the others of its node, one direction (a positive number, bytes/s)", nullptr, nullptr,
       &H::intra_node_bw},
      {"inter_node_bw", Kind::positive,
       "bandwidth per device across nodes, one direction (a positive number, bytes/s)", nullptr, nullptr,
       &H::inter_node_bw},
      {"latency_s", Kind::non_negative, "latency per collective or point-to-point message (a number >= 0, seconds)",
       nullptr, nullptr, &H::latency_s},
      {"efficiency", Kind::fraction,
       "the fraction of peak FLOP/s a training step's matrix work reaches (a number in (0, 1])", nullptr, nullptr,
       &H::efficiency},
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
  if (!std::isfinite(x)) return false;
  if (f.kind == Kind::positive && !(x > 0)) return false;
  if (f.kind == Kind::non_negative && !(x >= 0)) return false;
  if (f.kind == Kind::fraction && !(x > 0 && x <= 1)) return false;
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

// ---- collectives, timed ----------------------------------------------------------------

double comm_bus_factor(CommOp op, int n) {
  if (op == CommOp::allreduce) return 2.0 * (n - 1) / n;
  if (op == CommOp::allgather || op == CommOp::reduce_scatter) return double(n - 1) / n;
  return 1.0;
}

double comm_op_seconds(Communicator& group, CommOp op, int64_t count, DType dtype, int iters) {
  const int n = group.size();
  MT_CHECK(count >= n && count % n == 0 && iters >= 1,
           "internal: comm_op_seconds needs a count that " << n << " ranks divide and iters >= 1");
  CpuAllocator alloc;
  Tensor big = Tensor::zeros({count}, dtype, alloc, MemTag::comm);
  Tensor part = Tensor::zeros({count / n}, dtype, alloc, MemTag::comm);
  auto run = [&] {
    switch (op) {
      case CommOp::allreduce: group.allreduce(big); break;
      case CommOp::allgather: group.allgather(part, big); break;
      case CommOp::reduce_scatter: group.reduce_scatter(big, part); break;
      case CommOp::broadcast: group.broadcast(big, 0); break;
      default: MT_FAIL("internal: comm_op_seconds times allreduce, allgather, reduce_scatter or broadcast");
    }
  };
  run();  // warm up
  group.barrier();
  const double t0 = now_seconds();
  for (int k = 0; k < iters; ++k) run();
  double per_op = (now_seconds() - t0) / iters;
  std::vector<double> all(n);
  group.allgather(Tensor::wrap(&per_op, {1}, DType::f64), Tensor::wrap(all.data(), {n}, DType::f64));
  return *std::max_element(all.begin(), all.end());
}

// ---- measuring this machine --------------------------------------------------------------

ModelConfig MeasureOptions::benchmark_model() {
  ModelConfig c;  // configs/gpt2_bench.toml's [model]
  c.family = "gpt2";
  c.n_layer = 6, c.n_head = 6, c.d_model = 384, c.seq_len = 256, c.vocab_size = 8192;
  return c;
}

namespace {

// Runs fn at least min_reps times and until `budget` seconds have passed; the fastest run's seconds.
double fastest(const std::function<void()>& fn, double budget, int min_reps) {
  double best = 1e300;
  const double end = now_seconds() + budget;
  for (int r = 0; r < min_reps || now_seconds() < end; ++r) {
    const double t0 = now_seconds();
    fn();
    best = std::min(best, now_seconds() - t0);
  }
  return best;
}

// One value per rank, gathered on every rank.
std::vector<double> gather(Communicator& world, double x) {
  std::vector<double> all(world.size());
  world.allgather(Tensor::wrap(&x, {1}, DType::f64), Tensor::wrap(all.data(), {world.size()}, DType::f64));
  return all;
}
double world_min(Communicator& w, double x) {
  auto a = gather(w, x);
  return *std::min_element(a.begin(), a.end());
}
double world_max(Communicator& w, double x) {
  auto a = gather(w, x);
  return *std::max_element(a.begin(), a.end());
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}
std::string gflops(double x) { return fmt("%.1f GFLOP/s", x / 1e9); }
std::string gbs(double x) { return fmt("%.2f GB/s", x / 1e9); }

struct Rate {
  double value = 0;
  std::string how;
};

// fp32 matrix FLOP/s: OpenBLAS sgemm on square sizes with all of the rank's threads, and
// meshtrain's gemm (a fixed grid of single-threaded sgemm tiles) on the model's MLP product
// (tokens of a micro-batch x d_ff x d_model); the fastest of them.
Rate sgemm_rate(const MeasureOptions& o, double budget) {
  struct Shape {
    int64_t m, n, k;
    bool grid;
  };
  const int64_t tokens = std::min<int64_t>(4096, int64_t(o.micro_batch) * o.model.seq_len);
  const std::vector<Shape> shapes = {
      {512, 512, 512, false}, {1024, 1024, 1024, false}, {2048, 2048, 2048, false},
      {tokens, o.model.ff_dim(), o.model.d_model, true}};
  Rate best;
  std::string each;
  for (const Shape& s : shapes) {
    std::vector<float> a(s.m * s.k, 0.5f), b(s.n * s.k, 0.25f), c(s.m * s.n);
    const double t = fastest(
        [&] {
          if (s.grid) gemm(false, true, s.m, s.n, s.k, a.data(), s.k, b.data(), s.k, 0.0f, c.data(), s.n);
          else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.0f, a.data(), s.k, b.data(), s.k,
                        0.0f, c.data(), s.n);
        },
        budget / shapes.size(), 2);
    const double rate = 2.0 * s.m * s.n * s.k / t;
    best.value = std::max(best.value, rate);
    each += (each.empty() ? "" : ", ") + std::string(s.grid ? "meshtrain gemm " : "sgemm ") + std::to_string(s.m) +
            "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + " " + gflops(rate);
  }
  best.how = "the fastest product with " + std::to_string(omp_get_max_threads()) + " thread(s) per rank: " + each;
  return best;
}

// bf16 matrix FLOP/s: OpenBLAS sbgemm where the CPU has AVX512_BF16 and this OpenBLAS was
// built with bf16 products (looked up at run time: Debian's is not); otherwise fp32's rate.
Rate sbgemm_rate(double fp32, double budget) {
  using Sbgemm = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint, blasint, float,
                          const uint16_t*, blasint, const uint16_t*, blasint, float, float*, blasint);
  __builtin_cpu_init();
  const bool cpu = __builtin_cpu_supports("avx512bf16");
  auto sbgemm = reinterpret_cast<Sbgemm>(dlsym(RTLD_DEFAULT, "cblas_sbgemm"));
  if (!cpu || !sbgemm)
    return {fp32, std::string("not measured, fp32's rate: ") +
                      (!cpu ? "this CPU has no AVX512_BF16 bf16 products"
                            : "this OpenBLAS has no bf16 matrix product (cblas_sbgemm)")};
  Rate best;
  std::string each;
  for (int64_t n : {1024, 2048}) {
    std::vector<uint16_t> a(n * n, 0x3F00), b(n * n, 0x3E80);  // 0.5 and 0.25 in bf16
    std::vector<float> c(n * n);
    const double t = fastest(
        [&] { sbgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n); },
        budget / 2, 2);
    const double rate = 2.0 * n * n * n / t;
    best.value = std::max(best.value, rate);
    each += (each.empty() ? "" : ", ") + std::to_string(n) + "^3 " + gflops(rate);
  }
  best.how = "OpenBLAS sbgemm (" + std::string(openblas_get_corename()) + " kernels), the faster of " + each;
  return best;
}

// Memory bandwidth: a STREAM triad a = b + 3 c over three arrays of 64 MiB of doubles,
// counting 24 bytes per element (two read, one written), with all of the rank's threads.
double triad_rate(double budget) {
  const int64_t n = int64_t(1) << 23;
  std::unique_ptr<double[]> a(new double[n]), b(new double[n]), c(new double[n]);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = 0, b[i] = 1, c[i] = 2;  // first touch by the threads that use them
  const double t = fastest(
      [&] {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 3.0 * c[i];
      },
      budget, 3);
  return 24.0 * n / t;
}

// The first operation's time (max over the group) decides how many to time, the same on
// every rank of the group.
int agreed_iters(Communicator& g, CommOp op, int64_t count, double budget, int lo, int hi) {
  const double t = comm_op_seconds(g, op, count, DType::f32, 1);
  return std::clamp(static_cast<int>(budget / std::max(t, 1e-9)), lo, hi);
}

// One-way point-to-point bandwidth: ranks 2i and 2i+1 pair up; the even one sends `iters`
// messages of `bytes` back to back, the odd one answers the last with one float. The
// slowest pair's bytes per second.
double p2p_bw(Communicator& g, int64_t bytes, double budget) {
  const int r = g.rank(), peer = r ^ 1;
  const bool active = peer < g.size();
  CpuAllocator alloc;
  Tensor buf = Tensor::zeros({bytes / 4}, DType::f32, alloc, MemTag::comm);
  Tensor ack = Tensor::zeros({1}, DType::f32, alloc, MemTag::comm);
  auto burst = [&](int k) {
    if (!active) return;
    if (r % 2 == 0) {
      for (int i = 0; i < k; ++i) g.send(buf, peer);
      g.recv(ack, peer);
    } else {
      for (int i = 0; i < k; ++i) g.recv(buf, peer);
      g.send(ack, peer);
    }
  };
  double t0 = now_seconds();
  burst(1);  // warm up, and the time of one
  const int iters = std::clamp(static_cast<int>(budget / std::max(world_max(g, now_seconds() - t0), 1e-9)), 1, 50);
  g.barrier();
  t0 = now_seconds();
  burst(iters);
  const double per = active ? (now_seconds() - t0) / iters : 0;
  return bytes / world_max(g, per);
}

struct CommRates {
  double bus_bw = 0, p2p_bw = 0, latency_s = 0;
  std::string how;
};

// Between the ranks of `g` (at least two): allreduce bus bandwidth (nccl-tests' busbw) of a
// 25 MiB buffer, the size of parallel.bucket_mb's default gradient bucket (4 and 64 MiB for
// the note), one-way point-to-point bandwidth (16 MiB messages), and the time of a small
// allreduce (one float per rank).
CommRates comm_rates(Communicator& g, double budget) {
  const int n = g.size();
  CommRates c;
  std::string each;
  for (int64_t mib : {4, 25, 64}) {
    const int64_t count = std::max<int64_t>(n, (mib << 20) / 4 / n * n);
    const int iters = agreed_iters(g, CommOp::allreduce, count, budget * 0.6 / 3, 1, 20);
    const double t = comm_op_seconds(g, CommOp::allreduce, count, DType::f32, iters);
    const double bus = count * 4.0 / t * comm_bus_factor(CommOp::allreduce, n);
    if (mib == 25) c.bus_bw = bus;
    each += (each.empty() ? "" : ", ") + std::to_string(mib) + " MiB " + gbs(bus);
  }
  c.p2p_bw = p2p_bw(g, 16 << 20, budget * 0.2);
  const int iters = agreed_iters(g, CommOp::allreduce, n, budget * 0.2, 10, 2000);
  c.latency_s = comm_op_seconds(g, CommOp::allreduce, n, DType::f32, iters);
  c.how = "allreduce bus bandwidth (nccl-tests' busbw) of 25 MiB, the default gradient bucket, over " +
          std::to_string(n) + " ranks (" + each + "); one-way point-to-point 16 MiB messages " + gbs(c.p2p_bw);
  return c;
}

// One rank: what an allreduce of a 25 MiB bucket between two ranks would take through
// shared memory, emulated by one thread (the communication thread's work): each rank's
// half crosses once each way, copied into a staging buffer and out of it (the transport's
// two copies), and is summed once. nccl-tests' busbw of that (factor 1 for two ranks).
double allreduce_estimate(double budget) {
  const int64_t n = (int64_t(25) << 20) / 4, h = n / 2;
  std::vector<float> mine(n, 1.0f), peer(n, 2.0f), stage(h), in(h);
  const double t = fastest(
      [&] {
        std::memcpy(stage.data(), peer.data(), h * 4);  // the peer's piece of my half, in
        std::memcpy(in.data(), stage.data(), h * 4);
        for (int64_t i = 0; i < h; ++i) mine[i] += in[i];
        std::memcpy(stage.data(), mine.data(), h * 4);  // the sum, back out
        std::memcpy(peer.data(), stage.data(), h * 4);
      },
      budget, 3);
  return n * 4.0 / t;
}

// This rank's machine: the group of ranks on it (`node`, numbered by its first rank) and
// this rank's place among them (`local`), from the host names.
struct Place {
  int node = 0, local = 0;
};
Place place_of(Communicator& world, const std::string& host) {
  const double h = static_cast<double>(std::hash<std::string>{}(host) & ((uint64_t(1) << 52) - 1));
  const std::vector<double> all = gather(world, h);
  Place p;
  p.node = static_cast<int>(std::find(all.begin(), all.end(), h) - all.begin());
  p.local = static_cast<int>(std::count(all.begin(), all.begin() + world.rank(), h));
  return p;
}

// Parameters that take part in matrix products: all but the learned positions and an
// untied input embedding (a lookup).
double matmul_params(const ModelConfig& cfg) {
  double n = 0;
  for (const Unit& u : model_layout(cfg))
    for (const ParamSpec& p : u.params) {
      const bool lookup = p.name == "transformer.wpe.weight" ||
                          (!cfg.tied() && (p.name == "transformer.wte.weight" || p.name == "model.embed_tokens.weight"));
      if (!lookup) n += static_cast<double>(p.numel());
    }
  return n;
}

// Model FLOPs of one forward + backward of B sequences: 6 per matmul parameter and token,
// plus attention's QK^T and PV, 12 * layers * seq_len * d_model per token (the full
// T x T square, as Megatron-LM counts it).
double step_flops(const ModelConfig& cfg, int B) {
  const double tokens = double(B) * cfg.seq_len;
  return 6.0 * matmul_params(cfg) * tokens + 12.0 * cfg.n_layer * double(cfg.seq_len) * cfg.d_model * tokens;
}

// Seconds of one forward + backward of B sequences (the fastest after a warm-up).
double step_seconds(const ModelConfig& cfg, int B, double budget, int* reps) {
  const int T = cfg.seq_len;
  CpuAllocator alloc;
  Model model(cfg, alloc, B);
  model.init(1);
  std::vector<int32_t> in(int64_t(B) * T), tg(int64_t(B) * T);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<int32_t>((i * 7919) % cfg.vocab_size), tg[i] = static_cast<int32_t>((i * 104729 + 1) % cfg.vocab_size);
  auto step = [&] {
    model.zero_grad();
    model.forward(in.data(), tg.data(), B, T);
    model.backward(1.0f / (B * T));
  };
  step();  // warm up
  *reps = 0;
  return fastest([&] { step(), ++*reps; }, budget, 1);
}

std::string host_name() {
  char h[256] = {};
  gethostname(h, sizeof h - 1);
  return h;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string l; std::getline(f, l);)
    if (l.rfind("model name", 0) == 0 && l.find(':') != std::string::npos) return l.substr(l.find(':') + 2);
  return "unknown CPU";
}

// The machine's memory (MemTotal of /proc/meminfo), bytes.
double machine_memory() {
  std::ifstream f("/proc/meminfo");
  for (std::string l; std::getline(f, l);)
    if (l.rfind("MemTotal:", 0) == 0) return std::atof(l.c_str() + 9) * 1024.0;
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

}  // namespace

namespace {

using Say = std::function<void(const std::string&)>;

// intra_node_bw, inter_node_bw and latency_s: collectives among the ranks of each machine,
// and among ranks of different machines (one group per place on a machine: what each
// device's own network link carries).
void measure_links(Communicator& world, const Place& place, double budget, Measured& m, const Say& say) {
  Hardware& hw = m.hw;
  const bool spans = world.spans_machines();
  std::unique_ptr<Communicator> node_group = spans ? world.split(place.node, world.rank(), "node") : nullptr;
  Communicator& local = spans ? *node_group : world;
  say("measuring collectives between the ranks of " + std::string(spans ? "each machine" : "this machine") + " (" +
      std::to_string(local.size()) + " rank" + (local.size() > 1 ? "s" : "") + ")");
  double intra = 0, latency = 0;
  if (local.size() >= 2) {
    const CommRates c = comm_rates(local, spans ? budget / 2 : budget);
    intra = c.bus_bw, latency = c.latency_s;
    m.notes.field["intra_node_bw"] = "measured: " + c.how + "; the slowest rank's";
  } else {
    intra = allreduce_estimate(budget * 0.8);
    const int iters = agreed_iters(local, CommOp::allreduce, 1, budget * 0.1, 10, 10000);
    latency = comm_op_seconds(local, CommOp::allreduce, 1, DType::f32, iters);
    m.notes.field["intra_node_bw"] =
        "estimated: one rank on the machine, no peer to measure. A two-rank allreduce of 25 MiB through shared "
        "memory emulated with memcpy by one thread (each half copied into a staging buffer and out, summed, the sum "
        "copied back the same way), as busbw. Run `meshtrain launch -n 2 bench profile` to measure it";
  }
  hw.intra_node_bw = world_min(world, intra);
  hw.latency_s = world_max(world, latency);
  m.notes.field["latency_s"] =
      local.size() >= 2 ? "measured: an allreduce of one float per rank among " + std::to_string(local.size()) +
                              " ranks of one machine (mean; the slowest rank's)"
                        : "estimated: one rank, no messages; the communicator's own cost of one collective";
  if (!spans) {
    hw.inter_node_bw = hw.intra_node_bw;
    m.notes.field["inter_node_bw"] = "not measured: all ranks are on one machine; intra_node_bw's value";
    return;
  }
  std::unique_ptr<Communicator> cross = world.split(place.local, world.rank(), "cross");
  say("measuring collectives between machines (" + std::to_string(cross->size()) + " ranks per group)");
  double inter = 1e300, cross_latency = 0;
  if (cross->size() >= 2) {
    const CommRates c = comm_rates(*cross, budget / 2);
    inter = c.bus_bw, cross_latency = c.latency_s;
    m.notes.field["inter_node_bw"] = "measured between machines, one rank of each per group, all groups at once: " +
                                     c.how + "; the slowest rank's";
  }
  hw.inter_node_bw = world_min(world, inter);
  if (hw.inter_node_bw > 1e299) {  // no group reached two machines
    hw.inter_node_bw = hw.intra_node_bw;
    m.notes.field["inter_node_bw"] = "not measured: no two ranks of different machines share a place; intra_node_bw's";
  }
  const double lat = world_max(world, cross_latency);
  if (lat > hw.latency_s) {
    hw.latency_s = lat;
    m.notes.field["latency_s"] = "measured: an allreduce of one float per rank between machines (mean; the slowest rank's)";
  }
}

// efficiency: one forward + backward of the model at its micro-batch (halved until two
// steps fit the budget), its model FLOPs over (time x flops_fp32).
void measure_efficiency(Communicator& world, const MeasureOptions& o, double budget, Measured& m, const Say& say) {
  Hardware& hw = m.hw;
  ModelConfig cfg = o.model;
  cfg.validate();
  int B = std::max(1, o.micro_batch);
  const double guess = 0.5 * hw.flops_fp32;  // the same on every rank, and so is B
  while (B > 1 && 2 * step_flops(cfg, B) / guess > budget) B = (B + 1) / 2;
  say("measuring a training step: forward + backward of " + cfg.family + " (" + std::to_string(cfg.n_layer) +
      " layers, d_model " + std::to_string(cfg.d_model) + ") at micro-batch " + std::to_string(B));
  int reps = 0;
  const double t = world_max(world, step_seconds(cfg, B, budget / 2, &reps));
  const double flops = step_flops(cfg, B);
  hw.efficiency = flops / (t * hw.flops_fp32);
  std::string clipped;
  if (hw.efficiency > 1) hw.efficiency = 1, clipped = " (clipped to 1: the step outran the products measured)";
  std::ostringstream s;
  s << "measured: forward + backward of " << cfg.family << " (" << cfg.n_layer << " layers, d_model " << cfg.d_model
    << ", " << cfg.n_head << " heads, seq_len " << cfg.seq_len << ", vocab " << cfg.vocab_size << ") at micro-batch "
    << B << (B < o.micro_batch ? " (reduced from " + std::to_string(o.micro_batch) + " to fit --seconds)" : "")
    << ": " << fmt("%.1f ms", t * 1e3) << " (fastest of " << reps << " after a warm-up"
    << (world.size() > 1 ? "; the slowest rank's" : "") << ")\nfor "
    << fmt("%.1f", flops / 1e9) << " GFLOP of model FLOPs (6 x " << fmt("%.4g", matmul_params(cfg))
    << " matmul parameters x tokens + 12 x layers x seq_len x d_model x tokens for attention) = "
    << gflops(flops / t) << " = " << fmt("%.3f", flops / t / hw.flops_fp32) << " of flops_fp32" << clipped;
  m.notes.field["efficiency"] = s.str();
}

}  // namespace

Measured hardware_measure(Communicator& world, const MeasureOptions& o, const Say& progress) {
  const bool lead = world.rank() == 0;
  const Say say = [&](const std::string& l) {
    if (lead && progress) progress(l);
  };
  const int n = world.size();
  const double S = std::max(o.seconds, 0.1);
  const std::string slowest = n > 1 ? "; the slowest rank's, all ranks measuring at once" : "";
  Measured m;
  Hardware& hw = m.hw;
  auto& note = m.notes.field;
  hw.name = "cpu-" + host_name();
  hw.gpu = false;
  const Place place = place_of(world, host_name());
  const std::vector<double> nodes = gather(world, place.node);
  const int machines = static_cast<int>(std::count_if(nodes.begin(), nodes.end(), [&, i = 0](double x) mutable {
    return x == i++;  // a machine's first rank
  }));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M", std::localtime(&now));
  m.notes.header = {
      "measured by `meshtrain bench profile` on " + std::string(date) + ": " + cpu_model() + "; " + std::to_string(n) +
          " rank" + (n > 1 ? "s" : "") + " on " + std::to_string(machines) + " machine" + (machines > 1 ? "s" : "") +
          ", " + std::to_string(omp_get_max_threads()) + (omp_get_max_threads() > 1 ? " threads" : " thread") + " per rank",
      "matrix products: " + blas_description(),
      "Each rank is one device. Rerun with the ranks and threads per rank you will train with."};

  say("measuring fp32 matrix products (OpenBLAS sgemm; meshtrain's gemm on the model's MLP product)");
  const Rate f32 = sgemm_rate(o, 0.2 * S);
  hw.flops_fp32 = world_min(world, f32.value);
  note["flops_fp32"] = "measured: " + f32.how + slowest;
  m.summary.push_back("flops_fp32    " + gflops(hw.flops_fp32));
  say("  " + m.summary.back());

  say("measuring bf16 matrix products");
  const Rate bf = sbgemm_rate(hw.flops_fp32, 0.1 * S);
  hw.flops_bf16 = world_min(world, bf.value);
  note["flops_bf16"] = bf.how + (bf.how.rfind("not", 0) == 0 ? "" : slowest);
  hw.flops_fp16 = hw.flops_fp32;
  note["flops_fp16"] = "not measured, fp32's rate: OpenBLAS has no fp16 matrix product";
  m.summary.push_back("flops_bf16    " + gflops(hw.flops_bf16) + (bf.how.rfind("not", 0) == 0 ? " (fp32's)" : ""));
  m.summary.push_back("flops_fp16    " + gflops(hw.flops_fp16) + " (fp32's)");
  say("  " + m.summary[m.summary.size() - 2]);

  const double mem = machine_memory();
  hw.mem_bytes = world_min(world, mem / world.ranks_on_node());
  note["mem_bytes"] = "the machine's memory (MemTotal, " + fmt("%.1f GiB", mem / (1 << 30)) + ") / " +
                      std::to_string(world.ranks_on_node()) + (world.ranks_on_node() > 1 ? " ranks" : " rank") + " on it";
  m.summary.push_back("mem_bytes     " + fmt("%.2f GB", hw.mem_bytes / 1e9));

  say("measuring memory bandwidth (STREAM triad, 3 x 64 MiB)");
  hw.mem_bw = world_min(world, triad_rate(0.1 * S));
  note["mem_bw"] = "measured: STREAM triad a = b + 3c over 3 x 64 MiB of doubles, 24 bytes per element" + slowest;
  m.summary.push_back("mem_bw        " + gbs(hw.mem_bw));
  say("  " + m.summary.back());

  measure_links(world, place, 0.2 * S, m, say);
  m.summary.push_back("intra_node_bw " + gbs(hw.intra_node_bw) +
                      (note["intra_node_bw"].rfind("estimated", 0) == 0 ? " (estimated: one rank, see the file)"
                                                                        : " (allreduce busbw, 25 MiB)"));
  m.summary.push_back("inter_node_bw " + gbs(hw.inter_node_bw) +
                      (world.spans_machines() ? "" : " (not measured: one machine)"));
  m.summary.push_back("latency_s     " + fmt("%.2f us", hw.latency_s * 1e6));
  say("  " + m.summary[m.summary.size() - 3]);

  measure_efficiency(world, o, 0.4 * S, m, say);
  for (double* x : {&hw.flops_fp32, &hw.flops_bf16, &hw.flops_fp16, &hw.mem_bw, &hw.intra_node_bw, &hw.inter_node_bw,
                    &hw.latency_s, &hw.efficiency})
    *x = std::stod(fmt("%.4g", *x));  // measurements vary by more than 4 digits
  m.summary.push_back("efficiency    " + fmt("%.3f", hw.efficiency) + " (a training step's model FLOP/s / flops_fp32)");
  say("  " + m.summary.back());
  return m;
}

}  // namespace mt::plan
