// PowerSGD gradient compression for DDP (parallel.grad_compression = powersgd), rank r
// (parallel.powersgd_rank), with error feedback and warm start.
//
// One PowerSGDReduction per gradient bucket of n elements over a dp group of D ranks. The
// bucket's 2-D parameters are matrices M (rows x cols, row-major as stored); a matrix with
// r >= min(rows, cols) would not shrink and travels uncompressed with the 1-D tensors
// (biases, norm weights). On rank k, per matrix, with E_k its residual and Q its warm-start
// factor (cols x r, the same on every rank):
//
//   1. M'_k = M_k + E_k
//   2. P = sum over ranks of M'_k Q        (rows x r; one all-reduce of every matrix's P
//                                           and the uncompressed elements together)
//   3. P^ = P with orthonormal columns     (Gram-Schmidt in double, the same on every rank
//                                           since P is)
//   4. Q = sum over ranks of M'_k^T P^     (cols x r; one all-reduce of every matrix's Q)
//   5. out = P^ Q^T                        (= P^ P^^T sum_k M'_k: the projected sum)
//   6. E_k = M'_k - out / D                (PowerSGD's memory: this rank's input minus its
//                                           share of the reduced approximation)
//
// DDP's reduction is a sum (each rank scaled its loss by 1 / the global batch's tokens),
// so out is the compressed sum, not a mean. Summed over ranks, the residuals are exactly
// sum_k M'_k - out: what a step does not send is carried into the next, and over steps the
// sum of the outputs equals the sum of the true gradients minus the residuals now held.
// Q stays from the step before (warm start); it starts as standard normals from a fixed
// seed, identical on every rank. Every rank computes out from the same all-reduced P^ and
// Q with the same loops, so every rank ends with identical gradients.
//
// A step whose gradients hold an inf or NaN (fp16 loss scaling skips it) leaves NaN in out
// on every rank; the residuals and Q are then restarted (0 and the seed's normals) so they
// do not poison the next steps.
//
// Bytes per rank and step: the all-reduces of sum (rows r) + uncompressed elements and of
// sum (cols r), each 2 (D - 1) / D x 4 bytes per element. The residuals and Q are per-rank
// state: checkpoints keep each rank's (state()), and a run resumed at the same layout
// continues bit for bit; at another layout they restart (0 and the seed's normals).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt {

struct PsgdMatrix {
  int64_t offset = 0;  // elements into the bucket
  int64_t rows = 0, cols = 0;
};

struct ParamSpec;  // nn/model.h

// The rows of a unit's 2-D parameters (row-major as stored) that lie whole in [begin, end)
// of its flat buffer, as matrices at offsets from begin plus at: the whole unit (0, numel),
// or a ZeRO chunk's share of each weight matrix (HYBRID_SHARD compresses chunks).
std::vector<PsgdMatrix> psgd_matrices(const std::vector<ParamSpec>& params, int64_t begin, int64_t end,
                                      int64_t at = 0);

class PowerSGDReduction {
 public:
  // numel: the bucket's elements; matrices: its 2-D parameters, not overlapping; rank >= 1.
  PowerSGDReduction(int64_t numel, const std::vector<PsgdMatrix>& matrices, int rank, Communicator& group,
                    Allocator& alloc, uint64_t seed = 0x50535344);
  // g[numel]: this rank's gradient in, the compressed sum over the group out (blocking).
  void reduce(float* g);
  // Elements in the two all-reduces of a step: the P factors and uncompressed elements,
  // then the Q factors.
  int64_t p_elements() const { return p_total_ + plain_total_; }
  int64_t q_elements() const { return q_total_; }
  int compressed_matrices() const { return static_cast<int>(mats_.size()); }
  // Tests: turn the residuals off (E stays 0) to show what error feedback does.
  void set_error_feedback(bool on) { error_feedback_ = on; }
  // The warm-start Q factors and the residuals, named, to checkpoint and restore.
  std::vector<std::pair<std::string, Tensor>> state() const { return {{"q", q_}, {"residual", residual_}}; }

 private:
  struct Mat {
    PsgdMatrix m;
    int64_t p_off, q_off, e_off;  // into P, Q (the warm-start state) and the residuals
  };
  void init_q(const Mat& mat);
  void orthonormalize(float* p, int64_t rows) const;  // p[rows x r]: columns in place

  Communicator& group_;
  int64_t n_;
  int r_;
  uint64_t seed_;
  bool error_feedback_ = true;
  std::vector<Mat> mats_;
  std::vector<std::pair<int64_t, int64_t>> plain_;  // [begin, end) of uncompressed elements
  int64_t p_total_ = 0, q_total_ = 0, e_total_ = 0, plain_total_ = 0;
  Tensor p_;         // [p_total + plain_total]: the P factors, then the uncompressed elements
  Tensor q_;         // [q_total]: the Q factors (warm start: kept from step to step)
  Tensor residual_;  // [e_total]: E_k of every compressed matrix
};

}  // namespace mt
