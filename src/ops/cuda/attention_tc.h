// Tensor-core (WMMA) fused causal grouped-query attention for 16-bit training: the path
// attention_fused_forward / attention_fused_backward (ops/cuda/attention.cu) take when the
// thread's Autocast scope (ops/autocast.h) is bf16 or f16 and the head dim allows it.
//
// Semantics as PyTorch's bf16 / f16 autocast of scaled_dot_product_attention: q, k, v (and
// in backward dout, the probabilities P and dS) are rounded to the scope's 16-bit type as
// matrix operands; products accumulate in fp32; softmax statistics (max, sum, lse), out,
// lse and dqkv stay fp32 in memory. q|k|v (and out, which the backward reads) may come in
// fp32 or already rounded in the operands' 16-bit type, with the same results: the mma.sync
// kernels read 16-bit operands (an fp32 qkv is rounded into scratch first, dout by the
// backward's delta kernel), the WMMA kernels read fp32 and round tiles while loading them
// into shared memory (a 16-bit qkv is widened into scratch first).
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace mt::cuda {

// Whether the tensor-core kernels take head dim D: D % 16 == 0 and 16 <= D <= 128.
bool attention_tc_supported(int64_t D);

// Whether the automatic choice of both entry points below reads a 16-bit qkv as it is (the
// mma.sync kernels: D = 64 or 128, qkv 16-byte aligned, MESHTRAIN_ATTENTION_KERNEL unset),
// given an out and dqkv aligned as the allocator aligns them.
bool attention_tc_reads_16bit(const Tensor& qkv, const AttentionShape& s);

// Which forward kernel attention_tc_forward runs. automatic: the mma.sync kernel
// (attention_mma.cu) where it applies (D = 64 or 128, a 16-bit qkv 16-byte and out
// two-element aligned), the WMMA kernel otherwise, unless the environment variable
// MESHTRAIN_ATTENTION_KERNEL=wmma (read once) keeps the WMMA kernel everywhere. wmma / mma:
// that kernel (mma throws where it does not apply). Both compute the same softmax with the
// same roundings (only the fp32 summation order differs) and write the out and lse the
// backward kernels read.
enum class AttentionTcForward { automatic, wmma, mma };

// out[B, T, NH D] (f32 or dt: each value rounded to nearest even, the bits of the fp32 out
// converted; the mma.sync kernel writes them so, the others through fp32 scratch), lse[B,
// NH, T] (f32) from qkv[B, T, (NH + 2 NKV) D] (f32 or dt), on the device, the shapes already
// checked by the caller (s from attention_shape). dt: bf16 or f16, the operands' 16-bit type.
void attention_tc_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s, DType dt,
                          AttentionTcForward kernel = AttentionTcForward::automatic);

// The mma.sync forward (attention_mma.cu): head dims it takes (64, 128); whether the
// pointers allow its vector loads and stores (of qkv as attention_tc_forward is given it);
// the forward itself (as attention_tc_forward, but qkv in dt); its resident blocks per SM
// (needs a GPU) and its dynamic shared memory in bytes.
bool attention_mma_supported(int64_t D);
bool attention_mma_aligned(const Tensor& out, const Tensor& qkv);
void attention_mma_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s, DType dt);
int attention_mma_occupancy(int64_t D, DType dt, int64_t* smem_bytes);

// Which dK/dV and dQ kernels attention_tc_backward runs (after its delta kernel).
// automatic: the mma.sync kernels (attention_mma_backward.cu) where they apply (D = 64 or
// 128, a 16-bit qkv 16-byte and dqkv 8-byte aligned), WMMA otherwise or when
// MESHTRAIN_ATTENTION_KERNEL=wmma. wmma / mma: that one (mma throws where it does not apply).
// Both round the same operands (q, k, v, dout, P, dS) with the same expressions; only the
// fp32 summation order differs.
enum class AttentionTcBackward { automatic, wmma, mma };
// dqkv[B, T, (NH + 2 NKV) D] (overwritten) from dout[B, T, NH D] (f32), qkv and the
// forward's out (f32 or dt) and lse; shapes already checked by the caller, dt as above.
void attention_tc_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                           const Tensor& lse, const AttentionShape& s, DType dt,
                           AttentionTcBackward kernel = AttentionTcBackward::automatic);
// The mma.sync dK/dV and dQ kernels (attention_mma_backward.cu): whether the pointers allow
// their vector loads and stores (of qkv as attention_tc_backward is given it); the two
// kernels given qkv and dout in dt (16-byte aligned) and delta[B, NH, T] (device memory,
// from attention_tc_backward's delta kernel).
bool attention_mma_backward_aligned(const Tensor& dqkv, const Tensor& qkv);
void attention_mma_backward_kernels(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                                    const float* delta, const AttentionShape& s, DType dt);

// Resident blocks per SM of the tensor-core kernels (forward, dK/dV, dQ) at head dim D for
// the 16-bit type dt (cudaOccupancyMaxActiveBlocksPerMultiprocessor, 128 threads and their
// dynamic shared memory, in bytes), for the benchmarks. Needs a GPU.
struct AttentionTcOccupancy {
  int forward, dkv, dq;
  int64_t forward_smem, backward_smem;
};
AttentionTcOccupancy attention_tc_occupancy(int64_t D, DType dt);

}  // namespace mt::cuda
