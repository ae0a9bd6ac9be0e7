#include "parallel/compress.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mt {

namespace {

constexpr int64_t K = Int8Reduction::kChunk;

// A range's block on the wire: [ceil(m / K) float scales][m int8 values].
struct Block {
  float* scale;
  int8_t* q;
  Block(void* p, int64_t m) : scale(static_cast<float*>(p)), q(reinterpret_cast<int8_t*>(scale + (m + K - 1) / K)) {}
  float at(int64_t i) const { return q[i] * scale[i / K]; }
};

// x[count] (the range's first count elements; the other m - count are zeros) into block b,
// leaving the residual x - deq(q(x)) in x. A chunk holding an inf or NaN gets scale NaN
// and values 0, so that it arrives as NaN (fp16's loss scaling then skips the step), and
// its residual is dropped.
void quantize(float* x, int64_t count, int64_t m, Block b) {
  for (int64_t lo = 0; lo < m; lo += K) {
    const int64_t hi = std::clamp<int64_t>(count, lo, lo + K);
    float amax = 0;
    bool finite = true;
    for (int64_t i = lo; i < hi; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const float scale = finite ? amax / 127 : NAN;
    b.scale[lo / K] = scale;
    std::fill(b.q + lo, b.q + std::min(lo + K, m), int8_t{0});
    if (!finite) {
      std::fill(x + lo, x + hi, 0.0f);
      continue;
    }
    if (scale == 0) continue;  // all zeros
    for (int64_t i = lo; i < hi; ++i) {
      const float v = std::clamp(std::nearbyint(x[i] / scale), -127.0f, 127.0f);
      b.q[i] = static_cast<int8_t>(v);
      x[i] -= v * scale;
    }
  }
}

}  // namespace

Allocator& compression_alloc(Communicator& group, Allocator& alloc) {
  if (alloc.device() == Device::cpu) return alloc;
  if (Allocator* host = group.options().alloc) return *host;
  return fallback_host_allocator();
}

Int8Reduction::Int8Reduction(int64_t numel, Communicator& group, Allocator& alloc, Mode mode, bool error_feedback)
    : group_(group), alloc_(alloc), mode_(mode), error_feedback_(error_feedback), n_(numel) {
  MT_CHECK(error_feedback || mode == Mode::reduce_scatter, "internal: an int8 all-reduce without error feedback");
  const int P = group.size();
  m_ = mode == Mode::reduce ? std::max<int64_t>(1, (numel + P * K - 1) / (P * K)) * K
                            : std::max<int64_t>(1, (numel + P - 1) / P);
  if (!error_feedback) return;  // no residual; the blocks are allocated per call
  worker_residual_ = Tensor::zeros({n_}, DType::f32, alloc, MemTag::comm);
  if (mode == Mode::reduce) owner_residual_ = Tensor::zeros({m_}, DType::f32, alloc, MemTag::comm);
  allocate_blocks();
}

void Int8Reduction::allocate_blocks() {
  const int P = group_.size();
  send_ = Tensor::empty({P * block_bytes() / 4}, DType::u32, alloc_, MemTag::comm);
  recv_ = Tensor::empty({P * block_bytes() / 4}, DType::u32, alloc_, MemTag::comm);
}

namespace {

// Elements of range k within n elements cut into ranges of m.
int64_t range_count(int64_t n, int64_t m, int k) { return std::clamp<int64_t>(n - k * m, 0, m); }

}  // namespace

void Int8Reduction::quantize_and_exchange(float* x) {
  for (int k = 0; k < group_.size(); ++k) {
    const int64_t count = range_count(n_, m_, k);
    quantize(count > 0 ? x + k * m_ : x, count, m_, Block(send_.data<uint32_t>() + k * (block_bytes() / 4), m_));
  }
  group_.alltoall_async(send_, recv_)->wait();
}

float Int8Reduction::owner_sum(int64_t i) const {
  const int64_t words = block_bytes() / 4;
  float acc = Block(recv_.data<uint32_t>(), m_).at(i);
  for (int k = 1; k < group_.size(); ++k) acc += Block(recv_.data<uint32_t>() + k * words, m_).at(i);
  return acc;
}

void Int8Reduction::reduce(float* g) {
  MT_CHECK(mode_ == Mode::reduce, "internal: Int8Reduction::reduce on a reduce-scatter");
  const int P = group_.size(), r = group_.rank();
  const int64_t words = block_bytes() / 4;
  auto block = [&](const Tensor& t, int k) { return Block(t.data<uint32_t>() + k * words, m_); };
  // 1. x = g + e_w, quantized per owner range; the residual stays in e_w.
  float* x = worker_residual_.f32();
  for (int64_t i = 0; i < n_; ++i) x[i] += g[i];
  quantize_and_exchange(x);
  // 2. The owner's sum over ranks in rank order, plus its residual, requantized.
  float* s = owner_residual_.f32();
  const int64_t mine = range_count(n_, m_, r);
  for (int64_t i = 0; i < mine; ++i) s[i] += owner_sum(i);  // = sum + e_s
  quantize(s, mine, m_, block(recv_, r));
  group_.allgather_async(recv_.view(r * words, {words}), recv_)->wait();
  // 3. Everyone's sums, dequantized: the same values on every rank.
  for (int k = 0; k < P; ++k) {
    const Block b = block(recv_, k);
    float* out = g + k * m_;
    for (int64_t i = 0; i < range_count(n_, m_, k); ++i) out[i] = b.at(i);
  }
}

void Int8Reduction::reduce_scatter(float* g) {
  MT_CHECK(mode_ == Mode::reduce_scatter, "internal: Int8Reduction::reduce_scatter on an all-reduce");
  float* x = g;  // without error feedback: quantized in place, g's errors dropped
  if (error_feedback_) {
    x = worker_residual_.f32();
    for (int64_t i = 0; i < n_; ++i) x[i] += g[i];
  } else {
    allocate_blocks();
  }
  quantize_and_exchange(x);
  float* out = g + group_.rank() * m_;
  for (int64_t i = 0; i < range_count(n_, m_, group_.rank()); ++i) out[i] = owner_sum(i);
  if (!error_feedback_) send_ = recv_ = Tensor();  // freed: only the unit being reduced holds blocks
}

}  // namespace mt
