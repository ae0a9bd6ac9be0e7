// What the trainer needs from a data-parallel strategy (DDP or ZeRO): hooks on the model's
// units, the flat ranges the optimizer updates on this rank, the global gradient norm, and
// the parameter ranges this rank saves in a checkpoint.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "nn/model.h"
#include "parallel/optim_segment.h"

namespace mt {

// A range [begin, end) of one unit's parameters held by this rank (params points at begin).
struct ParamSlice {
  int unit;
  int64_t begin, end;
  float* params;
};

class DataParallel : public UnitHooks {
 public:
  // Before each micro-step's backward: true on the last micro-step of an optimizer step.
  virtual void set_sync(bool last_micro_step) = 0;
  // After the last micro-step's backward: gradients are reduced and ready.
  virtual void finish() = 0;
  virtual void zero_grad() = 0;
  // The segments this rank's optimizer updates (one per unit, in unit order).
  virtual std::vector<OptimSegment> optim_segments() = 0;
  // Per segment (unit), the sum of squares of its whole gradient over the strategy's ranks
  // (the same on every rank of the group; a tp or pp rank adds its own units' or shares').
  virtual std::vector<double> grad_sumsq(const std::vector<OptimSegment>& segments) = 0;
  // Per-tensor partial sums (LAMB's and LARS's norms) added over the ranks that hold the
  // other pieces of this rank's segments: ZeRO's shard group; none for DDP (whole units).
  virtual std::vector<double> sum_over_shards(std::vector<double> x) { return x; }
  // After the optimizer step: make the parameters every rank needs current again.
  virtual void after_step() {}
  // Fails unless every rank holds identical parameters.
  virtual void check_same_parameters() = 0;
  // The parameter range of each unit this rank keeps and updates (the optimizer's segment
  // u covers owned()[u]), and whether this rank writes them to checkpoints (replicas don't).
  virtual std::vector<ParamSlice> owned() = 0;
  virtual bool writes_checkpoint() const = 0;
  virtual std::string describe() const = 0;  // one line for the run header
  virtual uint64_t bytes_sent() const = 0;   // by this strategy's groups so far
  // Bytes sent between nodes so far by groups the strategy split off the data group (which
  // counts its own), where nodes are set (parallel.ranks_per_node, parallel.hierarchical).
  virtual uint64_t bytes_between_nodes() const { return 0; }
  // This rank's gradient-compression state (error-feedback residuals, PowerSGD's warm
  // start), named: checkpoints keep it per rank and restore it at the same layout. The
  // tensors are the live buffers (host memory, float32); none without compression.
  virtual std::vector<std::pair<std::string, Tensor>> compression_state() { return {}; }
};

// FNV-1a of a float buffer, to compare parameters across ranks.
uint64_t params_hash(const float* p, int64_t n, uint64_t h = 1469598103934665603ull);
// Fails unless every rank of `group` holds bit-identical whole units.
// A tensor's bytes in host memory, as floats (a copy, from the GPU too): for hashes.
std::vector<float> host_floats(const Tensor& t);
void check_same_units(Communicator& group, const std::vector<Unit>& units);
// Fails naming the first rank of `group` whose hash differs from rank 0's; `what` is what
// was hashed, `fix` what to do about it.
void check_same_hash(Communicator& group, uint64_t hash, const std::string& what,
                     const std::string& fix = "every rank must initialise identically (same training.seed, and the "
                                              "same model.init_from file or checkpoint on every node)");

}  // namespace mt
