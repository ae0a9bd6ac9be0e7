// The CUDA linear layers (src/ops/cuda/linear.cu) against the CPU ops: every function, in
// fp32 and under bf16 / f16 Autocast scopes, with and without bias, accumulate on and off,
// odd shapes, N = 1, leading dims folded into rows, a GPT-2-sized product, views at
// unaligned offsets; bit-identical reruns; bad shapes throw; the product with GELU in its
// epilogue against a float64 reference. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "cuda_harness.h"
#include "op_harness.h"
#include "ops/activation.h"
#include "ops/autocast.h"
#include "ops/linear.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt {
namespace {

using test::kNaN;
using test::randv;
using test::tf;
using test::VecF;

#if MESHTRAIN_CUDA

// Tolerances, relative Frobenius error ||gpu - cpu|| / ||cpu||:
// - fp32: both sides multiply the same fp32 operands with fp32 accumulation (no TF32);
//   only the summation order differs, ~sqrt(K) * 2^-24 relative for random signs (about
//   2e-6 at K = 768), so 1e-5 leaves a margin of five.
// - bf16 / f16: both sides multiply the same rounded operands exactly and accumulate in
//   fp32, but tensor cores do not round each fp32 accumulation to nearest (they truncate
//   within a multi-term add), which can bias the error to ~(K / 16) * 2^-23 (~6e-6 at
//   K = 768); 3e-5 still catches any real fault (an unrounded or wrongly rounded operand
//   moves the result by ~2^-9 in bf16, ~2^-12 in f16).
constexpr double kTol32 = 1e-5, kTol16 = 3e-5;

using test::poisoned;
using test::rel_err;
using test::same_bits;
using test::to_dev;
using test::to_host;


// MESHTRAIN_FUSED_GELU=off in the environment (gpu_check.sh reruns failed tests so): the
// GELU products decline, and the tests of them skip.
bool gelu_fusion_off() {
  const char* e = std::getenv("MESHTRAIN_FUSED_GELU");
  return e && std::strcmp(e, "off") == 0;
}

Shape with_last(Shape lead, int64_t last) {
  lead.push_back(last);
  return lead;
}

struct LinearCase {
  Shape lead;  // x is lead + [I], y is lead + [O]; N = prod(lead)
  int64_t I, O;
};

// Every linear function for one case, precision, layout and bias choice: the GPU results
// against the CPU op's, twice on the GPU (bit-identical), and the fp32 forward against
// the float64 reference.
void check_linear_case(const LinearCase& c, DType d, bool io, bool bias, unsigned seed) {
  SCOPED_TRACE(::testing::Message() << "lead " << shape_str(c.lead) << " I=" << c.I << " O=" << c.O << " "
                                    << dtype_name(d) << (io ? " io" : "") << (bias ? " bias" : ""));
  const int64_t N = shape_numel(c.lead), I = c.I, O = c.O;
  std::mt19937 g(seed);
  VecF x = randv(N * I, g), w = randv(O * I, g), b = randv(O, g), dy = randv(N * O, g);
  VecF dx0 = randv(N * I, g), dw0 = randv(O * I, g), db0 = randv(O, g);
  if (d != DType::f32) round_to(d, w.data(), w.data(), (int64_t)w.size());  // weights hold 16-bit values
  const Shape xs = with_last(c.lead, I), ys = with_last(c.lead, O);
  const Shape ws = io ? Shape{I, O} : Shape{O, I};
  const double tol = d == DType::f32 ? kTol32 : kTol16;

  Autocast scope(d);  // f32: no rounding
  auto fwd_cpu = io ? &mt::linear_io_forward : &mt::linear_forward;
  auto bin_cpu = io ? &mt::linear_io_backward_input : &mt::linear_backward_input;
  auto bw_cpu = io ? &mt::linear_io_backward_weight : &mt::linear_backward_weight;
  auto fwd_gpu = io ? &mt::cuda::linear_io_forward : &mt::cuda::linear_forward;
  auto bin_gpu = io ? &mt::cuda::linear_io_backward_input : &mt::cuda::linear_backward_input;
  auto bw_gpu = io ? &mt::cuda::linear_io_backward_weight : &mt::cuda::linear_backward_weight;

  // CPU: y, dx (overwrite), dxa (accumulate onto dx0), dw and db (accumulate onto dw0, db0).
  VecF y_c(N * O), dx_c(N * I), dxa_c = dx0, dw_c = dw0, db_c = db0;
  {
    Tensor bt = tf(b, {O}), dbt = tf(db_c, {O});
    fwd_cpu(tf(y_c, ys), tf(x, xs), tf(w, ws), bias ? &bt : nullptr);
    bin_cpu(tf(dx_c, xs), tf(dy, ys), tf(w, ws), false);
    bin_cpu(tf(dxa_c, xs), tf(dy, ys), tf(w, ws), true);
    bw_cpu(tf(dw_c, ws), bias ? &dbt : nullptr, tf(dy, ys), tf(x, xs));
  }

  auto run_gpu = [&]() {
    Tensor xd = to_dev(x, xs), wd = to_dev(w, ws), bd = to_dev(b, {O}), dyd = to_dev(dy, ys);
    Tensor yd = poisoned(ys), dxd = poisoned(xs), dxad = to_dev(dx0, xs), dwd = to_dev(dw0, ws), dbd = to_dev(db0, {O});
    fwd_gpu(yd, xd, wd, bias ? &bd : nullptr);
    bin_gpu(dxd, dyd, wd, false);
    bin_gpu(dxad, dyd, wd, true);
    bw_gpu(dwd, bias ? &dbd : nullptr, dyd, xd);
    return std::vector<VecF>{to_host(yd), to_host(dxd), to_host(dxad), to_host(dwd), to_host(dbd)};
  };
  const std::vector<VecF> got = run_gpu(), again = run_gpu();
  const char* names[] = {"y", "dx", "dx (accumulate)", "dw", "db"};
  const VecF* refs[] = {&y_c, &dx_c, &dxa_c, &dw_c, &db_c};
  for (int k = 0; k < 5; ++k) {
    EXPECT_LT(rel_err(got[k], *refs[k]), tol) << names[k];
    EXPECT_TRUE(same_bits(got[k], again[k])) << names[k] << ": two GPU runs differ";
  }
  if (!bias) EXPECT_TRUE(same_bits(got[4], db0)) << "db changed though no db was passed";

  if (d == DType::f32) {  // the forward against float64 (w as [O, I] for the reference)
    test::VecD w_oi(O * I);
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i) w_oi[o * I + i] = io ? w[i * O + o] : w[o * I + i];
    const test::VecD bdd = test::to_d(b);
    test::expect_close(got[0], test::linear_ref(test::to_d(x), w_oi, bias ? &bdd : nullptr, (int)N, (int)I, (int)O),
                       "y vs float64");
  }
}

