#include "parallel/powersgd.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "nn/model.h"

namespace mt {

std::vector<PsgdMatrix> psgd_matrices(const std::vector<ParamSpec>& params, int64_t begin, int64_t end, int64_t at) {
  std::vector<PsgdMatrix> r;
  for (const ParamSpec& p : params) {
    if (p.shape.size() != 2) continue;
    const int64_t rows = p.shape[0], cols = p.shape[1];
    if (cols == 0) continue;
    // Rows [first, last) of the parameter start at or after begin and end at or before end.
    const int64_t first = std::clamp<int64_t>((begin - p.offset + cols - 1) / cols, 0, rows);
    const int64_t last = std::clamp<int64_t>(end > p.offset ? (end - p.offset) / cols : 0, 0, rows);
    if (last > first) r.push_back({at + p.offset + first * cols - begin, last - first, cols});
  }
  return r;
}

PowerSGDReduction::PowerSGDReduction(int64_t numel, const std::vector<PsgdMatrix>& matrices, int rank,
                                     Communicator& group, Allocator& alloc, uint64_t seed)
    : group_(group), n_(numel), r_(rank), seed_(seed) {
  MT_CHECK(rank >= 1, "parallel.powersgd_rank = " << rank << " must be at least 1");
  std::vector<PsgdMatrix> sorted = matrices;
  std::sort(sorted.begin(), sorted.end(), [](const PsgdMatrix& a, const PsgdMatrix& b) { return a.offset < b.offset; });
  int64_t at = 0;  // end of the last compressed matrix
  for (const PsgdMatrix& m : sorted) {
    MT_CHECK(m.offset >= at && m.offset + m.rows * m.cols <= n_, "internal: PowerSGD matrices overlap or leave the bucket");
    if (r_ >= std::min(m.rows, m.cols)) continue;  // would not shrink: sent as it is
    if (m.offset > at) plain_.emplace_back(at, m.offset);
    mats_.push_back({m, p_total_, q_total_, e_total_});
    p_total_ += m.rows * r_;
    q_total_ += m.cols * r_;
    e_total_ += m.rows * m.cols;
    at = m.offset + m.rows * m.cols;
  }
  if (at < n_) plain_.emplace_back(at, n_);
  for (const auto& [b, e] : plain_) plain_total_ += e - b;
  p_ = Tensor::empty({std::max<int64_t>(1, p_total_ + plain_total_)}, DType::f32, alloc, MemTag::comm);
  q_ = Tensor::empty({std::max<int64_t>(1, q_total_)}, DType::f32, alloc, MemTag::comm);
  residual_ = Tensor::empty({std::max<int64_t>(1, e_total_)}, DType::f32, alloc, MemTag::comm);
  residual_.zero_();
  for (const Mat& mat : mats_) init_q(mat);
}

// Q [cols x r] from the seed: standard normals, stream = the matrix's offset in the bucket.
void PowerSGDReduction::init_q(const Mat& mat) {
  const Philox rng{seed_};
  float* q = q_.f32() + mat.q_off;
  for (int64_t i = 0; i < mat.m.cols * r_; ++i) q[i] = static_cast<float>(rng.normal(mat.m.offset, i));
}

// Modified Gram-Schmidt in double, twice over each column for orthogonality to double
// precision; a column that vanishes (the input's rank below r) becomes zeros.
void PowerSGDReduction::orthonormalize(float* p, int64_t rows) const {
  const int r = r_;
  std::vector<double> a(rows * r);
  for (int64_t i = 0; i < rows * r; ++i) a[i] = p[i];
  for (int c = 0; c < r; ++c) {
    for (int pass = 0; pass < 2; ++pass)
      for (int j = 0; j < c; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < rows; ++i) dot += a[i * r + c] * a[i * r + j];
        for (int64_t i = 0; i < rows; ++i) a[i * r + c] -= dot * a[i * r + j];
      }
    double norm = 0;
    for (int64_t i = 0; i < rows; ++i) norm += a[i * r + c] * a[i * r + c];
    norm = std::sqrt(norm);
    const double inv = norm > 0 ? 1 / norm : 0;
    for (int64_t i = 0; i < rows; ++i) a[i * r + c] *= inv;
  }
  for (int64_t i = 0; i < rows * r; ++i) p[i] = static_cast<float>(a[i]);
}

void PowerSGDReduction::reduce(float* g) {
  const int r = r_;
  float* P = p_.f32();
  float* Q = q_.f32();
  float* E = residual_.f32();
  // 1-2. M' = M + E in place; P = M' Q [rows x r] per matrix; the uncompressed elements after.
  for (const Mat& mat : mats_) {
    const int64_t rows = mat.m.rows, cols = mat.m.cols;
    float* x = g + mat.m.offset;  // [rows x cols]
    const float* e = E + mat.e_off;
    if (error_feedback_)
      for (int64_t i = 0; i < rows * cols; ++i) x[i] += e[i];
    const float* q = Q + mat.q_off;
    float* p = P + mat.p_off;
    std::fill(p, p + rows * r, 0.0f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float v = x[i * cols + j];
        for (int c = 0; c < r; ++c) p[i * r + c] += v * q[j * r + c];
      }
  }
  int64_t off = p_total_;
  for (const auto& [b, e] : plain_) {
    std::copy(g + b, g + e, P + off);
    off += e - b;
  }
  if (p_total_ + plain_total_ > 0) group_.allreduce(p_.view(0, {p_total_ + plain_total_}));
  off = p_total_;
  for (const auto& [b, e] : plain_) {
    std::copy(P + off, P + off + (e - b), g + b);
    off += e - b;
  }
  if (mats_.empty()) return;
  // 3-4. P^ orthonormal; Q = M'^T P^ [cols x r], summed over ranks.
  for (const Mat& mat : mats_) {
    const int64_t rows = mat.m.rows, cols = mat.m.cols;
    float* p = P + mat.p_off;
    orthonormalize(p, rows);
    const float* x = g + mat.m.offset;
    float* q = Q + mat.q_off;
    std::fill(q, q + cols * r, 0.0f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float v = x[i * cols + j];
        for (int c = 0; c < r; ++c) q[j * r + c] += v * p[i * r + c];
      }
  }
  group_.allreduce(q_.view(0, {q_total_}));
  // 5-6. out = P^ Q^T, the same on every rank; E = M' - out / D.
  const float inv_d = 1.0f / static_cast<float>(group_.size());
  for (const Mat& mat : mats_) {
    const int64_t rows = mat.m.rows, cols = mat.m.cols;
    float* x = g + mat.m.offset;
    float* e = E + mat.e_off;
    const float* p = P + mat.p_off;
    const float* q = Q + mat.q_off;
    bool finite = true;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float out = 0;
        for (int c = 0; c < r; ++c) out += p[i * r + c] * q[j * r + c];
        finite = finite && std::isfinite(out);
        if (error_feedback_) e[i * cols + j] = x[i * cols + j] - out * inv_d;
        x[i * cols + j] = out;
      }
    if (!finite) {  // the same on every rank: out is
      std::fill(e, e + rows * cols, 0.0f);
      init_q(mat);
    }
  }
}

}  // namespace mt
