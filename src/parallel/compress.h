// int8 gradient compression for DDP (parallel.grad_compression = int8), with error feedback.
//
// One Int8Reduction per gradient bucket of n elements, over a dp group of P ranks. The
// bucket is cut into P owner ranges of m elements (m = n / P rounded up to whole chunks of
// kChunk elements; the tail past n counts as zeros). Each chunk has its own scale,
// max |x| / 127, and each element travels as round(x / scale) in [-127, 127]:
//
//   1. worker:  x = g + e_w;  send q(x) range r to rank r;  e_w = x - deq(q(x))
//   2. owner:   s = sum over ranks, in rank order, of deq(their q) + e_s  (float)
//               send q(s) to every rank;  e_s = s - deq(q(s))
//   3. every rank: g = deq(q(s)) over all ranges, the same values everywhere
//
// So both the ranks' quantization and the owner's requantization of the sum keep their
// errors (e_w per rank over the bucket, e_s per owner over its range) and add them to the
// next step's values: what one step drops is sent later, and the sum of the outputs over
// steps stays within (P + 1) half-steps of the sum of the true gradients. Bytes per rank
// and bucket: an all-to-all and an all-gather of m (1 + 4 / kChunk) bytes per rank's range,
// 2 (P - 1) m (1 + 4 / kChunk), about a quarter of the fp32 all-reduce's 2 (P - 1) / P x 4n.
//
// Not exact by design: training tracks the uncompressed run within a band (README). The
// residuals are per-rank state: checkpoints keep each rank's (state()), and a run resumed
// at the same layout continues bit for bit; at another layout they restart at 0.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt {

class Int8Reduction {
 public:
  static constexpr int64_t kChunk = 1024;  // elements per scale
  Int8Reduction(int64_t numel, Communicator& group, Allocator& alloc);
  // g[numel]: this rank's gradient in, the compressed sum over the group out (blocking).
  void reduce(float* g);
  int64_t range() const { return m_; }  // elements each rank owns (padded)
  // Bytes of one rank's range on the wire: int8 values and one float scale per chunk.
  int64_t block_bytes() const { return m_ + 4 * (m_ / kChunk); }
  // The error-feedback residuals e_w [n] and e_s [m], named, to checkpoint and restore.
  std::vector<std::pair<std::string, Tensor>> state() const {
    return {{"worker_residual", worker_residual_}, {"owner_residual", owner_residual_}};
  }

 private:
  Communicator& group_;
  int64_t n_, m_;
  Tensor worker_residual_;  // [n] this rank's e_w
  Tensor owner_residual_;   // [m] e_s of the range this rank owns
  Tensor send_, recv_;      // [P x block] as u32 words: the ranges for their owners / from every rank
  Tensor sum_;              // [m] the owner's float sum
};

}  // namespace mt