const std::vector<LinearCase>& linear_cases() {
  static const std::vector<LinearCase> cases = {
      {{1}, 19, 23},      // N = 1
      {{37}, 19, 23},     // nothing a multiple of 8, 16 or 32
      {{3, 5}, 1, 7},     // K = 1, leading dims fold into rows
      {{4, 16}, 64, 48},  // [B, T, C]
      {{2, 48}, 128, 344},  // Llama-like: d_model 128, SwiGLU hidden 344
      {{512}, 768, 2304},   // GPT-2's attention input projection at T = 512
  };
  return cases;
}

TEST(CudaLinear, Fp32MatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  unsigned seed = 1;
  for (const auto& c : linear_cases())
    for (bool io : {false, true})
      for (bool bias : {false, true}) check_linear_case(c, DType::f32, io, bias, seed++);
}

TEST(CudaLinear, Bf16AutocastMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  unsigned seed = 100;
  for (const auto& c : linear_cases())
    for (bool io : {false, true})
      for (bool bias : {false, true}) check_linear_case(c, DType::bf16, io, bias, seed++);
}

TEST(CudaLinear, F16AutocastMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  unsigned seed = 200;
  for (const auto& c : linear_cases())
    for (bool io : {false, true}) check_linear_case(c, DType::f16, io, true, seed++);
}

// An activation operand kept in 16 bits (x of the forward and the weight gradient, as a
// block keeps its norms' outputs, attention output and MLP activation): read straight into
// cuBLASLt under a scope of its dtype, it gives the bits of an fp32 x holding the same
// values (which the product rounds to those 16 bits); outside a scope it is widened and
// gives the fp32 product of its values. A 16-bit x of the other dtype is refused.
void check_16bit_operands(int64_t N, int64_t I, int64_t O) {
  std::mt19937 g(11);
  const VecF w = randv(O * I, g), b = randv(O, g), dy = randv(N * O, g), dw0 = randv(O * I, g);
  const Shape ws = {O, I}, ws_io = {I, O};
  for (DType kept : {DType::bf16, DType::f16}) {
    for (DType scope : {kept, DType::f32}) {
      SCOPED_TRACE(std::string(dtype_name(kept)) + " x under a " + dtype_name(scope) + " scope, I " +
                   std::to_string(I));
      VecF x = randv(N * I, g);
      round_to(kept, x.data(), x.data(), N * I);  // x's values: those of the kept dtype
      const Tensor x32 = to_dev(x, {N, I});
      const Tensor x16 = Tensor::empty({N, I}, kept, test::gpu(), MemTag::activations);
      x16.convert_from(x32);
      Autocast ac(scope);
      for (bool io : {false, true}) {
        const Tensor wd = to_dev(w, io ? ws_io : ws), bd = to_dev(b, {O}), dyd = to_dev(dy, {N, O});
        const Tensor y32 = poisoned({N, O}), y16 = poisoned({N, O});
        const Tensor dw32 = to_dev(dw0, io ? ws_io : ws), dw16 = to_dev(dw0, io ? ws_io : ws);
        auto fwd = io ? &mt::linear_io_forward : &mt::linear_forward;
        auto bw = io ? &mt::linear_io_backward_weight : &mt::linear_backward_weight;
        fwd(y32, x32, wd, &bd), fwd(y16, x16, wd, &bd);
        bw(dw32, nullptr, dyd, x32), bw(dw16, nullptr, dyd, x16);
        EXPECT_TRUE(same_bits(to_host(y16), to_host(y32))) << "forward, io " << io;
        EXPECT_TRUE(same_bits(to_host(dw16), to_host(dw32))) << "weight gradient, io " << io;
      }
      if (scope == DType::f32) continue;
      const DType other = kept == DType::bf16 ? DType::f16 : DType::bf16;
      const Tensor x_other = Tensor::empty({N, I}, other, test::gpu(), MemTag::activations);
      x_other.convert_from(x32);
      EXPECT_THROW(linear_forward(poisoned({N, O}), x_other, to_dev(w, ws), nullptr), Error);
    }
  }
}

