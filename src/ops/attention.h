// Causal self-attention with grouped-query heads, on a fused qkv buffer, in three variants.
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
// - Parts (attention_part_forward / attention_part_backward): the fused kernel between a
//   block of query rows and a block of key/value rows (for context parallelism, where a
//   rank's queries meet the key/value blocks of the other ranks in turn); causality by
//   global sequence positions, the parts of a row merged through their log-sum-exp. The
//   fused variant is the part of all rows against all rows, at position 0.
//
// All are bit-identical for any number of OpenMP threads.
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt {

// The dimensions of a fused qkv buffer, checked (shared by every variant).
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
// log-sum-exp per query row. On the GPU qkv (and out, which the backward reads) may be in
// bf16 or f16 (the dtype of a 16-bit Autocast scope if one is open): values already rounded
// to the operands' 16 bits, read as they are by the tensor-core kernels (widened for the
// others), with the results of their fp32 copies; a 16-bit out is written rounded to nearest
// even, the bits of the fp32 out converted. On the CPU all are f32.
void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head);
// dqkv[B, T, (NH + 2 NKV) * D] (overwritten) from dout[B, T, NH * D] and the forward's
// qkv, out and lse.
void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head);
// Whether the two read a 16-bit qkv (and out) as it is under the current Autocast scope:
// qkv in the scope's 16-bit dtype on the GPU, where the tensor-core kernels that read 16
// bits apply (head dims 64 and 128, a 16-byte aligned qkv, MESHTRAIN_ATTENTION_KERNEL unset).
// Elsewhere hand them fp32: a 16-bit qkv would be widened into scratch (GPU) or refused (CPU).
bool attention_fused_reads_16bit(const Tensor& qkv, int n_head, int n_kv_head);

// Rows [first, first + count) of a [B, T, ...] buffer (every batch entry alike), row `first`
// at sequence position `position` (>= 0), the next at position + 1, ...
struct AttentionRows {
  int64_t first, count, position;
};

// Causal attention of the query rows q of qkv_q [B, Tq, (NH + 2 NKV) D] over the key/value
// rows k of qkv_kv [B, Tk, (NH + 2 NKV) D] (the same B and width; the buffers may be the
// same tensor): the key at position pk is visible to the query at pq iff pk <= pq. Writes
// rows q of out [B, Tq, NH D] and lse [B, NH, Tq] and nothing else:
//   merge = false: this part alone; a row that sees no key gets out 0 and lse -inf.
//   merge = true:  combined with what rows q hold (earlier parts of the same queries):
//                  lse' = log(e^lse + e^lse_part),
//                  out' = out e^(lse - lse') + out_part e^(lse_part - lse');
//                  a row with lse = -inf takes the part as it is (whatever out holds:
//                  lse = -inf alone marks a row empty), a row that sees no key of this
//                  part is left as it is.
// A part where no query sees any key costs nothing (merge = true) or only the fill.
// Per-thread workspace as in the fused kernel with T = Tk_vis, the keys some query sees
// (at most k.count): about 2 Tk_vis D + 2 x 64 x 256 floats (5 Tk_vis D in backward when
// D is not a multiple of the vector width), kept between calls. Nothing T x T. The float
// operations depend only on the shapes, q.count, k.count and q.position - k.position, not
// on where the rows lie in their buffers (or on the thread count).
void attention_part_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                            const Tensor& qkv_kv, AttentionRows k, int n_head, int n_kv_head, bool merge);
// attention_part_forward (merge = false, the same bits) with the keys and values held apart
// from the queries: kv [B, Tk, 2 NKV D], per row the NKV key heads, then the NKV value heads
// (the k|v columns of a fused row). For a key/value cache (nn/kv_cache.h); CPU only.
void attention_kv_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                          const Tensor& kv, AttentionRows k, int n_head, int n_kv_head);
// Backward of one part, given dout [B, Tq, NH D] and the FINAL (all parts merged) out
// [B, Tq, NH D] and lse [B, NH, Tq] of the query rows: adds (+=) the part's gradient into
// the query columns of rows q of dqkv_q [B, Tq, W] and into the key and value columns of
// rows k of dqkv_kv [B, Tk, W]; no other element of either is touched, so dqkv_q and
// dqkv_kv may be the same tensor. Summed over all parts of every query row, starting from
// zeros, this is the gradient of the whole attention (each part's softmax backward uses
// delta = dout . out, exact per part because out and lse are final).
void attention_part_backward(const Tensor& dqkv_q, const Tensor& dqkv_kv, const Tensor& dout, const Tensor& qkv_q,
                             const Tensor& out, const Tensor& lse, AttentionRows q, const Tensor& qkv_kv,
                             AttentionRows k, int n_head, int n_kv_head);

}  // namespace mt
