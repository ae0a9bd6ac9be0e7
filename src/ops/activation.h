// Pointwise activations: tanh-approximated GELU (GPT-2) and SwiGLU (Llama).
#pragma once
#include "core/tensor.h"

namespace mt {

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (out may alias x)
void gelu_forward(const Tensor& out, const Tensor& x);
// dx = dout * gelu'(x)   (overwrites dx; dx may alias dout)
void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout);

// gu[N, 2F] holds gate (first F columns) and up (last F): out[N, F] = silu(gate) * up
void swiglu_forward(const Tensor& out, const Tensor& gu);
// dgu[N, 2F] = gradients of gate and up (overwrites; dgu may alias gu)
void swiglu_backward(const Tensor& dgu, const Tensor& gu, const Tensor& dout);

// a += b (same numel): the residual add, whose backward is the identity on both inputs.
void add_inplace(const Tensor& a, const Tensor& b);
// y[N, O] += b[O] on every row (a bias added after a tensor-parallel reduction).
void add_bias(const Tensor& y, const Tensor& b);

}  // namespace mt
