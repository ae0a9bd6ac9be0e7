// gemm (ops/gemm.h), the matrix product under every linear layer: the fixed tile grid
// against a float64 reference for each transpose combination and for shapes that cut M, N
// and K; bit-identical results for 1 to 4 threads; the grid covers the matrix and follows
// the stated rule; the kernel-set report. CTest also runs this program under other
// OpenBLAS kernel sets (tests/CMakeLists.txt), so each set's rounding is checked anywhere.
#include <gtest/gtest.h>

#include <cblas.h>

#include <strings.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gemm_cases.h"
#include "ops/gemm.h"

using namespace mt;

namespace {

using test::GemmCase;
using test::GemmOperands;

// One tile; rows cut in three (gm = 3); columns cut in three (gn = 3); K cut in eight (one
// small tile); rows in two and K in four; a row vector; an empty K.
const GemmCase kCases[] = {{5, 7, 3},        {1100, 40, 70}, {30, 2100, 50}, {40, 50, 3000},
                           {600, 700, 1200}, {1, 33, 9},     {17, 9, 0}};

GemmOperands make(const GemmCase& c, bool ta, bool tb, std::mt19937& g) {
  std::uniform_real_distribution<float> u(-1, 1);
  return test::make_gemm_operands(c, ta, tb, [&] { return u(g); });
}

std::vector<float> run(const GemmCase& c, bool ta, bool tb, float beta, const GemmOperands& o) {
  std::vector<float> C = o.C0;
  gemm(ta, tb, c.M, c.N, c.K, o.A.data(), o.lda, o.B.data(), o.ldb, beta, C.data(), o.ldc);
  return C;
}

}  // namespace

// Each element against the float64 product (test::expect_matches_float64 states the bound).
TEST(Gemm, MatchesFloat64Reference) {
  std::mt19937 g(3);
  for (const GemmCase& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          SCOPED_TRACE(testing::Message() << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << ta
                                          << " tb=" << tb << " beta=" << beta);
          const GemmOperands o = make(c, ta, tb, g);
          test::expect_matches_float64(c, ta, tb, beta, o, run(c, ta, tb, beta, o));
        }
}

TEST(Gemm, BitIdenticalForAnyThreadCount) {
  std::mt19937 g(5);
  for (const GemmCase& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) test::expect_same_bits_for_any_thread_count(c, ta, tb, make(c, ta, tb, g), run);
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
  // The kernel set meshtrain sets where OpenBLAS does not know the CPU, and only then.
  EXPECT_STREQ(blas_kernels_to_set("Prescott", "AVX-512", nullptr), "SkylakeX");
  EXPECT_STREQ(blas_kernels_to_set("Prescott", "AVX2", ""), "Haswell");
  EXPECT_STREQ(blas_kernels_to_set("Nehalem", "AVX", nullptr), "Sandybridge");
  EXPECT_EQ(blas_kernels_to_set("Prescott", "AVX-512", "Prescott"), nullptr);  // the user's choice is kept
  EXPECT_EQ(blas_kernels_to_set("Cooperlake", "AVX-512", nullptr), nullptr);
  EXPECT_EQ(blas_kernels_to_set("Haswell", "AVX2", nullptr), nullptr);
  EXPECT_EQ(blas_kernels_to_set("Prescott", "SSE", nullptr), nullptr);
}
