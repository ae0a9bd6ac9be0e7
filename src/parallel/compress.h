// int8 gradient compression (parallel.grad_compression = int8): DDP's all-reduce and ZeRO
// 1's reduce-scatter with error feedback, ZeRO 2's and 3's reduce-scatter without it.
//
// One Int8Reduction per gradient bucket (DDP) or unit (ZeRO 1) of n elements, over a group
// of P ranks. The n elements are cut into P owner ranges of m elements (the tail past n
// counts as zeros); each chunk of kChunk elements of a range has its own scale,
// max |x| / 127, and each element travels as round(x / scale) in [-127, 127]. DDP
// (reduce): m = n / P rounded up to whole chunks,
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
// ZeRO 1 (reduce_scatter): m = ZeRO's chunk, ceil(n / P), so that range r is what rank r
// owns and updates. Steps 1 and 2 without the requantization: the owner keeps its float
// sum s (no e_s), and no rank needs the others' sums (ZeRO 1 all-gathers the parameters
// after the step). Bytes per rank and unit: one all-to-all, (P - 1) block_bytes(), with
// block_bytes() = 4 ceil(m / kChunk) + m rounded up to 4, about a quarter of the fp32
// reduce-scatter's (P - 1) 4m.
//
// ZeRO 2-3 (reduce_scatter, error_feedback = false): step 1 on g itself (g is the unit's
// communication buffer, quantized in place), the owner's float sum as ZeRO 1's. No residual
// is kept, so each call's rounding is dropped: a residual would be [n] floats per unit on
// every rank, the 4Ψ that the gradient sharding of these stages saves. The send and receive
// blocks, 2 P block_bytes(), are allocated for the call and freed after it. Same bytes as
// ZeRO 1's, per call (every micro-step).
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

// The allocator for a compressed reduction's buffers and state: `alloc` where the model
// lives on the host; with the model on the GPU (training.device = cuda), host memory (the
// group's communication allocator, which counts them under MemTag::comm): int8's and
// PowerSGD's arithmetic runs on the host, over gradients copied there and back.
Allocator& compression_alloc(Communicator& group, Allocator& alloc);

class Int8Reduction {
 public:
  static constexpr int64_t kChunk = 1024;  // elements per scale
  enum class Mode { reduce, reduce_scatter };
  // error_feedback = false (reduce_scatter only): no residual is kept (none allocated), and
  // the send and receive blocks exist only during a call.
  Int8Reduction(int64_t numel, Communicator& group, Allocator& alloc, Mode mode = Mode::reduce,
                bool error_feedback = true);
  // Mode::reduce: g[numel], this rank's gradient in, the compressed sum over the group out
  // (blocking).
  void reduce(float* g);
  // Mode::reduce_scatter: g[numel], this rank's gradient in; out, the group's sum of range
  // r (this rank's) in g[r m, min((r + 1) m, numel)), the rest left as it was (blocking;
  // without error feedback the rest holds the quantization errors: g is scratch).
  void reduce_scatter(float* g);
  int64_t range() const { return m_; }  // elements each rank owns (padded)
  // Bytes of one rank's range on the wire: one float scale per chunk, then the int8
  // values (padded to whole 4-byte words).
  int64_t block_bytes() const { return 4 * ((m_ + kChunk - 1) / kChunk) + (m_ + 3) / 4 * 4; }
  // The error-feedback residuals (e_w [n], and for reduce e_s [m]), named, to checkpoint and
  // restore.
  std::vector<std::pair<std::string, Tensor>> state() const {
    if (!error_feedback_) return {};
    if (mode_ == Mode::reduce_scatter) return {{"worker_residual", worker_residual_}};
    return {{"worker_residual", worker_residual_}, {"owner_residual", owner_residual_}};
  }

 private:
  void allocate_blocks();
  void quantize_and_exchange(float* x);  // step 1: x (g + e_w, or g) quantized, the all-to-all
  float owner_sum(int64_t i) const;  // step 2: element i of this rank's range, summed in rank order

  Communicator& group_;
  Allocator& alloc_;
  Mode mode_;
  bool error_feedback_;
  int64_t n_, m_;
  Tensor worker_residual_;  // [n] this rank's e_w (error feedback only)
  Tensor owner_residual_;   // reduce: [m] e_s of the range this rank owns
  Tensor send_, recv_;      // [P x block] as u32 words: the ranges for their owners / from every rank
  Tensor sum_;              // [m] the owner's float sum
};

}  // namespace mt
