// Measuring this machine for the planner (meshtrain bench profile): collectives timed,
// matrix products, memory bandwidth and links between ranks.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cblas.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>

#include "core/allocator.h"
#include "core/error.h"
#include "nn/model.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "plan/hardware.h"

namespace mt::plan {

// ---- collectives, timed ----------------------------------------------------------------

double comm_bus_factor(CommOp op, int n) {
  if (op == CommOp::allreduce) return 2.0 * (n - 1) / n;
  if (op == CommOp::allgather || op == CommOp::reduce_scatter) return double(n - 1) / n;
  return 1.0;
}

double comm_op_seconds(Communicator& group, CommOp op, int64_t count, DType dtype, int iters, Allocator* alloc) {
  const int n = group.size();
  MT_CHECK(count >= n && count % n == 0 && iters >= 1,
           "internal: comm_op_seconds needs a count that " << n << " ranks divide and iters >= 1");
  CpuAllocator host;
  Allocator& a = alloc ? *alloc : host;
  Tensor big = Tensor::zeros({count}, dtype, a, MemTag::comm);
  Tensor part = Tensor::zeros({count / n}, dtype, a, MemTag::comm);
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

// One timed product: C[m, n] = A[m, k] B[n, k]^T by `kernel` (a name for the notes), on
// constant operands.
struct Product {
  std::string kernel;
  int64_t m, n, k;
  std::function<void(const float* a, const float* b, float* c)> run;
};

// The fastest of the products, each timed within budget / their count: its FLOP/s, and
// each one's as "kernel MxNxK rate" in how.
Rate fastest_product(const std::vector<Product>& products, double budget) {
  Rate best;
  for (const Product& p : products) {
    std::vector<float> a(p.m * p.k, 0.5f), b(p.n * p.k, 0.25f), c(p.m * p.n);
    const double t = fastest([&] { p.run(a.data(), b.data(), c.data()); }, budget / products.size(), 2);
    const double rate = 2.0 * p.m * p.n * p.k / t;
    best.value = std::max(best.value, rate);
    best.how += (best.how.empty() ? "" : ", ") + p.kernel + " " + std::to_string(p.m) + "x" + std::to_string(p.n) +
                "x" + std::to_string(p.k) + " " + gflops(rate);
  }
  return best;
}

// The model's MLP product: tokens of a micro-batch (at most 4096) x d_ff x d_model.
std::array<int64_t, 3> mlp_shape(const MeasureOptions& o) {
  return {std::min<int64_t>(4096, int64_t(o.micro_batch) * o.model.seq_len), o.model.ff_dim(), o.model.d_model};
}

// fp32 matrix FLOP/s: OpenBLAS sgemm on square sizes with all of the rank's threads, and
// meshtrain's gemm (a fixed grid of single-threaded sgemm tiles) on the model's MLP product;
// the fastest of them.
Rate sgemm_rate(const MeasureOptions& o, double budget) {
  auto sgemm = [](int64_t n) {
    return Product{"sgemm", n, n, n, [n](const float* a, const float* b, float* c) {
                     cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
                   }};
  };
  const auto [m, n, k] = mlp_shape(o);
  const Product grid{"meshtrain gemm", m, n, k, [m, n, k](const float* a, const float* b, float* c) {
                       gemm(false, true, m, n, k, a, k, b, k, 0.0f, c, n);
                     }};
  Rate best = fastest_product({sgemm(512), sgemm(1024), sgemm(2048), grid}, budget);
  best.how = "the fastest product with " + std::to_string(omp_get_max_threads()) + " thread(s) per rank: " + best.how;
  return best;
}

// bf16 matrix FLOP/s, of the products a bf16 run uses: meshtrain's AVX512_BF16 kernel where
// it runs (ops/gemm_bf16.h), timed on sgemm_rate's two largest squares and the MLP's
// product; otherwise fp32's rate, as bf16 runs fp32 products of rounded operands there.
Rate bf16_rate(const MeasureOptions& o, double fp32, double budget) {
  if (!bf16_gemm_available()) return {fp32, "not measured, fp32's rate: bf16 runs " + bf16_gemm_description()};
  auto bf16 = [](int64_t m, int64_t n, int64_t k) {
    return Product{"gemm_bf16", m, n, k, [m, n, k](const float* a, const float* b, float* c) {
                     gemm_bf16(false, true, m, n, k, a, k, b, k, 0.0f, c, n);
                   }};
  };
  const auto [m, n, k] = mlp_shape(o);
  Rate best = fastest_product({bf16(1024, 1024, 1024), bf16(2048, 2048, 2048), bf16(m, n, k)}, budget);
  best.how = "measured: meshtrain's AVX512_BF16 kernel with " + std::to_string(omp_get_max_threads()) +
             " thread(s) per rank, the fastest of " + best.how;
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

}  // namespace

bool set_efficiency(Hardware& hw, double step_flops_per_s) {
  const bool raise = step_flops_per_s > hw.flops_fp32;
  if (raise) {
    for (double* x : {&hw.flops_bf16, &hw.flops_fp16})
      if (*x == hw.flops_fp32) *x = step_flops_per_s;  // no kernel of its own: fp32's rate, copied
    hw.flops_fp32 = step_flops_per_s;
  }
  hw.efficiency = step_flops_per_s / hw.flops_fp32;
  return raise;
}

namespace {

// efficiency: one forward + backward of the model at its micro-batch (halved until two
// steps fit the budget), its model FLOPs over (time x flops_fp32). Returns the micro-batch.
int measure_efficiency(Communicator& world, const MeasureOptions& o, double budget, Measured& m, const Say& say) {
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
  const double f32_products = hw.flops_fp32;
  const std::string raised =
      set_efficiency(hw, flops / t)
          ? " (above flops_fp32 as measured, " + gflops(f32_products) + ": flops_fp32 raised to this rate)"
          : "";
  if (!raised.empty())
    m.notes.field["flops_fp32"] += ";\nraised to a training step's model FLOP/s, which the products measured did not "
                                   "reach (see efficiency)";
  std::ostringstream s;
  s << "measured: forward + backward of " << cfg.family << " (" << cfg.n_layer << " layers, d_model " << cfg.d_model
    << ", " << cfg.n_head << " heads, seq_len " << cfg.seq_len << ", vocab " << cfg.vocab_size << ") at micro-batch "
    << B << (B < o.micro_batch ? " (reduced from " + std::to_string(o.micro_batch) + " to fit --seconds)" : "")
    << ": " << fmt("%.1f ms", t * 1e3) << " (fastest of " << reps << " after a warm-up"
    << (world.size() > 1 ? "; the slowest rank's" : "") << ")\nfor "
    << fmt("%.1f", flops / 1e9) << " GFLOP of model FLOPs (6 x " << fmt("%.4g", matmul_params(cfg))
    << " matmul parameters x tokens + 12 x layers x seq_len x d_model x tokens for attention) = "
    << gflops(flops / t) << " = " << fmt("%.3f", flops / t / hw.flops_fp32) << " of flops_fp32" << raised;
  m.notes.field["efficiency"] = s.str();
  return B;
}

// flops_bf16 where meshtrain's bf16 kernel runs. Its products run ~3x fp32's, but a bf16
// step's other work (norms, attention, the rounding passes) does not speed up with them, so
// the kernel's peak x the fp32 step's efficiency would predict a bf16 step far too fast
// (by ~45% on the benchmark GPT-2). This times a bf16 forward + backward of the same model
// at the same micro-batch and lowers flops_bf16 to its model FLOP/s / efficiency (never
// above the peak): the planner's peak x efficiency is then the bf16 step's measured rate.
void calibrate_bf16(Communicator& world, const MeasureOptions& o, int B, double budget, Measured& m, const Say& say) {
  Hardware& hw = m.hw;
  ModelConfig cfg = o.model;
  cfg.precision = "bf16";
  cfg.validate();
  say("measuring a bf16 training step at micro-batch " + std::to_string(B));
  int reps = 0;
  const double t = world_max(world, step_seconds(cfg, B, budget, &reps));
  const double rate = step_flops(cfg, B) / t, peak = hw.flops_bf16;
  hw.flops_bf16 = std::min(peak, rate / hw.efficiency);
  std::string& note = m.notes.field["flops_bf16"];
  note = "measured: a bf16 forward + backward of the same model at micro-batch " + std::to_string(B) + ": " +
         fmt("%.1f ms", t * 1e3) + " (fastest of " + std::to_string(reps) + ") = " + gflops(rate) +
         " of model FLOPs;\nflops_bf16 = that / efficiency, so that flops_bf16 x efficiency is a bf16 step's rate" +
         (rate / hw.efficiency > peak ? " (above the products' peak: the peak)" : "") + ".\nThe products alone: " +
         note.substr(std::string("measured: ").size());
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
  const size_t f32_line = m.summary.size();
  m.summary.push_back("flops_fp32    " + gflops(hw.flops_fp32));
  say("  " + m.summary.back());

  say("measuring bf16 matrix products (" + bf16_gemm_description() + ")");
  const Rate bf = bf16_rate(o, hw.flops_fp32, 0.1 * S);
  hw.flops_bf16 = world_min(world, bf.value);
  note["flops_bf16"] = bf.how + (bf.how.rfind("not", 0) == 0 ? "" : slowest);
  hw.flops_fp16 = hw.flops_fp32;
  note["flops_fp16"] = "not measured, fp32's rate: OpenBLAS has no fp16 matrix product";
  const size_t bf16_line = m.summary.size();
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

  // whether every rank runs the bf16 kernel (the same answer on all: calibrate_bf16 is collective)
  const bool bf16_kernel = world_min(world, bf16_gemm_available() ? 1.0 : 0.0) > 0;
  const double f32_products = hw.flops_fp32, bf16_products = hw.flops_bf16;
  const int B = measure_efficiency(world, o, (bf16_kernel ? 0.3 : 0.4) * S, m, say);
  if (hw.flops_fp32 != f32_products) {  // raised to the step's rate
    m.summary[f32_line] = "flops_fp32    " + gflops(hw.flops_fp32) + " (a training step's rate: the products ran slower)";
    if (hw.flops_bf16 != bf16_products) m.summary[bf16_line] = "flops_bf16    " + gflops(hw.flops_bf16) + " (fp32's)";
    m.summary[bf16_line + 1] = "flops_fp16    " + gflops(hw.flops_fp16) + " (fp32's)";
  }
  if (bf16_kernel) {
    calibrate_bf16(world, o, B, 0.1 * S, m, say);
    m.summary[bf16_line] = "flops_bf16    " + gflops(hw.flops_bf16) + " (a bf16 step's rate / efficiency)";
  }
  for (double* x : {&hw.flops_fp32, &hw.flops_bf16, &hw.flops_fp16, &hw.mem_bw, &hw.intra_node_bw, &hw.inter_node_bw,
                    &hw.latency_s, &hw.efficiency})
    *x = std::stod(fmt("%.4g", *x));  // measurements vary by more than 4 digits
  m.summary.push_back("efficiency    " + fmt("%.3f", hw.efficiency) + " (a training step's model FLOP/s / flops_fp32)");
  say("  " + m.summary.back());
  return m;
}

}  // namespace mt::plan
