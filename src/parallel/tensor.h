// Tensor parallelism's conjugate mappings over the tp group (Megatron's f and g, and the
// gather/scatter pair sequence parallelism uses), as named functions that each say what they
// do forward and backward. The model calls them through TpMappings (nn/tp.h); the TP plan
// (which parameter is split how) is data in nn/model.cpp.
//
//   mapping   forward                  backward
//   copy      identity                 all-reduce (sum) of the input gradient
//   reduce    all-reduce (sum)         identity
//   gather    all-gather along dim 0   reduce-scatter along dim 0
//   scatter   split along dim 0        all-gather along dim 0
//
// Every sum adds the ranks' terms in rank order (comm/communicator.h), so a tp run is
// deterministic; it differs from one rank only in how the split sums are rounded.
#pragma once
#include "comm/communicator.h"
#include "nn/tp.h"

namespace mt {

class TensorParallel final : public TpMappings {
 public:
  explicit TensorParallel(Communicator& tp) : tp_(tp) {}

  TpShard shard() const override { return {tp_.size(), tp_.rank()}; }
  void copy_backward(const Tensor& dx) override { tp_.allreduce(dx); }
  void reduce_forward(const Tensor& y) override { tp_.allreduce(y); }
  void sum(const Tensor& x) override { tp_.allreduce(x); }
  void max(const Tensor& x) override;
  void sum_over_kv_sharers(const Tensor& g, int sharers) override;

  Communicator& group() { return tp_; }

 private:
  Communicator& tp_;
  Tensor gathered_;  // [size, n] workspace of max and sum_over_kv_sharers
};

// Bytes one tp rank sends in the forward and backward of one micro-batch of B x T tokens,
// counted as Communicator::bytes_sent counts them (an all-reduce of n bytes 2 (N - 1) / N n,
// an all-gather (N - 1) n): per block two reductions of [B, T, C] forward (and again when
// recomputing) and two backward; the embedding's reduction and the head's input gradient;
// the loss's row statistics; key/value weight gradients summed over the ranks sharing a head.
double tp_bytes_per_micro_batch(const ModelConfig& cfg, const LocalDims& d, int tp, int64_t B, int64_t T,
                                bool recompute);

}  // namespace mt
