// meshtrain bench comm: in the spirit of nccl-tests. For each collective and message size:
// time per operation, algorithm bandwidth (bytes / time) and bus bandwidth (algbw times the
// fraction of the data each rank must move: 2(n-1)/n for allreduce, (n-1)/n for allgather
// and reduce_scatter, 1 for broadcast), comparable across rank counts. --device cuda puts the
// buffers on the GPUs (each rank on its machine's GPUs round robin) and carries them as a
// training run would (parallel.gpu_comm: NCCL where every rank has its own GPU).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "comm/mesh.h"
#include "comm/nccl_comm.h"
#include "core/cuda.h"
#include "core/error.h"
#include "plan/hardware.h"  // comm_op_seconds, comm_bus_factor
#include "train/device_state.h"  // use_local_gpu

namespace mt {

namespace {

constexpr const char* kUsage = "usage: meshtrain launch -n N bench comm [--min-bytes 1K] [--max-bytes 64M] [--iters 20] "
                                "[--dtype f32|bf16] [--device cpu|cuda] [--gpu-comm auto|nccl|host]";

int64_t parse_size(const std::string& s) {  // 1K, 64M, 1G: bytes, at most 16G (each rank holds buffers of this size)
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  const std::string unit = end;
  const std::string units = "kmg";  // K, M, G: the powers of 1024
  const size_t power = unit.size() == 1 ? units.find(static_cast<char>(std::tolower(unit[0]))) : std::string::npos;
  if (power != std::string::npos) v *= std::pow(1024.0, static_cast<double>(power + 1));
  MT_CHECK(end != s.c_str() && (unit.empty() || power != std::string::npos) && std::isfinite(v) && v >= 0 &&
               v <= 16.0 * 1024 * 1024 * 1024,
           "bench comm: bad size " << s << ": write e.g. 1K, 64M or 1G, at most 16G");
  return static_cast<int64_t>(v);
}

// The options, read alike on every rank.
struct BenchCommOptions {
  int64_t min_bytes = 1024, max_bytes = 64 << 20;
  int iters = 20;
  DType dtype = DType::f32;
  std::string device = "cpu", gpu_comm = "auto";
  bool help = false;
};

BenchCommOptions comm_options(const std::vector<std::string>& args) {
  BenchCommOptions o;
  // Each option and what its value sets: the one list of the options there are.
  const std::map<std::string, std::function<void(const std::string&)>> options = {
      {"--min-bytes", [&](const std::string& v) { o.min_bytes = parse_size(v); }},
      {"--max-bytes", [&](const std::string& v) { o.max_bytes = parse_size(v); }},
      {"--iters",
       [&](const std::string& v) {
         char* end = nullptr;
         const long n = std::strtol(v.c_str(), &end, 10);
         MT_CHECK(end != v.c_str() && *end == '\0' && n >= 1 && n <= 1000000,
                  "bench comm: --iters " << v << ": give a whole number from 1 to 1000000");
         o.iters = static_cast<int>(n);
       }},
      {"--dtype",
       [&](const std::string& v) {
         MT_CHECK(v == "f32" || v == "fp32" || v == "bf16", "bench comm: --dtype " << v << ": use f32 (fp32) or bf16");
         o.dtype = v == "bf16" ? DType::bf16 : DType::f32;
       }},
      {"--device",
       [&](const std::string& v) {
         MT_CHECK(v == "cpu" || v == "cuda", "bench comm: --device " << v << ": use cpu or cuda");
         o.device = v;
       }},
      {"--gpu-comm", [&](const std::string& v) {
         MT_CHECK(v == "auto" || v == "nccl" || v == "host", "bench comm: --gpu-comm " << v << ": use auto, nccl or host");
         o.gpu_comm = v;
       }}};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    const auto option = options.find(a);
    MT_CHECK(option != options.end(), "bench comm: unknown option " << a << "; " << kUsage);
    MT_CHECK(i + 1 < args.size(), "bench comm: option " << a << " needs a value");
    option->second(args[++i]);
  }
  MT_CHECK(o.min_bytes >= 4 && o.max_bytes >= o.min_bytes, "bench comm: --min-bytes " << o.min_bytes << " and --max-bytes "
                                                           << o.max_bytes << ": need 4 <= min-bytes <= max-bytes");
  // (train refuses parallel.gpu_comm on the CPU alike)
  MT_CHECK(o.gpu_comm == "auto" || o.device == "cuda", "bench comm: --gpu-comm " << o.gpu_comm << " carries GPU "
                                                       << "buffers, but --device is cpu; add --device cuda, or leave "
                                                       << "--gpu-comm out");
  return o;
}

}  // namespace

int cmd_bench_comm(const std::vector<std::string>& args, Communicator& world) {
  BenchCommOptions o;
  agreed(world, [&] { o = comm_options(args); });  // a bad option: said once, no rank aborted
  if (o.help) {
    if (world.rank() == 0) std::printf("%s\n", kUsage);
    return 0;
  }
  const int n = world.size();
  const size_t es = dtype_size(o.dtype);
  // The buffers' memory, and the group that carries them (on the GPU, as training does).
  std::unique_ptr<CudaAllocator> gpu;
  std::string how;
  if (o.device == "cuda") {
    MT_CHECK(cuda_device_count() > 0, "bench comm --device cuda: no GPU is visible here (cudaGetDeviceCount found "
                                      "none, or this meshtrain was built without CUDA); use --device cpu");
    use_local_gpu();
    gpu = std::make_unique<CudaAllocator>();
  }
  CpuAllocator host;
  Allocator& buffers = gpu ? static_cast<Allocator&>(*gpu) : host;
  buffers.set_advice("lower --max-bytes (each rank holds a buffer of that size and one of 1/" + std::to_string(n) +
                     " of it)");
  Mesh mesh(world, n, 1, 1);
  if (gpu) how = attach_gpu_comm(mesh, o.gpu_comm, *gpu);
  Communicator& group = mesh.dp();
  if (world.rank() == 0) {
    std::printf("# meshtrain bench comm: %d ranks, %s, %d iterations per size (time is the slowest rank's mean)\n", n,
                dtype_name(o.dtype), o.iters);
    if (gpu) std::printf("# GPU buffers (%s)%s%s\n", cuda_device_name(0).c_str(), how.empty() ? "" : "; ", how.c_str());
    std::printf("%14s %12s  %-15s %12s %12s %12s\n", "size (B)", "count", "op", "time (us)", "algbw (GB/s)",
                "busbw (GB/s)");
  }
  const CommOp ops[] = {CommOp::allreduce, CommOp::allgather, CommOp::reduce_scatter, CommOp::broadcast};
  int64_t last_count = 0;
  for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
    const int64_t count = std::max<int64_t>(n, bytes / es / n * n);  // divisible by n
    if (count == last_count) continue;  // small sizes rounded up to the same count: measured once
    last_count = count;
    for (CommOp op : ops) {
      const double per_op = plan::comm_op_seconds(group, op, count, o.dtype, o.iters, &buffers);
      const double data = static_cast<double>(count * es);  // nccl-tests: the full buffer's size
      const double algbw = data / per_op / 1e9;
      if (world.rank() == 0)
        std::printf("%14lld %12lld  %-15s %12.1f %12.3f %12.3f\n", static_cast<long long>(count * es),
                    static_cast<long long>(count), comm_op_name(op), per_op * 1e6, algbw,
                    algbw * plan::comm_bus_factor(op, n));
    }
  }
  return 0;
}

}  // namespace mt
