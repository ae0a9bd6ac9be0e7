// Bytes per optimizer step on each axis of the mesh, as meshtrain communicates them, and
// the time they take on the cluster's links.
//
// Every count is one rank's bytes sent, the way Communicator::bytes_sent counts them (an
// all-reduce of n bytes over N ranks 2 (N - 1) / N n, a reduce-scatter (N - 1) / N n, an
// all-gather (N - 1) n of its n-byte piece, a point-to-point send its bytes): the
// bus-bandwidth factors are inside the bytes, so a collective's time is its bytes over the
// link's bus bandwidth. Ranks differ (a pipeline rank holds its stages, the
// first the embedding, the last the head): comm_bytes_rank counts one pipeline rank,
// comm_bytes the most any rank sends on each axis.
//
//   axis  what travels per step (m micro-batches per data-parallel rank)
//   tp    per micro-batch and block two all-reduces of the [b, T, C] activations forward
//         (again in each block that recomputes: recompute = full or N) and two backward,
//         the embedding's forward reduction and the head's input gradient, the
//         vocabulary-parallel loss's row statistics, the key/value weight gradients of
//         heads several ranks share; with sequence
//         parallelism the same bytes as all-gathers and reduce-scatters plus the norms'
//         and biases' gradient sums and the norm outputs gathered again in backward
//         (parallel/tensor.h); per step the gradient norm's per-unit sums
//   cp    per micro-batch and block the ring's keys and values, cp - 1 sends forward (again
//         in each block that recomputes) and backward, and their gradient accumulators cp times
//         (parallel/context.h)
//   pp    per micro-batch the activation to the next stage and the input gradient to the
//         previous one, at each stage boundary between ranks ([b, T / cp, C], T / (cp tp)
//         positions with sequence parallelism); the tied embedding's gradient between the
//         first and last stage; the loss's and gradient norm's sums
//   dp    over the data group (dp x cp ranks: gradients are reduced over both): DDP one
//         all-reduce of the gradients per step in grad_comm_dtype (buckets of bucket_mb);
//         ZeRO 1 a reduce-scatter per step and the parameters' all-gather after the update;
//         ZeRO 2 a reduce-scatter per micro-batch (no full gradient is kept) and the
//         all-gather; ZeRO 3 the reduce-scatter per micro-batch and the parameters'
//         all-gathers: with pipelining once per step per unit, else per micro-batch before
//         forward and (reshard_after_forward) again before backward; HYBRID_SHARD adds the
//         all-reduce of each gradient shard over the shard groups' replicas; the loss's
//         sum (and ZeRO's gradient norm sums)
// ZeRO moves parameters in the working precision and gradients in the gradient precision,
// or fp32 gradients in a 16-bit grad_comm_dtype (ZeRO with grad_compression = int8: one
// all-to-all of int8 blocks per unit instead of the reduce-scatter); DDP's all-reduce uses
// grad_comm_dtype.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace mt {
struct Unit;  // nn/model.h
}

namespace mt::plan {

// The [parallel] keys that change what the data-parallel strategies send.
struct TrafficOptions {
  std::string grad_comm_dtype = "fp32";  // parallel.grad_comm_dtype: fp32 gradients' reductions (fp32 | bf16 | fp16)
  bool reshard_after_forward = true;     // parallel.reshard_after_forward (ZeRO 3 without pipelining)
  double bucket_mb = 25;                 // parallel.bucket_mb: DDP's buckets (messages, the last one's tail)
  bool hierarchical = false;             // parallel.hierarchical: DDP's buckets by node
  int ranks_per_node = 0;                // its nodes' data-parallel ranks; 0: all of them on one node
  std::string grad_compression = "none";  // parallel.grad_compression: none | int8 | powersgd
  int powersgd_rank = 4;                 // parallel.powersgd_rank
  std::string pp_layers = "auto";        // parallel.pp_layers: blocks per stage (which units a rank reduces)
  std::string optim = "adamw";           // optim.name: LAMB and LARS sum two norms per tensor over its holders
};

// DDP's reduction of one bucket of n elements (the units `units` as tp rank 0 holds them)
// over a data group of D ranks under grad_compression int8 or powersgd, hierarchically by
// node, or both (exact inside the node, compressed between nodes: parallel/ddp.h): the bytes data-parallel rank 0 sends (as the communicator counts them), its
// collectives, the buffers it keeps for the bucket, and the communicator's staging it needs
// (bytes).
struct BucketReduction {
  double bytes = 0, messages = 0, buffers = 0, staging = 0;
  double staging_across = 0;  // hierarchical with compression: the group across the nodes' staging
};
BucketReduction bucket_reduction(const ModelConfig& model, int tp, const std::vector<int>& units, double n, double D,
                                 const TrafficOptions& opt, double elem_bytes);

// ZeRO under HYBRID_SHARD with grad_compression: the compressed all-reduce of unit `unit`'s
// chunk (shard rank 0's, elements [0, min(ceil(n / S), n))) over the R replicas of its shard
// (parallel/zero.h): int8's all-reduce, or PowerSGD on the chunk's whole rows of each matrix.
BucketReduction chunk_reduction(const ModelConfig& model, int tp, int unit, double S, double R,
                                const TrafficOptions& opt);

// Bytes per gradient element ZeRO's reductions move over a data group of data_ranks ranks
// (parallel/zero.h): fp32 gradients in grad_comm_dtype (fp32, bf16 or fp16; throws otherwise),
// 16-bit gradients in their own dtype; a group of one moves none and rounds nothing.
double zero_reduction_bytes(const Precisions& prec, const std::string& grad_comm_dtype, double data_ranks);

// ZeRO's int8 reduce-scatter of one unit of n elements over a shard group of S ranks
// (Int8Reduction::Mode::reduce_scatter, parallel/compress.h): one all-to-all of the chunks'
// blocks, 4 ceil(c / 1024) + c rounded up to 4 bytes each (c = ceil(n / S)); buffers: the
// residual [n] floats (stage 1's error feedback only) and the send and receive blocks
// (kept at stage 1, only during the call at stages 2-3).
BucketReduction int8_reduce_scatter(double n, double S, bool error_feedback = true);

// Bytes one rank sends per optimizer step on each axis: per axis the most any pipeline rank
// sends. Throws mt::Error when the layout cannot run the model (a tp that does not divide
// the heads, fewer blocks than pipeline stages, a global batch that does not split).
CommBytes comm_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec,
                     const std::string& grad_comm_dtype = "fp32");