// I = 63 gives odd leading dims, where cuBLASLt may have no 16-bit algorithm (the fallback
// that widens the 16-bit operands).
TEST(CudaLinear, SixteenBitActivationOperandsGiveTheirFp32Bits) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_16bit_operands(37, 64, 48);
  check_16bit_operands(37, 63, 48);
}

// A weight given as the model's 16-bit working copy (Unit::w16) goes straight into cuBLASLt
// under a scope of its dtype and gives the bits of its fp32 widening (which the product
// would round to the same 16 bits in aligned scratch: the same plan): forward with a bias,
// the input gradient, both halves at once, both layouts, and the GELU products; outside a
// scope it is widened. A weight of the other 16-bit dtype is refused.
void check_16bit_weights(int64_t N, int64_t I, int64_t O) {
  std::mt19937 g(13);
  for (DType t : {DType::bf16, DType::f16})
    for (DType scope : {t, DType::f32})
      for (bool io : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " weight under a " + dtype_name(scope) + " scope, io " +
                     std::to_string(io) + ", I " + std::to_string(I));
        const Shape ws = io ? Shape{I, O} : Shape{O, I};
        VecF w = randv(O * I, g);
        round_to(t, w.data(), w.data(), O * I);
        const Tensor w32 = to_dev(w, ws), w16 = Tensor::empty(ws, t, test::gpu(), MemTag::params);
        w16.convert_from(w32);
        const Tensor x = to_dev(randv(N * I, g), {N, I}), dy = to_dev(randv(N * O, g), {N, O});
        const Tensor b = to_dev(randv(O, g), {O});
        auto fwd = io ? &mt::linear_io_forward : &mt::linear_forward;
        auto bin = io ? &mt::linear_io_backward_input : &mt::linear_backward_input;
        auto both = io ? &mt::linear_io_backward : &mt::linear_backward;
        const VecF dw0 = randv(O * I, g);
        std::vector<VecF> out[2];
        for (int k = 0; k < 2; ++k) {
          const Tensor& wk = k ? w16 : w32;
          const Tensor y = poisoned({N, O}), dx = poisoned({N, I}), dx2 = poisoned({N, I}), dw = to_dev(dw0, ws);
          Autocast ac(scope);
          fwd(y, x, wk, &b);
          bin(dx, dy, wk, false);
          both(dx2, dw, nullptr, dy, x, wk);
          out[k] = {to_host(y), to_host(dx), to_host(dx2), to_host(dw)};
          if (scope == DType::f32 || gelu_fusion_off()) continue;
          // The GELU products, where cuBLASLt has them for the shape (the GELU tests check
          // that it does at theirs): both weights take them, or neither.
          if (!io) {  // the up projection with GELU: act and pre in 16 bits, widened to compare
            const Tensor act = Tensor::empty({N, O}, t, test::gpu(), MemTag::activations);
            const Tensor pre = Tensor::empty({N, O}, t, test::gpu(), MemTag::activations);
            const Tensor act32 = poisoned({N, O}), pre32 = poisoned({N, O});
            const bool applied = linear_gelu_fused(act, pre, x, wk, &b);
            if (k == 1) EXPECT_EQ(applied, out[0].size() > 4) << "the GELU product for one weight only";
            if (!applied) continue;
            act32.convert_from(act), pre32.convert_from(pre);
            out[k].push_back(to_host(act32)), out[k].push_back(to_host(pre32));
          } else {  // the down projection's input gradient through GELU (pre: [N, I])
            const Tensor pre = Tensor::empty({N, I}, t, test::gpu(), MemTag::activations);
            pre.convert_from(x);
            const Tensor dxg = poisoned({N, I});
            const bool applied = linear_dgelu_fused(dxg, dy, wk, pre);
            if (k == 1) EXPECT_EQ(applied, out[0].size() > 4) << "the DGELU product for one weight only";
            if (!applied) continue;
            out[k].push_back(to_host(dxg));
          }
        }
        if (out[0].size() != out[1].size()) continue;  // reported above
        for (size_t j = 0; j < out[0].size(); ++j)
          EXPECT_TRUE(same_bits(out[1][j], out[0][j])) << "output " << j
                                                       << " (y, dx, dx of both halves, dw, then act and pre or "
                                                          "the GELU input gradient)";
        if (scope == DType::f32) continue;
        const DType other = t == DType::bf16 ? DType::f16 : DType::bf16;
        const Tensor w_other = Tensor::empty(ws, other, test::gpu(), MemTag::params);
        w_other.convert_from(w32);
        Autocast ac(scope);
        EXPECT_THROW(fwd(poisoned({N, O}), x, w_other, nullptr), Error);
      }
}

