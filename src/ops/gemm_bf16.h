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
// fp32 products of the rounded operands, as on a CPU without them).
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

// C[M, N] = op(A)[M, K] @ op(B)[K, N] + beta C (beta 0 or 1), row-major; op transposes when
// ta / tb. A and B are fp32 arrays of bf16 values (others are rounded to the nearest).
// Requires bf16_gemm_available(). Packs the operands into workspace per calling thread,
// kept between calls: 1 KiB per row of op(A) (for GPT-2's head weight gradient, 50304 rows,
// 49 MiB) and 4 MiB for op(B).
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace mt
