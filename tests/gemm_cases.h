// The matrix-product tests' shared parts (tests/test_gemm.cpp for gemm, tests/test_gemm_bf16.cpp
// for gemm_bf16): operands with padded leading dimensions, the float64 check with its
// bound, and the thread-count check.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace mt::test {

struct GemmCase {
  int64_t M, N, K;
};

// op(A) [M, K], op(B) [K, N] and C [M, N], row-major, each with leading dims padded past
// the used width (so that a kernel writing past N, or reading with the wrong stride, shows).
struct GemmOperands {
  int64_t lda, ldb, ldc;
  std::vector<float> A, B, C0;
};

// ta / tb: A and B stored transposed. draw() fills A, then B, then C0, element by element.
inline GemmOperands make_gemm_operands(const GemmCase& c, bool ta, bool tb, const std::function<float()>& draw) {
  GemmOperands o;
  const int64_t a_rows = ta ? c.K : c.M, a_cols = ta ? c.M : c.K;
  const int64_t b_rows = tb ? c.N : c.K, b_cols = tb ? c.K : c.N;
  o.lda = a_cols + 3, o.ldb = b_cols + 2, o.ldc = c.N + 5;
  o.A.resize(a_rows * o.lda), o.B.resize(b_rows * o.ldb), o.C0.resize(c.M * o.ldc);
  for (auto* v : {&o.A, &o.B, &o.C0})
    for (float& x : *v) x = draw();
  return o;
}

// Element (r, c) of op(m).
inline float gemm_at(const std::vector<float>& m, int64_t ld, bool t, int64_t r, int64_t c) {
  return t ? m[c * ld + r] : m[r * ld + c];
}

// C = op(A) op(B) + beta C0 by the kernel under test.
using GemmRun = std::function<std::vector<float>(const GemmCase&, bool ta, bool tb, float beta, const GemmOperands&)>;

// Each element of C against the float64 product. Bound: any order of a float32 sum of K
// terms is within gamma_K sum_k |a_k b_k| of the exact one (gamma_K ~ K u, u = 2^-24), plus
// the rounding of beta C and of the final add (2u of the result). Padding columns of C
// beyond N must be left untouched.
inline void expect_matches_float64(const GemmCase& c, bool ta, bool tb, float beta, const GemmOperands& o,
                                   const std::vector<float>& C) {
  const double u = std::ldexp(1.0, -24);
  int bad = 0;
  for (int64_t i = 0; i < c.M; ++i) {
    for (int64_t j = 0; j < c.N; ++j) {
      double exact = beta * double(o.C0[i * o.ldc + j]), mag = std::fabs(exact);
      for (int64_t k = 0; k < c.K; ++k) {
        const double p = double(gemm_at(o.A, o.lda, ta, i, k)) * gemm_at(o.B, o.ldb, tb, k, j);
        exact += p, mag += std::fabs(p);
      }
      const double tol = (c.K + 2) * u * mag / (1 - (c.K + 2) * u) + 1e-30;
      if (!(std::fabs(C[i * o.ldc + j] - exact) <= tol) && bad++ < 3)
        ADD_FAILURE() << "C[" << i << "," << j << "] = " << C[i * o.ldc + j] << ", exact " << exact << " (bound "
                      << tol << ")";
    }
    for (int64_t j = c.N; j < o.ldc; ++j) ASSERT_EQ(C[i * o.ldc + j], o.C0[i * o.ldc + j]) << "padding";
  }
}

// The same bits with 2, 3 and 4 OpenMP threads as with 1 (beta 1), and the thread count
// left as it was set.
inline void expect_same_bits_for_any_thread_count(const GemmCase& c, bool ta, bool tb, const GemmOperands& o,
                                                  const GemmRun& run) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> ref = run(c, ta, tb, 1.0f, o);
  for (int threads : {2, 3, 4}) {
    omp_set_num_threads(threads);
    EXPECT_EQ(run(c, ta, tb, 1.0f, o), ref) << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << ta
                                           << " tb=" << tb << ": " << threads << " threads differ from 1";
    ASSERT_EQ(omp_get_max_threads(), threads) << "the kernel changed the OpenMP thread count";
  }
  omp_set_num_threads(saved);
}

}  // namespace mt::test
