// gemm_bf16 (ops/gemm_bf16.h), the bf16 products on AVX512_BF16: against a float64
// reference of the same bf16 operands for each transpose combination, beta 0 and 1, and
// shapes that cut every blocking (rows past a 14-row panel and a 4088-row block, columns
// past a 32-column panel and a 4096-column block, odd K and K past a 512 block); non-bf16
// inputs rounded to the nearest; bf16 bits read as the same values; bit-identical results
// for 1 to 4 threads; a linear layer under a bf16 Autocast scope runs it. Skipped where the
// CPU has no AVX512_BF16 (or MESHTRAIN_CPU_BF16=off).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/machine.h"
#include "core/tensor.h"
#include "gemm_cases.h"
#include "ops/autocast.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"
#include "ops/linear.h"
#include "test_util.h"

using namespace mt;

namespace {

using test::GemmCase;
using test::GemmOperands;

const GemmCase kCases[] = {{1, 1, 1},       {14, 32, 2},      {15, 33, 3}, {29, 70, 1025},
                           {100, 4100, 40}, {4103, 20, 600}, {3, 5, 0}};

// Operands of bf16 values (round: left as fp32 draws instead, for the rounding check).
GemmOperands make(const GemmCase& c, bool ta, bool tb, std::mt19937& g, bool round = true) {
  std::normal_distribution<float> n;
  GemmOperands o = test::make_gemm_operands(c, ta, tb, [&] { return n(g); });
  if (round)
    for (auto* v : {&o.A, &o.B}) round_to(DType::bf16, v->data(), v->data(), static_cast<int64_t>(v->size()));
  return o;
}

std::vector<float> run(const GemmCase& c, bool ta, bool tb, float beta, const GemmOperands& o) {
  std::vector<float> C = o.C0;
  gemm_bf16(ta, tb, c.M, c.N, c.K, o.A.data(), o.lda, o.B.data(), o.ldb, beta, C.data(), o.ldc);
  return C;
}

#define SKIP_WITHOUT_BF16() \
  if (!bf16_gemm_available()) GTEST_SKIP() << bf16_gemm_description()

}  // namespace

// Each element against the float64 product of the bf16 operands: the products are exact in
// fp32, so only the additions round, within test::expect_matches_float64's bound.
TEST(GemmBf16, MatchesFloat64Reference) {
  SKIP_WITHOUT_BF16();
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

// fp32 inputs are rounded to the nearest bf16 first: the same bits as on rounded copies.
TEST(GemmBf16, RoundsOtherInputsToTheNearest) {
  SKIP_WITHOUT_BF16();
  std::mt19937 g(4);
  const GemmCase c{29, 70, 1025};
  GemmOperands raw = make(c, false, true, g, /*round=*/false), rounded = raw;
  round_to(DType::bf16, rounded.A.data(), rounded.A.data(), static_cast<int64_t>(rounded.A.size()));
  round_to(DType::bf16, rounded.B.data(), rounded.B.data(), static_cast<int64_t>(rounded.B.size()));
  EXPECT_NE(raw.A, rounded.A);
  EXPECT_EQ(run(c, false, true, 0.0f, raw), run(c, false, true, 0.0f, rounded));
}

// bf16 operands given as their 16 bits (a kept activation) give the bits of the same values
// given as fp32, for either operand, every transpose and every blocking.
TEST(GemmBf16, ReadsBf16Bits) {
  SKIP_WITHOUT_BF16();
  std::mt19937 g(7);
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    convert(DType::bf16, h.data(), DType::f32, v.data(), static_cast<int64_t>(v.size()));
    return h;
  };
  for (const GemmCase& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const GemmOperands o = make(c, ta, tb, g);
        const std::vector<uint16_t> a = bits(o.A), b = bits(o.B);
        const std::vector<float> ref = run(c, ta, tb, 1.0f, o);
        for (int which = 1; which < 4; ++which) {  // A's bits, B's bits, both
          std::vector<float> C = o.C0;
          const Bf16Src A = which & 1 ? Bf16Src(a.data()) : Bf16Src(o.A.data());
          const Bf16Src B = which & 2 ? Bf16Src(b.data()) : Bf16Src(o.B.data());
          gemm_bf16(ta, tb, c.M, c.N, c.K, A, o.lda, B, o.ldb, 1.0f, C.data(), o.ldc);
          EXPECT_EQ(C, ref) << "M=" << c.M << " N=" << c.N << " K=" << c.K << " ta=" << ta << " tb=" << tb
                            << (which == 1 ? ": A" : which == 2 ? ": B" : ": A and B") << " as bf16 bits";
        }
      }
}

