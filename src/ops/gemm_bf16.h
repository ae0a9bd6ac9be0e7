// bf16 matrix products on the CPU's bf16 dot-product instructions (AVX512_BF16's
// vdpbf16ps: 16 fp32 lanes, each adding two bf16 x bf16 products per instruction).
//
// Under a bf16 Autocast scope every operand of a linear layer holds bf16 values (ops/autocast.h),
// and a product of two bf16 values is exact in fp32: so this computes what gemm (ops/gemm.h)
// computes on the same operands, fp32 sums of exact products, in another summation order
// (pairs of k, blocks of 512) and with subnormal inputs and results flushed to zero, as the
// instruction does. The work is split by the shape alone and each output element is summed
// by one thread over k in a fixed order, so the bits do not depend on the thread count.
//
// Used where the CPU has the instructions, unless MESHTRAIN_CPU_BF16=off (then gemm runs
// fp32 products of the rounded operands, as on a CPU without them). The operands are read
// as they are, fp32 (rounded while packed) or bf16 (an activation kept in 16 bits): no
// rounded copy is made first.
//
//   gemm_bf16(false, true, N, O, I, x, I, w, I, 0.0f, y, O);   // y[N, O] = x[N, I] @ w[O, I]^T
#pragma once
#include <cstdint>
#include <string>

namespace mt {

// Whether gemm_bf16 runs here: the CPU has AVX512_BF16 and MESHTRAIN_CPU_BF16 is not "off".
bool bf16_gemm_available();
// "AVX512_BF16 kernel", or why the bf16 products run as fp32 products of rounded operands.
std::string bf16_gemm_description();

// An operand of gemm_bf16: fp32 values (rounded to the nearest bf16 as they are packed), or
// bf16 values as their 16 bits (uint16_t, as a bf16 tensor holds them).
struct Bf16Src {
  Bf16Src(const float* values) : data(values), bf16(false) {}
  Bf16Src(const uint16_t* bits) : data(bits), bf16(true) {}
  const void* data;
  bool bf16;
};

// C[M, N] = op(A)[M, K] @ op(B)[K, N] + beta C (beta 0 or 1), row-major; op transposes when
// ta / tb; lda and ldb count elements. Requires bf16_gemm_available(). Packs the operands
// into workspace per calling thread, kept between calls: at most 4 MiB for op(A) and 4 MiB
// for op(B).
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, Bf16Src A, int64_t lda, Bf16Src B, int64_t ldb,
               float beta, float* C, int64_t ldc);

}  // namespace mt