// A model's matrices lie at their offsets in the unit's flat buffer, so a 16-bit weight may
// be only 16- or 2-byte aligned: cuBLASLt's plan follows the alignment (another algorithm, or
// none: the fallback widens the operands), so the products hold the same exact products
// summed in fp32 in another order, within kTol16 of the aligned weight's.
TEST(CudaLinear, SixteenBitWeightsGiveTheBitsOfTheirFp32Values) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  check_16bit_weights(37, 64, 48);
  check_16bit_weights(64, 96, 384);
  std::mt19937 g(14);
  const int64_t N = 64, I = 96, O = 384;
  VecF w = randv(O * I, g);
  round_to(DType::bf16, w.data(), w.data(), O * I);
  const Tensor w32 = to_dev(w, {O, I}), x = to_dev(randv(N * I, g), {N, I}), dy = to_dev(randv(N * O, g), {N, O});
  Autocast ac(DType::bf16);
  const Tensor y_ref = poisoned({N, O}), dx_ref = poisoned({N, I});
  linear_forward(y_ref, x, w32, nullptr);
  linear_backward_input(dx_ref, dy, w32, false);
  for (int64_t offset : {8, 1}) {  // 16 and 2 bytes into a 256-byte aligned block
    SCOPED_TRACE("a bf16 weight " + std::to_string(offset) + " elements into its buffer");
    const Tensor buf = Tensor::empty({O * I + offset}, DType::bf16, test::gpu(), MemTag::params);
    const Tensor w16 = buf.view(offset, {O, I});
    w16.convert_from(w32);
    const Tensor y = poisoned({N, O}), dx = poisoned({N, I});
    linear_forward(y, x, w16, nullptr);
    linear_backward_input(dx, dy, w16, false);
    EXPECT_LT(rel_err(to_host(y), to_host(y_ref)), kTol16) << "forward";
    EXPECT_LT(rel_err(to_host(dx), to_host(dx_ref)), kTol16) << "input gradient";
  }
}

// linear_backward (both halves at once, dy rounded to 16 bits once for the two products)
// gives the bits of linear_backward_input then linear_backward_weight, in fp32 and under
// bf16 / f16 scopes, both weight layouts, with a bias, at a GPT-2-like and an odd shape; and
// those of the weight half without the bias then bias_backward: under a 16-bit scope the
// bias gradient's column sums of fp32 dy come from the pass that rounds dy for the products.
TEST(CudaLinear, BackwardOfBothHalvesMatchesTheTwoCallsBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  std::mt19937 g(13);
  // 4097 rows: the column sums' many row chunks, the last of one row (O not a multiple of 32)
  for (auto [N, I, O] : {std::array<int64_t, 3>{64, 96, 384}, {37, 63, 48}, {4097, 40, 200}})
    for (DType scope : {DType::f32, DType::bf16, DType::f16})
      for (bool io : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(scope)) + " io " + std::to_string(io) + " N " + std::to_string(N));
        VecF w = randv(O * I, g), x = randv(N * I, g);
        if (scope != DType::f32) round_to(scope, w.data(), w.data(), O * I);  // a working copy's values
        const VecF dy = randv(N * O, g), dw0 = randv(O * I, g), db0 = randv(O, g);
        const Shape ws = io ? Shape{I, O} : Shape{O, I};
        const Tensor wd = to_dev(w, ws), xd = to_dev(x, {N, I}), dyd = to_dev(dy, {N, O});
        Autocast ac(scope);
        auto run = [&](int how) {  // 0: both halves at once; 1: the two calls; 2: and the bias apart
          const Tensor dx = poisoned({N, I}), dw = to_dev(dw0, ws), db = to_dev(db0, {O});
          if (how == 0) {
            (io ? &mt::linear_io_backward : &mt::linear_backward)(dx, dw, &db, dyd, xd, wd);
          } else {
            (io ? &mt::linear_io_backward_input : &mt::linear_backward_input)(dx, dyd, wd, false);
            (io ? &mt::linear_io_backward_weight : &mt::linear_backward_weight)(dw, how == 1 ? &db : nullptr, dyd, xd);
            if (how == 2) bias_backward(db, dyd);
          }
          return std::vector<VecF>{to_host(dx), to_host(dw), to_host(db)};
        };
        const auto both = run(0), apart = run(1), bias_apart = run(2);
        for (int k = 0; k < 3; ++k) {
          EXPECT_TRUE(same_bits(both[k], apart[k])) << "output " << k << " (dx, dw, db)";
          EXPECT_TRUE(same_bits(both[k], bias_apart[k])) << "output " << k << " (dx, dw, db), the bias apart";
        }
      }
}

