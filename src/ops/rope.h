// Rotary position embedding, Hugging Face rotate-half convention: for head dim D and
// i < D/2, with angle = pos * theta^(-2i/D):
//   x'[i]       = x[i] cos - x[i + D/2] sin
//   x'[i + D/2] = x[i + D/2] cos + x[i] sin
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

// x[B, T, H, D] (must be 4-D: reshape a fused [B, T, W] qkv buffer to [B, T, H, D] first)
// rotated in place on its first n_rot heads (the q and k heads of a fused
// qkv buffer: H = n_head + 2 n_kv_head, n_rot = n_head + n_kv_head). Position of row t is
// pos[t] (pos: T entries; null: t).
void rope_forward(const Tensor& x, int n_rot, float theta, const int32_t* pos = nullptr);
// The inverse rotation, applied in place to the gradient (the rotation is orthogonal).
void rope_backward(const Tensor& dx, int n_rot, float theta, const int32_t* pos = nullptr);

}  // namespace mt
