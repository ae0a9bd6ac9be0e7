// The op harness's shared parts: float64 references, finite differences, the tolerance rule
// and the thread-count check (see tests/test_ops.cpp for what they check and why the
// tolerances hold; tests/test_attention.cpp and tests/test_ops_tp.cpp use them too).
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "core/tensor.h"

namespace mt::test {

using VecF = std::vector<float>;
using VecD = std::vector<double>;


constexpr double kRtol = 1e-4, kAtol = 1e-5;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

inline VecF randv(size_t n, std::mt19937& g, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  VecF v(n);
  for (auto& x : v) x = u(g);
  return v;
}
inline VecD to_d(const VecF& v) { return VecD(v.begin(), v.end()); }
inline Tensor tf(VecF& v, const Shape& s) { return Tensor::wrap(v.data(), s, DType::f32); }
inline Tensor ti(std::vector<int32_t>& v, const Shape& s) { return Tensor::wrap(v.data(), s, DType::i32); }
inline double dot(const VecD& a, const VecD& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// got vs ref at the given indices (all when idx is empty); `base` is subtracted from got
// (the value an accumulating output held before the op).
inline void expect_close(const VecF& got, const VecD& ref, const char* what, const std::vector<size_t>& idx = {},
                         double base = 0.0) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double maxabs = 0;
  for (double r : ref) maxabs = std::max(maxabs, std::fabs(r));
  int bad = 0;
  const size_t n = idx.empty() ? ref.size() : idx.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = idx.empty() ? k : idx[k];
    const double g = (double)got[i] - base, tol = kRtol * std::fabs(ref[i]) + kAtol * maxabs + 1e-30;
    if (!(std::fabs(g - ref[i]) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", reference " << ref[i] << " (tol " << tol << ")";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " elements out of tolerance";
}

// Central differences of f at x in double, at the given indices (all when idx is empty).
inline VecD fd_grad(const std::function<double(const VecD&)>& f, VecD x, const std::vector<size_t>& idx = {}) {
  const double eps = 1e-6;
  VecD g(x.size(), 0.0);
  const size_t n = idx.empty() ? x.size() : idx.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = idx.empty() ? k : idx[k];
    const double v = x[i];
    x[i] = v + eps;
    const double fp = f(x);
    x[i] = v - eps;
    const double fm = f(x);
    x[i] = v;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

inline std::vector<size_t> sample_idx(size_t n, size_t k, std::mt19937& g) {
  if (n <= k) return {};
  std::vector<size_t> idx(k);
  std::uniform_int_distribution<size_t> u(0, n - 1);
  for (auto& i : idx) i = u(g);
  return idx;
}

// Runs fn with 1, 2 and 3 OpenMP threads; all outputs must be bit-identical.
inline void expect_thread_invariant(const std::function<std::vector<VecF>()>& fn, const char* what) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto ref = fn();
  for (int nt : {2, 3}) {
    omp_set_num_threads(nt);
    const auto got = fn();
    ASSERT_EQ(got.size(), ref.size());
    for (size_t k = 0; k < ref.size(); ++k)
      EXPECT_EQ(0, std::memcmp(got[k].data(), ref[k].data(), ref[k].size() * sizeof(float)))
          << what << ": output " << k << " differs between 1 and " << nt << " threads";
  }
  omp_set_num_threads(saved);
}

// ---- float64 references ---------------------------------------------------------------

inline VecD linear_ref(const VecD& x, const VecD& w, const VecD* b, int N, int I, int O) {
  VecD y(N * O);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < O; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int i = 0; i < I; ++i) s += x[n * I + i] * w[o * I + i];
      y[n * O + o] = s;
    }
  return y;
}

}  // namespace mt::test