// The 16 bits of v (a value of dt) as an ordered integer: adjacent values of dt differ by 1,
// across zero too.
int ordered16(DType dt, float v) {
  uint16_t b = 0;
  round_to(dt, &v, &v, 1, &b);
  return (b & 0x8000) ? -(b & 0x7fff) : (b & 0x7fff);
}

// A device tensor of fp32 or 16 bits, widened to fp32 on the host.
VecF widened_host(const Tensor& t) {
  if (t.dtype() == DType::f32) return to_host(t);
  const Tensor w = poisoned(t.shape());
  w.convert_from(t);
  return to_host(w);
}

// cuBLASLt may evaluate GELU's tanh with the GPU's approximate instruction (relative error
// up to 2^-10.99 by the PTX ISA); the bounds below allow a tanh of relative error 2^-10
// (this fraction of |t|), so that either form of tanh passes.
constexpr double kTanhSlack = 1.0 / 1024;

// linear_gelu_fused under a 16-bit scope: pre within one 16-bit step of round(y) for
// y = x w^T + b of the 16-bit operands (cuBLASLt accumulates in fp32, then rounds once), and
// act within one step of the interval gelu_tanh(y) +- 0.5 |y t| kTanhSlack (what such a
// tanh moves GELU by). That slack also covers the erf form of GELU (4e-4 from the tanh form
// at |y| ~ 3): the models' GELU form is held by the GPU models' parity with the CPU and with
// transformers instead. Inputs span |y| up to ~ 6, so both GELU tails are exercised. fp32
// act / pre hold the 16-bit outputs' values bit for bit; a rerun gives the same bits; a bias
// of 16-bit values at an odd offset stays within the bound, and one of fp32 values there
// gives the bits of the same values at a block's start. A failure names the worst y.
void check_gelu_fused(DType dt, int64_t N, int64_t I, int64_t O) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " N " + std::to_string(N) + " I " + std::to_string(I) + " O " +
               std::to_string(O));
  std::mt19937 g(5);
  VecF x = randv(N * I, g, -1.5f, 1.5f), w = randv(O * I, g, -0.5f, 0.5f), b = randv(O + 1, g, -0.5f, 0.5f);
  for (VecF* v : {&x, &w, &b}) round_to(dt, v->data(), v->data(), static_cast<int64_t>(v->size()));
  std::vector<double> y(N * O);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) {
      double acc = b[o];
      for (int64_t i = 0; i < I; ++i) acc += (double)x[n * I + i] * w[o * I + i];
      y[n * O + o] = acc;
    }
  const Tensor xd = to_dev(x, {N, I}), wd = to_dev(w, {O, I}), bd = to_dev(b, {O + 1});
  const Tensor b_aligned = bd.view(0, {O}), b_unaligned = bd.view(1, {O});
  VecF b1(b.begin() + 1, b.end());  // the unaligned view's values
  Autocast scope(dt);
  auto poisoned_as = [&](DType out) {  // NaN in dtype `out`: an element left unwritten fails
    Tensor t = Tensor::empty({N, O}, out, test::gpu(), MemTag::activations);
    t.convert_from(poisoned({N, O}));
    return t;
  };
  auto run = [&](DType out, const Tensor& bias) {
    const Tensor act = poisoned_as(out), pre = poisoned_as(out);
    EXPECT_TRUE(linear_gelu_fused(act, pre, xd, wd, &bias)) << "no fused algorithm for a GPT-2-like shape";
    return std::pair{widened_host(act), widened_host(pre)};
  };
  auto expect_near_reference = [&](const std::pair<VecF, VecF>& got, const VecF& bias, const char* what) {
    int64_t worst = 0;
    double worst_y = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < O; ++o) {
        const double yy = y[n * O + o] - b[o] + bias[o];
        const double t = std::tanh(0.7978845608028654 * (yy + 0.044715 * yy * yy * yy)), gelu = 0.5 * yy * (1.0 + t);
        const double slack = 0.5 * std::abs(yy * t) * kTanhSlack;
        const int64_t i = n * O + o;
        const double edge = std::clamp<double>(got.first[i], gelu - slack, gelu + slack);
        const int64_t steps =
            !std::isfinite(got.first[i]) || !std::isfinite(got.second[i])
                ? int64_t{1} << 20
                : std::max<int64_t>(std::abs(ordered16(dt, got.first[i]) - ordered16(dt, (float)edge)),
                                    std::abs(ordered16(dt, got.second[i]) - ordered16(dt, (float)yy)));
        if (steps > worst) worst = steps, worst_y = yy;
      }
    EXPECT_LE(worst, 1) << what << ": 16-bit steps from the float64 reference, at y = " << worst_y;
  };
  const auto fused16 = run(dt, b_aligned);
  expect_near_reference(fused16, b, "16-bit act and pre");
  const auto fused32 = run(DType::f32, b_aligned);
  EXPECT_TRUE(same_bits(fused32.first, fused16.first) && same_bits(fused32.second, fused16.second))
      << "fp32 act / pre against the 16-bit ones";
  const auto again = run(dt, b_aligned);
  EXPECT_TRUE(same_bits(again.first, fused16.first) && same_bits(again.second, fused16.second)) << "rerun";
  expect_near_reference(run(dt, b_unaligned), b1, "an unaligned bias");
  // a bias of fp32 values: the same bits wherever it lies (the plan does not follow its offset)
  const Tensor bu = to_dev(randv(O + 1, g, -0.5f, 0.5f), {O + 1});
  const auto at1 = run(dt, bu.view(1, {O})), moved = run(dt, to_dev(to_host(bu.view(1, {O})), {O}));
  EXPECT_TRUE(same_bits(at1.first, moved.first) && same_bits(at1.second, moved.second))
      << "an fp32 bias at an odd offset against the same values at the start of a block";
}

