// Tensor parallelism's conjugate mappings over the tp group (Megatron's f and g, and the
// pair sequence parallelism uses), as named functions that each say what they do forward
// and backward. The model calls them through TpMappings (nn/tp.h); the TP plan (which
// parameter is split how) is data in nn/model.cpp.
//
//   mapping          forward                  backward                  model calls
//   copy             identity                 all-reduce of the grad    copy_backward
//   reduce           all-reduce               identity                  reduce_forward
//   gather           all-gather along T       reduce-scatter along T    gather_sequence, then
//                                                                       reduce_scatter_sequence on the grad
//   reduce-scatter   reduce-scatter along T   all-gather along T        the same two, the other way round
//
// (Megatron also has scatter, split forward / all-gather backward, to enter the
// sequence-parallel region from a replicated tensor; here the only such entry is the
// vocabulary-parallel embedding, whose partial sums are reduce-scattered instead.)
//
// Every sum adds the ranks' terms in rank order (comm/communicator.h), so a tp run is
// deterministic; it differs from one rank only in how the split sums are rounded.
#pragma once
#include "comm/communicator.h"
#include "nn/model.h"
#include "nn/tp.h"

namespace mt {

class TensorParallel final : public TpMappings {
 public:
  // sequence_parallel: the mappings around the split layers become gather (all-gather along
  // the sequence / reduce-scatter) and reduce-scatter (reduce-scatter along the sequence /
  // all-gather), which move the same bytes as the all-reduces they replace.
  // Workspaces (the sequence pieces rank by rank, gathered row statistics) are counted in
  // alloc as communication buffers.
  TensorParallel(Communicator& tp, Allocator& alloc, bool sequence_parallel = false)
      : tp_(tp), alloc_(alloc), sp_(sequence_parallel) {}

  TpShard shard() const override { return {tp_.size(), tp_.rank()}; }
  void copy_backward(const Tensor& dx) override { tp_.allreduce(dx); }
  void reduce_forward(const Tensor& y) override { tp_.allreduce(y); }
  void sum(const Tensor& x) override { tp_.allreduce(x); }
  void max(const Tensor& x) override;
  void sum_over_kv_sharers(const Tensor& g, int sharers) override;
  bool sequence_parallel() const override { return sp_ && tp_.size() > 1; }
  void gather_sequence(const Tensor& full, const Tensor& local) override;
  void reduce_scatter_sequence(const Tensor& local, const Tensor& full) override;

 private:
  // A workspace of at least n floats, kept and grown between calls.
  Tensor workspace(Tensor& w, int64_t n);
  // gathered[size, n] from every rank's x[n].
  Tensor gather_all(const Tensor& x);

  Communicator& tp_;
  Allocator& alloc_;
  bool sp_;
  Tensor gathered_;  // [size, n]: every rank's row statistics or key/value gradients
  Tensor ranked_;    // [size, B, T / size, C]: the sequence pieces rank by rank
};

// The element-wise work between the collectives, on the host or the GPU (where the tensors
// are): out[n] = the maximum over the `size` rows of all [size, n] (std::max from row 0 on);
// out[n] = the sum of rows first .. first + count - 1 of all, in row order; full [B, T, C]
// to (to_ranked) or from ranked [size, B, T / size, C], rank r's positions of every sequence
// together. The same bits on both devices.
void max_over_ranks(const Tensor& out, const Tensor& all, int size);
void sum_over_ranks(const Tensor& out, const Tensor& all, int first, int count);
void reorder_sequence(const Tensor& full, const Tensor& ranked, int size, bool to_ranked);

// Bytes one tp rank sends in the forward and backward of one micro-batch of B x T tokens,
// counted as Communicator::bytes_sent counts them (an all-reduce of n bytes 2 (N - 1) / N n,
// a reduce-scatter of n bytes (N - 1) / N n, an all-gather of n bytes per rank (N - 1) n):
// per block two reductions of [B, T, C] forward (again in each block that recomputes) and
// two backward; the embedding's reduction and the head's input gradient; the loss's row
// statistics; key/value weight gradients summed over the ranks sharing a head. With
// sequence parallelism the same bytes move as all-gathers and reduce-scatters (each half an
// all-reduce: a block's two column-parallel inputs are gathered and its two row-parallel
// outputs reduce-scattered forward, the reverse backward; the embedding's output is
// reduce-scattered and the head's input gathered), plus the sums of the norms' and the
// row-parallel biases' gradients and the position embedding's gradient rows, and the
// gathers of each block's two norm outputs again in backward (kept as [B, T / tp, C]).
// A pipeline rank (share) counts only its chunks' blocks, the embedding's terms where it
// holds the first stage and the head's, the loss's and the final norm's where it holds the
// last (default: the whole model).
double tp_bytes_per_micro_batch(const ModelConfig& cfg, const LocalDims& d, int tp, int64_t B, int64_t T,
                                Recompute recompute, bool sequence_parallel, const ModelShare& share = {});

}  // namespace mt
