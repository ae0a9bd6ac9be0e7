// Step time: each pipeline action's compute and synchronous communication, the schedule
// simulated with those costs (bubble included), the data-parallel reduction's overlap with
// backward, the step's tail; then tokens/s and MFU.
//
// Compute, per rank and micro-batch of b sequences (t = b T / cp tokens on the rank), in
// FLOPs, at hw.flops(precision) x hw.efficiency:
//   block forward   2 W t  (W: the block's matrix weights this tp rank holds: q|k|v, the
//                   output projection, the MLP's two or three matrices)
//                   + 2 t T NH_l D  causal attention: scores and values against T / 2
//                   earlier positions on average (NH_l: this rank's query heads)
//   block backward  input half 2 W t + attention backward (fused: 5 t T NH_l D, the
//                   probabilities recomputed block by block; materialized: 4 t T NH_l D);
//                   weight half 2 W t
//   recompute       full: one more block forward inside the input half (N: in the first N
//                   blocks of each chunk); selective: the
//                   attention forward again (nothing with fused attention, which keeps no
//                   probabilities to drop)
//   head            2 V_l C t forward, as much for the input gradient and the weight
//                   gradient (V_l: this rank's padded vocabulary rows); never recomputed
//   embedding, norms, activations: no matrix work (the efficiency absorbs them)
// and, in bytes through memory at hw.mem_bw (memory-bound: not matrix work), the
// materialized attention's [b, NH_l, T, T] tensors (training.attention = materialized,
// without context parallelism), as its kernels move them per head and sequence: forward
// 4 T^2 elements (the causal half of the scores written, read for the maximum, read and
// written by the exponentials and the normalisation, the zeros above the diagonal written,
// the probabilities read by the product with the values), backward 4.5 T^2 (the
// probabilities read twice, their gradient written and read three times), and the forward
// again when recomputing; in the activation precision.
// Synchronous communication on the critical path, added to the action that waits for it:
// tensor parallelism's collectives (tp_flows), the context-parallel ring's transfers beyond
// the attention parts they overlap (cp_flows). A stage-boundary transfer takes its bytes
// over the pp link from the send; the receiver waits only if it comes later than needed.
//
// Overlap of the data group's traffic (the rule meshtrain's strategies follow):
// - DDP and ZeRO 1 reduce once per step: a chunk's buckets (units) launch while its last
//   backward (B or BW) of the step runs; a rank's reductions share one link in launch
//   order. A chunk's reductions start no earlier than that backward starts, and the last
//   bucket (unit) of the chunk only after it ends: free = max(free, start) + t_chunk, then
//   free = max(free, end + t_last). The rank is done at max(last compute, free).
// - ZeRO 2 and ZeRO 3 with pipelining reduce-scatter after every micro-batch's backward:
//   the same rule over every backward action.
// - ZeRO 3 without pipelining gathers each unit before its forward and (resharding) before
//   its backward, the next unit prefetched while this one computes: a forward takes
//   max(compute, gathers) + the first unit's gather; a backward max(compute, gathers +
//   reduce-scatters) + the last unit's reduce-scatter. With pipelining the gathers run once
//   per step before a rank's first forwards: the rank starts late by what its first
//   forwards do not hide, plus the first unit's gather.
// - After every rank is done, in sequence (the slowest rank's): ZeRO 1-2's parameter
//   all-gather, HYBRID_SHARD's replica all-reduce, the tied embedding's gradient sum, the
//   loss's and gradient norm's sums, and the optimizer's update (memory-bound: the bytes
//   AdamW reads and writes per element over hw.mem_bw).
#pragma once
#include <string>
#include <vector>

#include "parallel/schedule_sim.h"
#include "plan/comm.h"

namespace mt::plan {

// Model FLOPs per token, the numerator of MFU: 6 x the matrix weights (every block's
// projections and the head's V x C) plus causal attention 6 L T C (2 L T C forward); no
// recomputation.
double model_flops_per_token(const ModelConfig& model);

// The work one rank does for one micro-batch through one chunk, by action (see above).
struct ChunkWork {
  double f = 0, bi = 0, bw = 0;  // FLOPs (bi includes the recomputed forward)
  double mem_f = 0, mem_bi = 0;  // bytes through memory (the materialized attention's T x T tensors)
};
ChunkWork chunk_work(const ModelConfig& model, const Layout& layout, const Precisions& prec, const ChunkShare& chunk);

// What each pipeline action costs, per virtual stage, in seconds.
struct StageCosts {
  std::vector<double> f, b, bi, bw;  // [stages] compute and its synchronous communication
  double p2p = 0;                    // one stage-boundary transfer
  std::vector<double> rank_start;    // [pp] when each rank can start (ZeRO 3's gathers with pipelining)
};
// with_comm = false: compute alone (no transfers, nothing gathered), the bubble's costs.
StageCosts stage_costs(const ModelConfig& model, const Layout& layout, const Cluster& cluster,
                       const Precisions& prec, const TrafficOptions& opt = {}, bool with_comm = true);

// A schedule's timeline under per-stage costs. Each rank runs its list in order from its
// start; a compute action takes its stage's cost; a send is posted at once and its data
// arrives p2p later; a receive ends when its data has arrived. With p2p = 0 and costs
// that are ActionCosts' (kind x stage weight), step and bubble are schedule_simulate's.
// Schedules are made, checked and replayed once per (name, pp, chunks, micro) and kept, so
// a 64-rank pipeline of 512 micro-batches simulates again in milliseconds.
struct PipelineRun {
  double step = 0;                   // the last action's end
  double bubble = 0;                 // 1 - compute / (pp x step), as the simulator counts it
  std::vector<double> busy;          // [pp] compute seconds per rank
  std::vector<double> end;           // [pp] each rank's last action's end
  std::vector<std::vector<TimedAction>> ranks;  // [pp] the timelines (as kept)
};
// What of the timelines to keep: nothing, the actions that finish weight gradients (B, BW),
// or every action.
enum class Keep { none, weights, all };
PipelineRun pipeline_run(const std::string& schedule, int pp, int chunks, int micro, const StageCosts& costs,
                         Keep keep = Keep::all);

// The layout's pipeline timeline with its predicted costs, as a Simulation (for pictures:
// schedule_svg). costs holds the first rank's per-chunk costs as ActionCosts would.
Simulation pipeline_simulation(const ModelConfig& model, const Layout& layout, const Cluster& cluster,
                               const Precisions& prec, const TrafficOptions& opt = {});

// The step: compute_s (the busiest rank's forward, backward and recompute), the bubble of
// the compute-only timeline, each axis's communication time (the busiest rank's, on its
// links), exposed communication (step - compute-only timeline - optimizer), step_s,
// tokens_per_s (global_batch x seq_len / step) and mfu (model_flops_per_token x tokens /
// (step x ranks x peak)). Throws mt::Error for a layout meshtrain refuses (recompute with
// a split backward) or that does not divide the model, and for a profile without the peak
// or bandwidth it needs.
Timing step_time(const ModelConfig& model, const Layout& layout, const Cluster& cluster, const Precisions& prec,
                 const TrafficOptions& opt = {});

}  // namespace mt::plan