// linear_dgelu_fused (w stored [in, out]): dx = (dy w^T) * gelu'(pre) against the float64
// reference of the 16-bit operands, elementwise within kTol16 of the reference's rms (the
// product's fp32 accumulation) plus what a tanh of relative error kTanhSlack moves
// gelu'(pre) by (|d gelu' / dt| |t| kTanhSlack, times the product); pre in fp32 holding the
// same values gives the same bits; a rerun too.
void check_dgelu_fused(DType dt, int64_t N, int64_t I, int64_t O) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " N " + std::to_string(N) + " I " + std::to_string(I) + " O " +
               std::to_string(O));
  std::mt19937 g(7);
  VecF pre = randv(N * I, g, -4.0f, 4.0f), w = randv(I * O, g, -0.5f, 0.5f), dy = randv(N * O, g);
  round_to(dt, pre.data(), pre.data(), N * I);
  round_to(dt, w.data(), w.data(), I * O);
  VecF dy16 = dy;  // the product's operand
  round_to(dt, dy16.data(), dy16.data(), N * O);
  std::vector<double> ref(N * I), tanh_slack(N * I);  // dx, and what an approximate tanh moves it by
  const double k = 0.7978845608028654, a = 0.044715;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) {
      double acc = 0;
      for (int64_t o = 0; o < O; ++o) acc += (double)dy16[n * O + o] * w[i * O + o];
      const double x = pre[n * I + i], t = std::tanh(k * (x + a * x * x * x));
      const double dgelu_dt = 0.5 - x * t * k * (1 + 3 * a * x * x);
      ref[n * I + i] = acc * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * a * x * x));
      tanh_slack[n * I + i] = std::abs(acc * dgelu_dt * t) * kTanhSlack;
    }
  const Tensor wd = to_dev(w, {I, O}), dyd = to_dev(dy, {N, O}), pre32 = to_dev(pre, {N, I});
  const Tensor pre16 = Tensor::empty({N, I}, dt, test::gpu(), MemTag::activations);
  pre16.convert_from(pre32);
  Autocast scope(dt);
  auto run = [&](const Tensor& p) {
    const Tensor dx = poisoned({N, I});
    EXPECT_TRUE(linear_dgelu_fused(dx, dyd, wd, p)) << "no fused algorithm for a GPT-2-like shape";
    return to_host(dx);
  };
  const VecF got = run(pre16);
  double rms = 0;
  for (double r : ref) rms += r * r;
  rms = std::sqrt(rms / static_cast<double>(ref.size()));
  int64_t outside = 0, worst = 0;
  double worst_excess = 0;
  for (int64_t j = 0; j < N * I; ++j) {
    const double bound = kTol16 * rms + tanh_slack[j];
    const double excess =
        std::isfinite(got[j]) ? std::abs(got[j] - ref[j]) / bound : std::numeric_limits<double>::infinity();
    if (excess > 1) ++outside;
    if (excess > worst_excess) worst_excess = excess, worst = j;
  }
  EXPECT_EQ(outside, 0) << "worst: " << worst_excess << " times the bound at pre = " << pre[worst];
  EXPECT_TRUE(same_bits(run(pre32), got)) << "fp32 pre against 16-bit pre";
  EXPECT_TRUE(same_bits(run(pre16), got)) << "rerun";
}