CommBytes comm_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec, const TrafficOptions& opt);

// One rank's traffic on one group per step: bytes sent and messages (collectives, or
// point-to-point sends), each message paying the link's latency once.
struct Flow {
  double bytes = 0, messages = 0;
  Flow& operator+=(const Flow& o) {
    bytes += o.bytes, messages += o.messages;
    return *this;
  }
};
Flow operator*(double k, const Flow& f);

// A pipeline rank's traffic per step, by group. The data group's traffic is split by the
// communicator it uses: `shard` is the ZeRO shard group (all of the data group unless
// HYBRID_SHARD; DDP's all-reduce too), `replicate` HYBRID_SHARD's replicas.
struct RankTraffic {
  Flow tp, cp, pp, shard, replicate;
  Flow pp_after;  // the part of pp sent after backward: the sums, the tied embedding's gradient
  CommBytes bytes() const { return {shard.bytes + replicate.bytes, tp.bytes, pp.bytes, cp.bytes}; }
};
RankTraffic comm_traffic(const ModelConfig& model, const Layout& layout, const Precisions& prec, int pp_rank,
                         const TrafficOptions& opt = {});
CommBytes comm_bytes_rank(const ModelConfig& model, const Layout& layout, const Precisions& prec, int pp_rank,
                          const TrafficOptions& opt = {});

// ---- What a pipeline rank holds --------------------------------------------------------

// One chunk of a pipeline rank: virtual stage `stage`, blocks [first_layer, end_layer).
struct ChunkShare {
  int stage = 0, first_layer = 0, end_layer = 0;
  bool embed = false, head = false;
  int blocks() const { return end_layer - first_layer; }
};

// The pipeline as meshtrain cuts it: `chunks` (v; the schedule's default when the layout
// leaves 1 for interleaved or zbv), the placement (zbv: V, else loop) and the blocks of each
// stage (pipeline_layers of parallel.pp_layers: auto or a list). Throws mt::Error naming
// parallel.pp_layers when a list does not fit the layout's stages.
struct PipelineShape {
  int pp = 1, chunks = 1, micro = 1;
  bool vee = false;
  std::vector<std::vector<ChunkShare>> ranks;  // [pp][chunks]
  int stages() const { return pp * chunks; }
};
PipelineShape pipeline_shape(const ModelConfig& model, const Layout& layout, const std::string& pp_layers = "auto");

// model_layout(model, TpShard{tp, 0}), kept: a search asks for the same few many times
// (the parameters' names make it the costliest part of weighing a layout). Throws as
// model_layout does.
std::shared_ptr<const std::vector<Unit>> planned_units(const ModelConfig& model, int tp);

// The elements of each unit (0 embedding, 1..L blocks, L + 1 final norm and head) one tp
// rank holds, by the TP plan (model_layout): split weights' shares, replicated norms, the
// vocabulary padded to a multiple of tp. The same on every tp rank.
std::vector<double> unit_numels(const ModelConfig& model, int tp);
// The units pipeline rank `chunks` reduces, each with the chunk whose backward finishes
// it: its blocks, the embedding on the first stage, the final unit on the last, and on a
// last stage without the first, the tied head's copy of the embedding (unit 0).
struct HeldUnit {
  int unit, chunk;
};
std::vector<HeldUnit> held_units(const ModelConfig& model, const std::vector<ChunkShare>& chunks);

