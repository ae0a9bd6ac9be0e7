// Causal self-attention with grouped-query heads, on a fused qkv buffer.
// qkv[B, T, (NH + 2 NKV) * D]: per token the NH query heads, then NKV key heads, then NKV
// value heads, each D wide. Query head h reads key/value head h / (NH / NKV).
// Scores are scaled by 1/sqrt(D); the softmax probabilities att[B, NH, T, T] are saved
// for backward (entries above the diagonal are zero).
#pragma once
#include "core/tensor.h"

namespace mt {

// out[B, T, NH * D]
void attention_forward(const Tensor& out, const Tensor& att, const Tensor& qkv, int n_head, int n_kv_head);
// dqkv[B, T, (NH + 2 NKV) * D] (overwritten). scratch: at least B*NH*T*T floats of workspace
// (contents on entry ignored, left undefined).
void attention_backward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout, const Tensor& qkv,
                        const Tensor& att, int n_head, int n_kv_head);

}  // namespace mt
