// The CUDA attention parts (context parallelism) and the strided copy the ring packs its
// messages with. Semantics of the attention parts as in ops/attention.h, every tensor on
// the device; the kernels are attention.cu's. The parts run in fp32 under any Autocast
// scope (the whole-sequence attention takes the tensor cores under bf16 / f16), so context
// parallelism on the GPU rounds less than one rank does in 16 bits.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace mt::cuda {

void attention_part_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                            const Tensor& qkv_kv, AttentionRows k, int n_head, int n_kv_head, bool merge);
void attention_part_backward(const Tensor& dqkv_q, const Tensor& dqkv_kv, const Tensor& dout, const Tensor& qkv_q,
                             const Tensor& out, const Tensor& lse, AttentionRows q, const Tensor& qkv_kv,
                             AttentionRows k, int n_head, int n_kv_head);

// dst[r * dst_ld + c] = src[r * src_ld + c] for r < rows, c < cols (device memory, floats;
// cols <= both strides): one cudaMemcpy2DAsync on the compute stream.
void copy_columns(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols);

}  // namespace mt::cuda
