// Internal helpers shared by the CPU op implementations (not part of the public API).
//
// Determinism: every reduction here has a fixed structure that depends only on the
// element index (kLanes independent partial sums, combined in a fixed order), never on
// the thread count or on memory alignment. Loops are written so that GCC vectorises them
// at -O3 without -ffast-math (no reassociation is needed: each lane is its own sum).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/tensor.h"

namespace mt::detail {

// Partial sums per reduction: 32 floats = two AVX-512 registers, enough independent
// chains to hide the add latency on short rows.
constexpr int kLanes = 32;

// Combines kLanes partial sums in a fixed tree order.
inline float reduce_lanes(const float* acc) {
  float t[kLanes];
  std::memcpy(t, acc, sizeof(t));
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) t[j] += t[j + w];
  return t[0];
}

// sum_i x[i]
inline float sum_f32(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  for (int j = 0; j < kLanes && i < n; ++i, ++j) acc[j] += x[i];
  return reduce_lanes(acc);
}

// sum_i x[i] * y[i]
inline float dot_f32(const float* x, const float* y, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * y[i + j];
  for (int j = 0; j < kLanes && i < n; ++i, ++j) acc[j] += x[i] * y[i];
  return reduce_lanes(acc);
}

// max_i x[i] (n >= 1)
inline float max_f32(const float* x, int64_t n) {
  float acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = acc[j] > x[i + j] ? acc[j] : x[i + j];
  for (int j = 0; j < kLanes && i < n; ++i, ++j) acc[j] = acc[j] > x[i] ? acc[j] : x[i];
  float m = acc[0];
  for (int j = 1; j < kLanes; ++j) m = m > acc[j] ? m : acc[j];
  return m;
}

// exp(x) in float, branch-free so that loops calling it vectorise (glibc's expf does not
// without -ffast-math). Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and the
// Cephes degree-6 polynomial: about 1 ulp over the normal range. Returns 0 below -87.3
// (where expf would go subnormal) and saturates at exp(88.3) ~ 2e38 above (keeps 2^n
// finite); callers use it on arguments <= 0 (softmax) or where saturation is harmless.
inline float exp_f32(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  // Round x*log2(e) to the nearest integer with the 1.5*2^23 trick (no cvt rounding mode).
  const float shifter = 12582912.0f;
  const float t = xc * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n built from the exponent bits; n is in [-126, 127] after the clamp.
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  const float y = p * scale;
  return x < -87.3f ? 0.0f : y;
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|). Absolute error ~1e-7: fine for
// GELU, which adds tanh to 1 (the relative error of tiny results does not matter there).
inline float tanh_f32(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = exp_f32(-2.0f * ax);
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

// Rows of a tensor whose last dim is `cols` (leading dims fold into rows).
inline int64_t rows_of(const Tensor& t, int64_t cols, const char* what) {
  MT_CHECK(t.ndim() >= 1, what << " must have at least one dimension");
  MT_CHECK(cols > 0, what << ": the row width must be positive, got " << cols);
  MT_CHECK(t.dim(-1) == cols, what << " has last dimension " << t.dim(-1) << " (shape " << shape_str(t.shape())
                                   << "), expected " << cols);
  return t.numel() / cols;
}

inline void check_f32(const Tensor& t, const char* what) {
  MT_CHECK(t.defined(), what << " is an undefined tensor");
  MT_CHECK(t.dtype() == DType::f32, what << " must be f32, got " << dtype_name(t.dtype()));
  MT_CHECK(t.device() == Device::cpu, what << " must be on the CPU for the CPU ops");
}

inline void check_i32(const Tensor& t, const char* what) {
  MT_CHECK(t.defined(), what << " is an undefined tensor");
  MT_CHECK(t.dtype() == DType::i32, what << " must be i32, got " << dtype_name(t.dtype()));
}

inline void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << " has " << t.numel() << " elements (shape " << shape_str(t.shape())
                                << "), expected " << n);
}

// Fixed-size chunks for parallel loops over flat elements: the split (and with it which
// elements a vectorised loop body or its scalar tail handles) depends only on n, never on
// the thread count, so results are bit-identical for any number of threads.
constexpr int64_t kChunk = 4096;
inline int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

}  // namespace mt::detail
