// gemm (ops/gemm.h), the matrix product under every linear layer: the fixed tile grid
// against a float64 reference for each transpose combination and for shapes that cut M, N
// and K; bit-identical results for 1 to 4 threads; the grid covers the matrix and follows
// the stated rule; the kernel-set report. CTest also runs this program under other
// OpenBLAS kernel sets (tests/CMakeLists.txt), so each set's rounding is checked anywhere.
#include <gtest/gtest.h>
#include <omp.h>

#include <cblas.h>

#include <strings.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ops/gemm.h"

using namespace mt;

namespace {

struct Case {
  int64_t M, N, K;
};
// One tile; rows cut in three (gm = 3); columns cut in three (gn = 3); K cut in eight (one
// small tile); rows in two and K in four; a row vector; an empty K.
const Case kCases[] = {{5, 7, 3}, {1100, 40, 70}, {30, 2100, 50}, {40, 50, 3000}, {600, 700, 1200}, {1, 33, 9},
                       {17, 9, 0}};

struct Operands {
  int64_t lda, ldb, ldc;   // leading dims, padded past the used width
  std::vector<float> A, B, C0;
};

Operands make(const Case& c, bool ta, bool tb, std::mt19937& g) {
  std::uniform_real_distribution<float> u(-1, 1);
  Operands o;
  const int64_t a_rows = ta ? c.K : c.M, a_cols = ta ? c.M : c.K;
  const int64_t b_rows = tb ? c.N : c.K, b_cols = tb ? c.K : c.N;
  o.lda = a_cols + 3, o.ldb = b_cols + 2, o.ldc = c.N + 5;
  o.A.resize(a_rows * o.lda), o.B.resize(b_rows * o.ldb), o.C0.resize(c.M * o.ldc);
  for (auto* v : {&o.A, &o.B, &o.C0})
    for (float& x : *v) x = u(g);
  return o;
}

float at(const std::vector<float>& m, int64_t ld, bool t, int64_t r, int64_t c) { return t ? m[c * ld + r] : m[r * ld + c]; }

std::vector<float> run(const Case& c, bool ta, bool tb, float beta, const Operands& o) {
  std::vector<float> C = o.C0;
  gemm(ta, tb, c.M, c.N, c.K, o.A.data(), o.lda, o.B.data(), o.ldb, beta, C.data(), o.ldc);
  return C;
}

}  // namespace

// Each element against the float64 product. Bound: any order of a float32 dot product of K
// terms is within gamma_K sum_k |a_k b_k| of the exact one (gamma_K ~ K u, u = 2^-24), plus
// the rounding of beta C and of the final add (2u of the result). Padding columns of C
// beyond N are left untouched.
TEST(Gemm, MatchesFloat64Reference) {
  std::mt19937 g(3);
  const double u = std::ldexp(1.0, -24);
  for (const Case& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(testing::Message() << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << ta
                                          << " tb=" << tb << " beta=" << beta);
          const Operands o = make(c, ta, tb, g);
          const std::vector<float> C = run(c, ta, tb, beta, o);
          int bad = 0;
          for (int64_t i = 0; i < c.M; ++i) {
            for (int64_t j = 0; j < c.N; ++j) {
              double exact = beta * double(o.C0[i * o.ldc + j]), mag = std::fabs(exact);
              for (int64_t k = 0; k < c.K; ++k) {
                const double p = double(at(o.A, o.lda, ta, i, k)) * at(o.B, o.ldb, tb, k, j);
                exact += p, mag += std::fabs(p);
              }
              const double tol = (c.K + 2) * u * mag / (1 - (c.K + 2) * u) + 1e-30;
              if (!(std::fabs(C[i * o.ldc + j] - exact) <= tol) && bad++ < 3)
                ADD_FAILURE() << "C[" << i << "," << j << "] = " << C[i * o.ldc + j] << ", exact " << exact
                              << " (bound " << tol << ")";
            }
            for (int64_t j = c.N; j < o.ldc; ++j) ASSERT_EQ(C[i * o.ldc + j], o.C0[i * o.ldc + j]) << "padding";
          }
        }
}

TEST(Gemm, BitIdenticalForAnyThreadCount) {
  std::mt19937 g(5);
  const int saved = omp_get_max_threads();
  for (const Case& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const Operands o = make(c, ta, tb, g);
        omp_set_num_threads(1);
        const std::vector<float> ref = run(c, ta, tb, 1.0f, o);
        for (int threads : {2, 3, 4}) {
          omp_set_num_threads(threads);
          EXPECT_EQ(run(c, ta, tb, 1.0f, o), ref) << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << ta
                                                 << " tb=" << tb << ": " << threads << " threads differ from 1";
          ASSERT_EQ(omp_get_max_threads(), threads) << "gemm changed the OpenMP thread count";
        }
      }
  omp_set_num_threads(saved);
}

// The grid covers the matrix with no empty tile, cuts rows and columns in multiples of 16,
// and cuts K (into chunks of at least 256) only when there are fewer than 8 output tiles.
TEST(Gemm, GridFollowsTheRule) {
  for (int64_t M : {1, 15, 16, 511, 512, 513, 1100, 4096, 50257})
    for (int64_t N : {1, 40, 1024, 1025, 3072})
      for (int64_t K : {0, 1, 255, 512, 2048, 100000}) {
        const GemmGrid g = gemm_grid(M, N, K);
        SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K);
        EXPECT_GE(g.gm * g.tm, M);
        EXPECT_LT((g.gm - 1) * g.tm, M);
        EXPECT_GE(g.gn * g.tn, N);
        EXPECT_LT((g.gn - 1) * g.tn, N);
        EXPECT_TRUE(g.gm == 1 || g.tm % 16 == 0);
        EXPECT_TRUE(g.gn == 1 || g.tn % 16 == 0);
        EXPECT_LE(g.tm, 512 + 15);
        EXPECT_LE(g.tn, 1024 + 15);
        EXPECT_GE(g.gk * g.tk, K);
        if (g.gk > 1) {
          EXPECT_LT(g.gm * g.gn, 8);
          EXPECT_GE(g.tk, 256);
          EXPECT_LT((g.gk - 1) * g.tk, K);
        }
      }
}

TEST(Gemm, KernelReport) {
  EXPECT_NE(blas_description().find(openblas_get_corename()), std::string::npos) << blas_description();
  // The kernel-set runs of this program really run the set they name.
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE"))
    EXPECT_EQ(strcasecmp(forced, openblas_get_corename()), 0) << forced << " vs " << openblas_get_corename();
  const std::string forced = blas_kernel_warning("Haswell", "AVX-512", "Haswell");
  EXPECT_NE(forced.find("Haswell kernels (AVX2)"), std::string::npos) << forced;
  EXPECT_NE(forced.find("unset OPENBLAS_CORETYPE"), std::string::npos) << forced;
  const std::string unknown = blas_kernel_warning("Prescott", "AVX2", nullptr);
  EXPECT_NE(unknown.find("set OPENBLAS_CORETYPE=Haswell"), std::string::npos) << unknown;
  EXPECT_EQ(blas_kernel_warning("SkylakeX", "AVX-512", nullptr), "");
  EXPECT_EQ(blas_kernel_warning("Cooperlake", "AVX-512", "Cooperlake"), "");
  EXPECT_EQ(blas_kernel_warning("Haswell", "AVX2", "Haswell"), "");
  EXPECT_EQ(blas_kernel_warning("Zen", "AVX2", nullptr), "");
}