// The data group's traffic of one pipeline rank, by when it is sent (the step time needs
// the when; comm_traffic sums it into shard and replicate).
struct DataPlan {
  // A DDP bucket (whole units, about bucket_mb, launched when its last unit's backward is
  // done) or a ZeRO unit's reduce-scatter, tagged with the chunk whose backward finishes
  // it; in launch (backward) order.
  struct Reduction {
    int chunk;
    Flow flow;
  };
  std::vector<Reduction> reductions;
  bool every_micro = false;  // ZeRO 2-3: the reductions follow every micro-batch's backward; else once per step
  // ZeRO 3: the parameters' all-gathers of one forward pass (every unit held; a tied head
  // gathers the embedding again when resharding) and of one backward pass (again, when
  // resharding); with pipelining the forward's alone, once per step. first_gather: the
  // first unit's, which nothing prefetches.
  Flow gather_forward, gather_backward, first_gather;
  bool gather_every_micro = false;
  Flow after_step;  // ZeRO 1-2: the updated parameters' all-gather
  Flow replica;     // HYBRID_SHARD: each gradient shard's all-reduce over the replicas (replicate group)
  Flow scalars;     // the loss's sum; ZeRO's gradient norm sums over the shard group
};
DataPlan data_plan(const ModelConfig& model, const Layout& layout, const Precisions& prec, const TrafficOptions& opt,
                   const std::vector<ChunkShare>& chunks);

// ---- The tensor-parallel and context-parallel traffic of one micro-batch ---------------

// One micro-batch of b sequences through one chunk, split by the action that sends it:
// forward, the input half of backward (with the recomputed forward's reductions), the
// weight half. A whole backward (B) sends bi + bw.
struct ActionFlows {
  Flow f, bi, bw;
  Flow total() const {
    Flow t = f;
    t += bi;
    t += bw;
    return t;
  }
};
// tp: with fp32 activations and gradients, exactly tp_bytes_per_micro_batch (parallel/tensor.h)
// of this chunk.
ActionFlows tp_flows(const ModelConfig& model, const Layout& layout, const Precisions& prec, const ChunkShare& chunk);
// cp: the ring's sends (parallel/context.h).
ActionFlows cp_flows(const ModelConfig& model, const Layout& layout, const Precisions& prec, const ChunkShare& chunk);
// Bytes of one stage-boundary message (an activation or its gradient, one micro-batch).
double pp_message_bytes(const ModelConfig& model, const Layout& layout, const Precisions& prec);

// ---- Links ---------------------------------------------------------------------------

// The link a group of ranks uses. Ranks are numbered ((pp_i dp + dp_i) cp + cp_i) tp + tp_i
// and fill nodes of cluster.gpus_per_node in order. A group of `size` ranks `stride` apart
// stays inside a node when its stride x size block is aligned inside one (every such
// group then is), or when the whole mesh fits in one node; otherwise it crosses the
// network, and the slowest group sets the pace. Inside a node a rank has intra_node_bw. The
// network is the node's: inter_node_bw per GPU, shared by the node's ranks, so a collective
// whose ring has g members in each node gets g x inter_node_bw per ring (never more than
// intra_node_bw); a point-to-point send gets its own GPU's inter_node_bw.
struct Link {
  double bw = 0;          // bytes/s of bus bandwidth per rank
  bool network = false;   // crosses nodes
  int per_node = 1;       // the group's members in one node
};
Link group_link(int stride, int size, int world, const Cluster& cluster, bool point_to_point = false);

// Each axis's group: tp (stride 1), cp (tp), the data group dp x cp (tp; the shard group
// under HYBRID_SHARD), HYBRID's replicas (tp x shard), pp (tp cp dp, point-to-point).
struct AxisLinks {
  Link tp, cp, shard, replicate, pp;
};
AxisLinks axis_links(const Layout& layout, const Cluster& cluster);

// Seconds a flow takes on a link: bytes / bandwidth + messages x hw.latency_s. Throws
// mt::Error when the link's bandwidth is missing from the profile.
double flow_time(const Flow& f, const Link& link, const Hardware& hw);

// Seconds each axis's traffic of one rank takes on its links (a rank's RankTraffic).
CommBytes comm_time(const RankTraffic& traffic, const Layout& layout, const Cluster& cluster);
// The same from bytes alone (no message latency): bytes over each axis's link (dp over the
// shard group's).
CommBytes comm_time(const CommBytes& bytes, const Layout& layout, const Cluster& cluster);

}  // namespace mt::plan
