// The sums of the communicator's reductions (comm/communicator.h): in rank order, in float,
// rounded once. Used by communicator.cpp and hierarchical.cpp.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/half.h"
#include "core/tensor.h"

namespace mt::comm_sum {

inline bool is_reducible(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// The element types a reduction adds, each summed in float: f32 from its first term (as
// one would write it), bf16/f16 from zero and rounded once at the end.
struct F32 {
  using T = float;
  static float first(float x) { return x; }
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
struct Half {
  using T = uint16_t;
  static float first(uint16_t x) { return 0.0f + Widen(x); }
  static float load(uint16_t x) { return Widen(x); }
  static uint16_t store(float x) { return Narrow(x); }
};
using BF16 = Half<bf16_to_f32, f32_to_bf16>;
using F16 = Half<f16_to_f32, f32_to_f16>;

// out[i] = carry[i] + src[0][i] + src[1][i] + ... in that order (without a carry: from
// src[0][i], as E::first reads it), block by block so that `out` may be one of the sources
// (every element's terms are read before it is written). The sum goes to `partial` in
// float (which may be `carry`), to be carried on, or, when partial is null, to `out` in E's type.
template <class E>
inline void sum_in_order(const float* carry, const std::vector<const void*>& src, float* partial, void* out, int64_t n) {
  using T = typename E::T;
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    size_t k = 0;
    if (carry) {
      for (int64_t i = 0; i < m; ++i) acc[i] = carry[b + i];
    } else {
      const T* s0 = static_cast<const T*>(src[k++]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = E::first(s0[i]);
    }
    for (; k < src.size(); ++k) {
      const T* s = static_cast<const T*>(src[k]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] += E::load(s[i]);
    }
    if (partial) {
      std::copy_n(acc, m, partial + b);
      continue;
    }
    T* o = static_cast<T*>(out) + b;
    for (int64_t i = 0; i < m; ++i) o[i] = E::store(acc[i]);
  }
}

inline void sum_in_order(DType dt, const float* carry, const std::vector<const void*>& src, float* partial, void* out,
                  int64_t n) {
  switch (dt) {
    case DType::f32: sum_in_order<F32>(carry, src, partial, out, n); break;
    case DType::bf16: sum_in_order<BF16>(carry, src, partial, out, n); break;
    default: sum_in_order<F16>(carry, src, partial, out, n); break;
  }
}

}  // namespace mt::comm_sum
