// Context parallelism: each sequence split over the cp group, attention as a ring.
//
// Rank r holds chunks r and 2 cp - 1 - r of every sequence (nn/cp.h). Forward: the ranks
// pass their keys and values around the ring, rank r -> r + 1; at each of the cp steps a
// rank attends its queries to the block it holds, causally by sequence position, and
// merges the part into its output with the running log-sum-exp (ops/attention.h,
// attention_part_forward), while the next block is already on its way. Backward: the keys
// and values go round again, each with an accumulator of their gradient that collects every
// rank's part as it passes and arrives back at its owner after the last step.
//
//   step k:   hold kv of rank (r - k) mod cp   (k = 0: this rank's own)
//             post send of it to r + 1, receive the next from r - 1   (k < cp - 1)
//             attend: 2 query chunks x 2 key chunks (parts that see nothing are skipped)
//   backward: the same, the gradient accumulator sent on after each step's parts; the cp-th
//             send brings each accumulator home.
//
// Only keys and values travel (2 NKV D of each row's (NH + 2 NKV) D), packed. Messages go
// as posted point-to-point transfers from the caller's thread; a rank waiting longer than
// parallel.timeout_s ends the job naming the peer. The sums run in a fixed order: a cp run
// is deterministic. With training.device = cuda the blocks, accumulators and messages live
// in GPU memory (the allocator's): the parts run the CUDA kernels, packing is one strided
// device copy, and the communicator stages GPU messages through host memory.
#pragma once
#include "comm/communicator.h"
#include "nn/cp.h"

namespace mt {

class ContextParallel final : public CpMappings {
 public:
  // Buffers (two blocks of keys and values, their gradient accumulators and the packed
  // messages) are counted in alloc as communication buffers.
  ContextParallel(Communicator& cp, Allocator& alloc, double timeout_s) : cp_(cp), alloc_(alloc), timeout_s_(timeout_s) {}

  CpShard shard() const override { return {cp_.size(), cp_.rank()}; }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int n_head, int n_kv_head) override;
  // The ring's parts read fp32 only.
  bool takes_kept(const Tensor& kept, int n_head, int n_kv_head) const override {
    return cp_.size() == 1 && CpMappings::takes_kept(kept, n_head, n_kv_head);
  }

 private:
  struct Ring;  // one pass's geometry and buffers
  Tensor buffer(int i, int64_t n);  // workspace i of at least n floats, kept between calls
  // Waits for a posted transfer under the watchdog; `what` names it in the error.
  void wait(Communicator::Transfer& t, const char* what, int peer);

  Communicator& cp_;
  Allocator& alloc_;
  double timeout_s_;
  Tensor work_[8];
};

}  // namespace mt
