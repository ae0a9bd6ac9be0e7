// Matrix products in 16-bit precision (training.precision = bf16 | fp16).
//
// While an Autocast scope is alive on a thread, the linear layers that thread calls
// (ops/linear.h) round their activation operands (x in forward, dy and x in backward) to
// the scope's dtype before the product; products are exact in fp32 (8- or 11-bit
// mantissas) and accumulate in fp32, so this is a 16-bit matrix product with fp32
// accumulation and an fp32 result (under bf16 on the CPU's bf16 instructions where it has
// them: ops/gemm_bf16.h). Weights are not rounded again: under a scope they must
// already hold 16-bit values (Model widens its 16-bit working copies to fp32 for compute).
// Norms, softmax, attention's internal products, the loss and the optimizer stay fp32.
//
//   { Autocast scope(DType::bf16); linear_forward(y, x, w, &b); }
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

class Autocast {
 public:
  explicit Autocast(DType t);  // f32 (no rounding), bf16 or f16
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  DType prev_;
};

// The innermost scope's dtype on this thread (f32 outside any scope).
DType autocast_dtype();

// dst[i] = src[i] rounded to the nearest value of dtype t (bf16 or f16, ties to even;
// fp16 overflows to +-inf as the hardware does), as a float. dst may equal src. bits, where
// given: the same values in t's 16 bits as well (in the same pass).
void round_to(DType t, const float* src, float* dst, int64_t n, uint16_t* bits = nullptr);
// x (fp32, on the host or a GPU) rounded in place to t (bf16 or f16) as round_to does;
// bits, where given (t's dtype, x's size, on x's device): the same values in 16 bits as
// well, in the same pass.
void round_tensor(DType t, const Tensor& x, const Tensor* bits = nullptr);

}  // namespace mt
