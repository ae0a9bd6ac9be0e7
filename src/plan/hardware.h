// Hardware profiles for the planner: the built-in GPUs (A100 40/80 GB, H100 SXM, H200),
// profile files (TOML), and the measured profile of this machine (`meshtrain bench profile`).
//
//   Hardware h = hardware_get("h100");                 // a built-in profile (or an alias)
//   Hardware m = hardware_get("hardware_profile.toml"); // a profile file
//   std::string text = hardware_to_toml(h);            // hardware_read(file of text) == h
//
// A profile file is one [hardware] table holding every field of struct Hardware (plan.h):
//
//   [hardware]
//   name = "h100"
//   gpu = true
//   flops_fp32 = 6.7e13      # dense matrix FLOP/s per device, fp32
//   flops_bf16 = 9.89e14     # dense matrix FLOP/s per device, bf16
//   flops_fp16 = 9.89e14     # dense matrix FLOP/s per device, fp16
//   mem_bytes = 8e10         # device memory, bytes
//   mem_bw = 3.35e12         # device memory bandwidth, bytes/s
//   intra_node_bw = 4.5e11   # bytes/s per device to the others of its node, one direction
//   inter_node_bw = 5e10     # bytes/s per device across nodes, one direction
//   latency_s = 5e-06        # seconds per collective or point-to-point message
//   efficiency = 0.5         # fraction of peak FLOP/s a step's matrix work reaches
//
// Missing, mistyped or unknown fields, and numbers outside a field's range (far wider than any
// device: FLOP/s 1e6..1e18, mem_bytes 1e6..1e15, bandwidths 1e3..1e15 bytes/s, latency_s
// 0..10, efficiency 1e-4..1; hardware.cpp), are errors naming the field, the file, the unit
// and the range.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "plan/plan.h"

namespace mt::plan {

// The built-in profiles' names: "a100-40gb", "a100-80gb", "h100", "h200".
std::vector<std::string> hardware_builtin_names();

// A built-in profile by name or alias (case does not matter; "_" reads as "-"): a100 and
// a100-sxm are a100-80gb; h100-sxm, h100-80gb are h100; h200-sxm, h200-141gb are h200.
// Anything else is read as a profile file (hardware_read). Throws mt::Error for an
// unknown name, listing the built-ins and saying that a FILE.toml works too.
Hardware hardware_get(const std::string& name_or_file);

// Reads a profile file. Throws mt::Error naming the file and the field that is missing,
// has a bad value (saying what the field holds and its unit), or is not a field.
Hardware hardware_read(const std::string& path);

// What a profile file holds for hw, exactly (every number reads back to the same double).
// notes: comment lines written above the table (header) and beside a field (by field name).
struct HardwareNotes {
  std::vector<std::string> header;
  std::map<std::string, std::string> field;
};
std::string hardware_to_toml(const Hardware& hw, const HardwareNotes& notes = {});

// ---- measuring this machine ------------------------------------------------------------

// Seconds per operation of one collective on `group` (the slowest rank's mean over `iters`
// operations after one warm-up): op is allreduce, allgather, reduce_scatter or broadcast
// (root 0), on a buffer of `count` elements of `dtype` in all (a multiple of the group's
// size; allgather and reduce_scatter exchange count / size per rank). Every rank of the
// group must call it with the same arguments. `meshtrain bench comm` prints these. The
// buffers come from `alloc` (GPU memory for bench comm --device cuda); null: host memory.
double comm_op_seconds(Communicator& group, CommOp op, int64_t count, DType dtype, int iters,
                       Allocator* alloc = nullptr);

// nccl-tests' bus-bandwidth factor of a collective on n ranks: 2(n-1)/n for allreduce,
// (n-1)/n for allgather and reduce_scatter, 1 for broadcast.
double comm_bus_factor(CommOp op, int n);

struct MeasureOptions {
  double seconds = 20;  // about how long the measurements take in all
  // The model whose forward + backward calibrates `efficiency`, and its micro-batch
  // (sequences). Default: the core benchmark model (configs/gpt2_bench.toml).
  ModelConfig model = benchmark_model();
  int micro_batch = 8;
  static ModelConfig benchmark_model();
};

// A measured profile and how each value was found (notes for hardware_to_toml).
struct Measured {
  Hardware hw;
  HardwareNotes notes;
  std::vector<std::string> summary;  // one line per measurement, for the command to print
};

// Sets efficiency from a training step's measured model FLOP/s. A step faster than the
// products measured means they were timed in a slower spell (a neighbour's, on a shared
// machine): flops_fp32 is then raised to the step's rate (and flops_bf16 and flops_fp16
// with it where they hold fp32's rate), efficiency is 1, and true is returned; either way
// flops_fp32 x efficiency is the step's rate, what the planner's compute time follows.
bool set_efficiency(Hardware& hw, double step_flops_per_s);

// Measures this machine as a profile of one device per rank: every rank of `world` calls
// it; ranks measure at once, as they train, and each rate is the slowest rank's.
// `progress` (rank 0 only; may be empty) is called with a line before each measurement.
Measured hardware_measure(Communicator& world, const MeasureOptions& opts,
                          const std::function<void(const std::string&)>& progress = {});

}  // namespace mt::plan
