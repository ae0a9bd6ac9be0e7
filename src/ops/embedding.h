// Token (and learned position) embedding lookup.
#pragma once
#include "core/tensor.h"

namespace mt {

// out[B, T, C] = wte[tokens[b, t]] (+ wpe[t] when wpe is given; wpe is [maxT, C], maxT >= T)
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe);
// dwte[V, C] += scatter of dout by token; dwpe[maxT, C] += sum over batch of dout.
// Deterministic: the sum order does not depend on the thread count.
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens);

}  // namespace mt