// Where the fusion does not apply it writes nothing and says so: outside a 16-bit scope,
// for O not a multiple of 8 (the aux matrix's leading dim) and with MESHTRAIN_FUSED_GELU=off.
TEST(CudaLinear, GeluFusedMatchesTheFloat64Reference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  if (gelu_fusion_off()) GTEST_SKIP() << "MESHTRAIN_FUSED_GELU=off";
  for (DType dt : {DType::bf16, DType::f16}) {
    check_gelu_fused(dt, 37, 64, 48);
    check_gelu_fused(dt, 64, 96, 384);
  }
  std::mt19937 g(6);
  const Tensor x = to_dev(randv(5 * 16, g), {5, 16}), w44 = to_dev(randv(44 * 16, g), {44, 16});
  const Tensor w48 = to_dev(randv(48 * 16, g), {48, 16});
  const Tensor act44 = poisoned({5, 44}), pre44 = poisoned({5, 44}), act48 = poisoned({5, 48}), pre48 = poisoned({5, 48});
  EXPECT_FALSE(linear_gelu_fused(act48, pre48, x, w48, nullptr)) << "fp32";
  {
    Autocast scope(DType::bf16);
    EXPECT_FALSE(linear_gelu_fused(act44, pre44, x, w44, nullptr)) << "O = 44";
    setenv("MESHTRAIN_FUSED_GELU", "off", 1);
    EXPECT_FALSE(linear_gelu_fused(act48, pre48, x, w48, nullptr)) << "MESHTRAIN_FUSED_GELU=off";
    unsetenv("MESHTRAIN_FUSED_GELU");
  }
  for (const Tensor* t : {&act44, &pre44, &act48, &pre48})
    for (float v : to_host(*t)) ASSERT_TRUE(std::isnan(v)) << "written where the fusion did not apply";
}

// The backward's counterpart: the same checks, and false (nothing written) for fp32, for an
// in-dim not a multiple of 8 and when turned off.
TEST(CudaLinear, DgeluFusedMatchesTheFloat64Reference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  if (gelu_fusion_off()) GTEST_SKIP() << "MESHTRAIN_FUSED_GELU=off";
  for (DType dt : {DType::bf16, DType::f16}) {
    check_dgelu_fused(dt, 37, 48, 64);
    check_dgelu_fused(dt, 64, 384, 96);
  }
  std::mt19937 g(8);
  const Tensor dy = to_dev(randv(5 * 16, g), {5, 16}), w44 = to_dev(randv(44 * 16, g), {44, 16});
  const Tensor w48 = to_dev(randv(48 * 16, g), {48, 16});
  const Tensor dx44 = poisoned({5, 44}), dx48 = poisoned({5, 48});
  EXPECT_FALSE(linear_dgelu_fused(dx48, dy, w48, poisoned({5, 48}))) << "fp32";
  {
    Autocast scope(DType::bf16);
    EXPECT_FALSE(linear_dgelu_fused(dx44, dy, w44, poisoned({5, 44}))) << "I = 44";
    setenv("MESHTRAIN_FUSED_GELU", "off", 1);
    EXPECT_FALSE(linear_dgelu_fused(dx48, dy, w48, poisoned({5, 48}))) << "MESHTRAIN_FUSED_GELU=off";
    unsetenv("MESHTRAIN_FUSED_GELU");
  }
  for (const Tensor* t : {&dx44, &dx48})
    for (float v : to_host(*t)) ASSERT_TRUE(std::isnan(v)) << "written where the fusion did not apply";
}

// Tensors that are views at odd element offsets of a larger buffer (4-byte aligned only, as
// parameters inside a flat buffer can be): cuBLASLt must be told the alignment, and an
// unaligned bias goes through the separate add_bias kernel.
TEST(CudaLinear, UnalignedViews) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  const int64_t N = 33, I = 40, O = 24;
  std::mt19937 g(7);
  VecF x = randv(N * I, g), w = randv(O * I, g), b = randv(O, g), dy = randv(N * O, g), dw0 = randv(O * I, g);
  VecF y_c(N * O), dx_c(N * I), dw_c = dw0, db_c(O, 0.0f);
  Tensor bt = tf(b, {O}), dbt = tf(db_c, {O});
  linear_forward(tf(y_c, {N, O}), tf(x, {N, I}), tf(w, {O, I}), &bt);
  linear_backward_input(tf(dx_c, {N, I}), tf(dy, {N, O}), tf(w, {O, I}), false);
  linear_backward_weight(tf(dw_c, {O, I}), &dbt, tf(dy, {N, O}), tf(x, {N, I}));

  // One device buffer; each tensor a view starting at an odd element offset.
  const int64_t total = 1 + N * I + 3 + O * I + 5 + O + 1 + N * O + 3 + N * O + 1 + N * I + 3 + O * I + 1 + O;
  Tensor buf = to_dev(VecF(total, kNaN), {total});
  int64_t off = 1;
  auto take = [&](int64_t n, const Shape& s, int64_t gap) {
    Tensor t = buf.view(off, s);
    off += n + gap;
    return t;
  };
  Tensor xd = take(N * I, {N, I}, 3), wd = take(O * I, {O, I}, 5), bd = take(O, {O}, 1), dyd = take(N * O, {N, O}, 3);
  Tensor yd = take(N * O, {N, O}, 1), dxd = take(N * I, {N, I}, 3), dwd = take(O * I, {O, I}, 1), dbd = take(O, {O}, 0);
  ASSERT_LE(off, total);
  xd.copy_from(tf(x, {N, I}));
  wd.copy_from(tf(w, {O, I}));
  bd.copy_from(tf(b, {O}));
  dyd.copy_from(tf(dy, {N, O}));
  dwd.copy_from(tf(dw0, {O, I}));
  VecF zeros(O, 0.0f);
  dbd.copy_from(tf(zeros, {O}));
  cuda::linear_forward(yd, xd, wd, &bd);
  cuda::linear_backward_input(dxd, dyd, wd, false);
  cuda::linear_backward_weight(dwd, &dbd, dyd, xd);
  EXPECT_LT(rel_err(to_host(yd), y_c), kTol32);
  EXPECT_LT(rel_err(to_host(dxd), dx_c), kTol32);
  EXPECT_LT(rel_err(to_host(dwd), dw_c), kTol32);
  EXPECT_LT(rel_err(to_host(dbd), db_c), kTol32);
}