TEST(GemmBf16, BitIdenticalForAnyThreadCount) {
  SKIP_WITHOUT_BF16();
  std::mt19937 g(5);
  for (const GemmCase& c : kCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) test::expect_same_bits_for_any_thread_count(c, ta, tb, make(c, ta, tb, g), run);
}

// Under a bf16 scope a linear layer's forward is gemm_bf16's product of the rounded
// operands (plus the bias), bit for bit; under fp16, gemm's.
TEST(GemmBf16, LinearUnderBf16RunsIt) {
  SKIP_WITHOUT_BF16();
  std::mt19937 g(6);
  const int64_t N = 37, I = 1030, O = 45;
  const GemmCase c{N, O, I};
  GemmOperands o = make(c, false, true, g);  // x [N, I] (lda I + 3), w [O, I] (ldb I + 2)
  std::vector<float> x(N * I), w(O * I), y(N * O);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < I; ++k) x[i * I + k] = o.A[i * o.lda + k];
  for (int64_t j = 0; j < O; ++j)
    for (int64_t k = 0; k < I; ++k) w[j * I + k] = o.B[j * o.ldb + k];
  std::vector<float> ref(N * O), ref32(N * O);
  gemm_bf16(false, true, N, O, I, x.data(), I, w.data(), I, 0.0f, ref.data(), O);
  gemm(false, true, N, O, I, x.data(), I, w.data(), I, 0.0f, ref32.data(), O);
  EXPECT_NE(ref, ref32) << "the two kernels sum in the same order: the check below proves nothing";
  const Tensor xt = Tensor::wrap(x.data(), {N, I}, DType::f32), wt = Tensor::wrap(w.data(), {O, I}, DType::f32);
  const Tensor yt = Tensor::wrap(y.data(), {N, O}, DType::f32);
  {
    Autocast scope(DType::bf16);
    linear_forward(yt, xt, wt, nullptr);
  }
  EXPECT_EQ(y, ref);
  {
    Autocast scope(DType::f16);
    linear_forward(yt, xt, wt, nullptr);
  }
  EXPECT_NE(y, ref) << "fp16 products are not bf16 ones";
}

// MESHTRAIN_CPU_BF16 (and MESHTRAIN_FUSED_GELU) take off in any case, or 0: OFF and false
// were a silent "on", and any other value is refused, naming the variable.
TEST(GemmBf16, ItsSwitchTakesOffInAnyCaseAndRefusesOtherValues) {
  const char* name = "MESHTRAIN_TEST_SWITCH";
  unsetenv(name);
  EXPECT_TRUE(env_switch_on(name));
  for (const char* on : {"", "on", "ON", "1"}) {
    setenv(name, on, 1);
    EXPECT_TRUE(env_switch_on(name)) << on;
  }
  for (const char* off : {"off", "OFF", "Off", "0"}) {
    setenv(name, off, 1);
    EXPECT_FALSE(env_switch_on(name)) << off;
  }
  setenv(name, "false", 1);
  EXPECT_NE(test::error_of([&] { env_switch_on(name); })
                .find("MESHTRAIN_TEST_SWITCH=false is not a switch: set it to off (or 0), or leave it unset"),
            std::string::npos);
  unsetenv(name);
}
