// Causal self-attention with grouped-query heads, on a fused qkv buffer, in two variants.
//
// qkv[B, T, (NH + 2 NKV) * D]: per token the NH query heads, then NKV key heads, then NKV
// value heads, each D wide. Query head h reads key/value head h / (NH / NKV). Scores are
// scaled by 1/sqrt(D); key s is visible to query t when s <= t.
//
// - Materialized (attention_forward / attention_backward): the softmax probabilities
//   att[B, NH, T, T] are saved for backward (entries above the diagonal are zero), and
//   backward needs another B*NH*T*T floats of scratch.
// - Fused (attention_fused_forward / attention_fused_backward): forward runs an online
//   softmax over key blocks and keeps only each row's log-sum-exp lse[B, NH, T]; backward
//   recomputes the probabilities block by block from q, k and lse. Nothing T x T outlives
//   a block: each thread keeps a workspace of about 2 T D + 2 x 64 x 256 floats (0.6 MiB
//   at T = 1024, D = 64). The default in the model (training.attention = fused).
//
// Both are bit-identical for any number of OpenMP threads.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

// The dimensions of a fused qkv buffer, checked (shared by both variants).
struct AttentionShape {
  int64_t B, T, NH, NKV, D, W, G;  // W = (NH + 2 NKV) D, G = NH / NKV query heads per kv head
};
// Throws mt::Error (message prefixed with `op`) when qkv is not [B, T, (NH + 2 NKV) D] f32.
AttentionShape attention_shape(const Tensor& qkv, int n_head, int n_kv_head, const char* op);

// out[B, T, NH * D]; att[B, NH, T, T] softmax probabilities.
void attention_forward(const Tensor& out, const Tensor& att, const Tensor& qkv, int n_head, int n_kv_head);
// dqkv[B, T, (NH + 2 NKV) * D] (overwritten). scratch: at least B*NH*T*T floats of workspace
// (contents on entry ignored, left undefined).
void attention_backward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout, const Tensor& qkv,
                        const Tensor& att, int n_head, int n_kv_head);

// out[B, T, NH * D]; lse[B, NH, T] = log sum_{s <= t} exp(score(t, s)), the scaled scores'
// log-sum-exp per query row.
void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head);
// dqkv[B, T, (NH + 2 NKV) * D] (overwritten) from dout[B, T, NH * D] and the forward's
// qkv, out and lse.
void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head);

}  // namespace mt
