// Token (and learned position) embedding lookup.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

// tokens: i32 [B, T] (ids in [0, V), checked); a 1-D tokens tensor takes T from out's [B, T, C].
// out[B, T, C] = wte[tokens[b, t]] (+ wpe[t] when wpe is given; wpe is [maxT, C], maxT >= T)
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe);
// dwte[V, C] += scatter of dout by token; dwpe[maxT, C] += sum over batch of dout.
// Deterministic: the sum order does not depend on the thread count.
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens);

// Vocabulary-parallel lookup (tensor parallelism): wte holds the rows of ids
// [begin, begin + valid) (and padding rows after them); ids are checked against [0, vocab).
// out[b, t] = wte[id - begin] for ids held, 0 for the others, so the sum over the tp ranks
// is the whole lookup. Backward adds dout into the rows held, deterministically.
void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t begin, int64_t valid,
                             int64_t vocab);
void embedding_shard_backward(const Tensor& dwte, const Tensor& dout, const Tensor& tokens, int64_t begin,
                              int64_t valid, int64_t vocab);
// Learned positions added after the reduction (or alone): out[B, T, C] += wpe[pos[t]];
// dwpe[pos[t]] += sum over b. pos: T distinct rows of wpe (null: 0..T-1).
void position_forward(const Tensor& out, const Tensor& wpe, const int32_t* pos = nullptr);
void position_backward(const Tensor& dwpe, const Tensor& dout, const int32_t* pos = nullptr);

}  // namespace mt