// bias_backward (db += column sums) and add_bias (y += b on every row) against the CPU ops;
// row counts that give one chunk, many chunks, and the 512-chunk cap of the column sum.
TEST(CudaLinear, BiasBackwardAndAddBias) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  struct Case {
    int64_t N, O;
  };
  unsigned seed = 300;
  for (Case c : {Case{1, 23}, Case{37, 19}, Case{64, 1}, Case{5000, 33}, Case{40000, 96}, Case{512, 2304}}) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " O=" << c.O);
    std::mt19937 g(seed++);
    VecF dy = randv(c.N * c.O, g), db0 = randv(c.O, g), b = randv(c.O, g), y0 = randv(c.N * c.O, g);
    VecF db_c = db0, y_c = y0;
    bias_backward(tf(db_c, {c.O}), tf(dy, {c.N, c.O}));
    add_bias(tf(y_c, {c.N, c.O}), tf(b, {c.O}));
    auto run = [&]() {
      Tensor dbd = to_dev(db0, {c.O}), yd = to_dev(y0, {c.N, c.O});
      cuda::bias_backward(dbd, to_dev(dy, {c.N, c.O}));
      cuda::add_bias(yd, to_dev(b, {c.O}));
      return std::vector<VecF>{to_host(dbd), to_host(yd)};
    };
    const auto got = run(), again = run();
    // db: db0 plus sums of up to 40000 terms, in another order than the CPU's row order.
    // For random signs the summation error is ~sqrt(N / 2) * 2^-24 relative to the sum
    // on either side (3e-6 at N = 5000, 9e-6 at N = 40000): 1e-5 up to N = 5000, 1e-4 above
    // (a tenfold margin).
    EXPECT_LT(rel_err(got[0], db_c), c.N > 1000 ? 1e-4 : kTol32) << "db";
    // y: one addition per element, the same on both sides: exact.
    EXPECT_TRUE(same_bits(got[1], y_c)) << "add_bias";
    EXPECT_TRUE(same_bits(got[0], again[0])) << "bias_backward: two GPU runs differ";
    // db against float64: the column sums plus db0.
    test::VecD ref(c.O);
    for (int64_t o = 0; o < c.O; ++o) {
      double s = db0[o];
      for (int64_t n = 0; n < c.N; ++n) s += dy[n * c.O + o];
      ref[o] = s;
    }
    // Per element with kRtol / kAtol * max|ref| (op_harness.h), up to N = 5000 where the
    // fp32 sums' own error (~3e-6 relative) is well inside it.
    if (c.N <= 5000) test::expect_close(got[0], ref, "db vs float64");
  }
}

TEST(CudaLinear, BadShapesThrow) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  VecF v(16, 1.0f);
  Tensor a44 = to_dev(v, {4, 4}), a43 = to_dev(VecF(12, 1.0f), {4, 3}), a24 = to_dev(VecF(8, 1.0f), {2, 4});
  Tensor a34 = to_dev(VecF(12, 1.0f), {3, 4}), b5 = to_dev(VecF(5, 1.0f), {5}), b4 = to_dev(VecF(4, 1.0f), {4});
  Tensor host44 = tf(v, {4, 4});
  EXPECT_THROW(cuda::linear_forward(a44, a43, a44, nullptr), Error);  // x in-dim != w in-dim
  EXPECT_THROW(cuda::linear_forward(a24, a44, a44, nullptr), Error);  // y rows != x rows
  EXPECT_THROW(cuda::linear_forward(a44, a44, a44, &b5), Error);      // bias size != out-dim
  EXPECT_THROW(cuda::linear_forward(a44, host44, a44, nullptr), Error);  // x on the host
  EXPECT_THROW(cuda::linear_io_forward(a44, a44, a43, nullptr), Error);  // w [in, out] = [4, 3] but y has 4 cols
  EXPECT_THROW(cuda::linear_backward_input(a43, a44, a44, false), Error);
  EXPECT_THROW(cuda::linear_io_backward_input(a44, a44, a43, true), Error);
  EXPECT_THROW(cuda::linear_backward_weight(a44, nullptr, a34, a44), Error);  // dy rows != x rows
  EXPECT_THROW(cuda::linear_io_backward_weight(a44, &b5, a44, a44), Error);   // db size
  EXPECT_THROW(cuda::bias_backward(b5, a44), Error);
  EXPECT_THROW(cuda::add_bias(a43, b5), Error);
  EXPECT_THROW(cuda::add_bias(host44, b4), Error);
}

#else
TEST(CudaLinear, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace mt
