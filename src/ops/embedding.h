// Token (and learned position) embedding lookup.
#pragma once
#include "core/tensor.h"

namespace mt {

// tokens: i32 [B, T] (ids in [0, V), checked); a 1-D tokens tensor takes T from out's [B, T, C].
// out[B, T, C] = wte[tokens[b, t]] (+ wpe[t] when wpe is given; wpe is [maxT, C], maxT >= T)
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe);
// dwte[V, C] += scatter of dout by token; dwpe[maxT, C] += sum over batch of dout.
// Deterministic: the sum order does not depend on the thread count.
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens);

}  // namespace mt
