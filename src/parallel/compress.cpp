#include "parallel/compress.h"

#include <algorithm>
#include <cmath>

namespace mt {

namespace {

constexpr int64_t K = Int8Reduction::kChunk;

// A range's block on the wire: [m / K float scales][m int8 values].
struct Block {
  float* scale;
  int8_t* q;
  Block(void* p, int64_t m) : scale(static_cast<float*>(p)), q(reinterpret_cast<int8_t*>(scale + m / K)) {}
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
    std::fill(b.q + lo, b.q + lo + K, int8_t{0});
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

Int8Reduction::Int8Reduction(int64_t numel, Communicator& group, Allocator& alloc) : group_(group), n_(numel) {
  const int P = group.size();
  m_ = std::max<int64_t>(1, (numel + P * K - 1) / (P * K)) * K;
  worker_residual_ = Tensor::empty({n_}, DType::f32, alloc, MemTag::comm);
  owner_residual_ = Tensor::empty({m_}, DType::f32, alloc, MemTag::comm);
  worker_residual_.zero_();
  owner_residual_.zero_();
  send_ = Tensor::empty({P * block_bytes() / 4}, DType::u32, alloc, MemTag::comm);
  recv_ = Tensor::empty({P * block_bytes() / 4}, DType::u32, alloc, MemTag::comm);
}

void Int8Reduction::reduce(float* g) {
  const int P = group_.size(), r = group_.rank();
  const int64_t words = block_bytes() / 4;
  auto count = [&](int k) { return std::clamp<int64_t>(n_ - k * m_, 0, m_); };  // of range k within the bucket
  auto block = [&](const Tensor& t, int k) { return Block(t.data<uint32_t>() + k * words, m_); };
  // 1. x = g + e_w, quantized per owner range; the residual stays in e_w.
  float* x = worker_residual_.f32();
  for (int64_t i = 0; i < n_; ++i) x[i] += g[i];
  for (int k = 0; k < P; ++k) quantize(count(k) > 0 ? x + k * m_ : x, count(k), m_, block(send_, k));
  group_.alltoall_async(send_, recv_)->wait();
  // 2. The owner's sum over ranks in rank order, plus its residual, requantized.
  float* s = owner_residual_.f32();
  const int64_t mine = count(r);
  for (int64_t i = 0; i < mine; ++i) {
    float acc = block(recv_, 0).at(i);
    for (int k = 1; k < P; ++k) acc += block(recv_, k).at(i);
    s[i] += acc;  // = acc + e_s
  }
  quantize(s, mine, m_, block(recv_, r));
  group_.allgather_async(recv_.view(r * words, {words}), recv_)->wait();
  // 3. Everyone's sums, dequantized: the same values on every rank.
  for (int k = 0; k < P; ++k) {
    const Block b = block(recv_, k);
    float* out = g + k * m_;
    for (int64_t i = 0; i < count(k); ++i) out[i] = b.at(i);
  }
}

}  // namespace mt
