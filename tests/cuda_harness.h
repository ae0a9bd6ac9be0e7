// What the GPU tests (tests/test_cuda_*.cpp) share: one device allocator, copies between
// host vectors and device tensors, outputs poisoned with NaN (an element an op fails to
// write fails the test), the relative error and the bit-for-bit comparison.
#pragma once
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/cuda.h"
#include "op_harness.h"

namespace mt::test {

// One device allocator for the whole program, never destroyed: blocks held by statics
// (tensors, the kernels' caches) may outlive it otherwise.
inline CudaAllocator& gpu() {
  static auto* a = new CudaAllocator();
  return *a;
}

inline Tensor to_dev(VecF v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::f32, gpu(), MemTag::activations);
  t.copy_from(tf(v, s));
  return t;
}
inline Tensor to_dev_i(std::vector<int32_t> v, const Shape& s) {
  Tensor t = Tensor::empty(s, DType::i32, gpu(), MemTag::activations);
  t.copy_from(ti(v, s));
  return t;
}
inline VecF to_host(const Tensor& t) {
  VecF v(t.numel());
  tf(v, t.shape()).copy_from(t);
  return v;
}
inline Tensor poisoned(const Shape& s) { return to_dev(VecF(shape_numel(s), kNaN), s); }

// ||got - ref|| / ||ref|| in double; infinite when the sizes differ or got holds an inf or
// NaN, so that it fails every `<` bound.
template <class V>
double rel_err(const VecF& got, const V& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = (double)got[i] - (double)ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  return std::sqrt(num) / std::sqrt(den + 1e-300);
}

inline bool same_bits(const VecF& a, const VecF& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace mt::test
