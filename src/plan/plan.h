// The planner's vocabulary (`meshtrain plan`): a layout, the precisions it trains in, a
// cluster of devices with a hardware profile, and what the planner predicts for them:
// memory per rank by tag, bytes per step on each axis, step time. One file per part:
//   memory.*    bytes per rank by tag (model states per ZeRO stage, activations per
//               schedule and recompute, communication buffers), meshtrain's own and the
//               published formulas (ZeRO, Korthikanti et al.)
//   comm.*      bytes per step on each axis and their time on the cluster's links
//   time.*      compute time, the pipeline bubble from the schedule simulator, step time,
//               tokens/s and MFU
//   hardware.*  built-in profiles (A100 40/80 GB, H100 SXM, H200), profile files, and the
//               measured profile of this machine (`meshtrain bench profile`)
//   search.*    every valid layout for a model and cluster, ranked, with the reason each
//               rejected family fails
// Bytes are doubles (1T-parameter models overflow nothing), times seconds, rates per second.
#pragma once
#include <cstdint>
#include <set>
#include <string>

#include "nn/model_config.h"

namespace mt::plan {

// The training precision: fp32 keeps everything in fp32; bf16 and fp16 keep fp32 master
// parameters and optimizer moments, 16-bit working parameters and activations, and
// gradients in fp32 unless grad_dtype says the working precision.
struct Precisions {
  std::string name = "fp32";  // fp32 | bf16 | fp16
  double param = 4;           // bytes per working parameter
  double grad = 4;            // bytes per gradient element
  double master = 0;          // bytes per fp32 master parameter (0 when the working copy is fp32)
  double moment = 4;          // bytes per optimizer moment element
  double activation = 4;      // bytes per activation element
  double kept = 4;            // bytes per element of the activations a block keeps in its kept dtype (BlockActs)
  // "fp32" | "bf16" | "fp16"; grad_working: gradients kept in the working precision
  // (training.grad_dtype = bf16), the ZeRO paper's 2Ψ + 2Ψ + 12Ψ. Throws mt::Error otherwise.
  // of(): the papers' convention, every activation and activation message in 16 bits.
  static Precisions of(const std::string& name, bool grad_working = false);
  // What meshtrain itself holds and sends: the same model states, but activations (the
  // residual stream, workspaces, logits) and their messages in fp32, and only the tensors a
  // block keeps (BlockActs' kept) in the working precision. `meshtrain plan` and the
  // trainer's own prediction use this.
  static Precisions trained(const std::string& name, bool grad_working = false);
};

// A parallel layout and the batch it trains. Fields mirror the [parallel] and [training]
// configuration keys.
struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  int chunks = 1;                   // parallel.pp_chunks (v)
  std::string schedule = "1f1b";    // parallel.pp_schedule (a built-in name)
  int zero = 0;                     // 0 (DDP) .. 3
  int shard_group = 0;              // ranks sharing one copy of the sharded states; 0: all of dp
  bool sequence_parallel = false;   // parallel.sequence_parallel
  // none | selective | full | N (the first N blocks of each model chunk; meshtrain trains
  // none, full and N: training.recompute and training.recompute_blocks)
  std::string recompute = "none";
  int64_t micro_batch = 1;          // sequences per micro-batch on each rank
  int64_t global_batch = 1;         // sequences per optimizer step, whole mesh
  std::set<std::string> named;      // fields a --layout text set (the others may be searched)

  int ranks() const { return dp * tp * pp * cp; }
  int64_t micro_batches() const { return global_batch / (dp * micro_batch); }  // m per step
  int shard() const { return zero == 0 ? 1 : (shard_group > 0 ? shard_group : dp * cp); }
  std::string text() const;  // "dp=8,tp=8,pp=16,cp=1,v=1,schedule=1f1b,zero=1,sp=0,recompute=full,mb=1,gb=1024"
  // The blocks that recompute their forward in backward (none and selective: none, since
  // selective recomputes no block; full: every block; N: the first N of each chunk).
  Recompute recomputed() const;
};

// A layout's recompute field for the engine's choice: none, full, or the count of blocks.
std::string recompute_text(Recompute r);

// Parses "tp=8,pp=16,dp=8,zero=1,..." (keys as text() writes them; also micro_batch,
// global_batch, chunks, sequence_parallel) onto base, recording the keys named. Throws
// mt::Error naming a bad key or value.
Layout layout_parse(const std::string& text, Layout base = {});

// A device's capabilities. Rates are per device; link bandwidths one direction.
struct Hardware {
  std::string name;
  bool gpu = true;  // false: a CPU, whose communication copies take the cores that compute, so the
                    // planner overlaps no communication with compute
  double flops_fp32 = 0, flops_bf16 = 0, flops_fp16 = 0;  // dense matrix FLOP/s peak
  double mem_bytes = 0;        // device memory
  double mem_bw = 0;           // bytes/s
  double intra_node_bw = 0;    // bytes/s per device to the others of its node (NVLink; shared memory)
  double inter_node_bw = 0;    // bytes/s per device across nodes (network)
  double latency_s = 0;        // per collective or point-to-point message
  double efficiency = 0.5;     // calibrated fraction of peak a step's matrix work reaches
  double flops(const std::string& precision) const;
};

struct Cluster {
  int gpus = 1;
  int gpus_per_node = 8;
  Hardware hw;
};

// Bytes per rank (the rank that needs the most), by the allocator's tags.
struct Memory {
  double params = 0, grads = 0, optim = 0, activations = 0, comm = 0;
  double other = 0;  // mixed precision's fp32 staging (MemTag::other; see memory.h)
  double peak = 0;  // what the rank needs at once: not always the sum (see memory.h)
};

// Bytes one rank sends per optimizer step on each axis.
struct CommBytes {
  double dp = 0;  // gradient reduction and ZeRO gathers over dp (x cp)
  double tp = 0;  // tensor-parallel all-reduces / all-gathers / reduce-scatters
  double pp = 0;  // activations and gradients between stages
  double cp = 0;  // the context-parallel ring
};

struct Timing {
  double compute_s = 0;    // one rank's forward, backward and recompute work per step
  double bubble = 0;       // pipeline idle fraction of the step (the simulator's)
  CommBytes comm_s;        // time each axis's traffic takes on its links
  double exposed_comm_s = 0;  // communication not hidden behind compute
  double step_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;          // model FLOPs (6N + attention, no recompute) / (step · ranks · peak)
};

struct Prediction {
  Layout layout;
  bool fits = true;
  std::string why_not;  // when it does not fit or cannot run: what is wrong
  Memory memory;
  CommBytes comm;
  Timing time;
};

}  // namespace mt::plan
