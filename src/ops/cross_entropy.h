// Softmax cross-entropy over the vocabulary, fused with its backward.
#pragma once
#include "core/tensor.h"

namespace mt {

// logits[N, V] (leading dims fold into N), targets: i32 with N elements, each in [0, V) or -1.
// losses[N] = logsumexp(logits[n]) - logits[n, targets[n]]; saves lse[N].
// Rows whose target is -1 are ignored (loss 0). Returns the sum of losses (in double).
double cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets);
// dlogits[N, V] = (softmax(logits) - onehot(target)) * scale; dlogits may alias logits.
// Ignored rows get zero gradient.
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, float scale);

// The same loss over a vocabulary split by columns (tensor parallelism): this rank holds
// logits[N, Vl] for the global columns [begin, begin + valid); columns past `valid` are
// padding and never count. The caller reduces between the steps:
//   cross_entropy_row_max(m, ...)            then m = max over ranks
//   cross_entropy_row_stats(s, t, ..., m)    then s = sum, t = sum over ranks
//   cross_entropy_finish(losses, lse, m, s, t, targets)  -> the loss sum
// With one rank holding every column (begin 0, valid V) this is cross_entropy_forward.
void cross_entropy_row_max(const Tensor& row_max, const Tensor& logits, int64_t valid);
// sum_exp[N] = sum over held columns of exp(logit - row_max); target_logit[N] = the target's
// logit where this rank holds it, else 0.
void cross_entropy_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, int64_t begin, int64_t valid, const Tensor& row_max);
// lse = row_max + log(sum_exp); losses = lse - target_logit (0 where the target is -1).
double cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sum_exp,
                            const Tensor& target_logit, const Tensor& targets);
// first[N] = -(the global id of the first held column whose logit equals row_max), or -inf
// where none does: the maximum over ranks is minus the lowest id holding the row maximum
// (ids are exact in float below 2^24).
void cross_entropy_first_max(const Tensor& first, const Tensor& logits, const Tensor& row_max, int64_t begin,
                             int64_t valid);
// dlogits for this rank's columns; padding columns get zero gradient.
void cross_entropy_backward_shard(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                                  const Tensor& targets, float scale, int64_t begin, int64_t valid);
// The same gradient fed straight to the head's two products (w [V, C] over this rank's
// columns, x [N, C] its input), where a device does it without an fp32 copy: dx = dlogits w,
// dw += dlogits^T x, the bits of cross_entropy_backward_shard then linear_backward. On the
// GPU under a 16-bit Autocast scope the loss's kernel writes the gradient in 16 bits into
// scratch, and logits are left as they are. Returns false, doing nothing, everywhere else.
bool cross_entropy_head_backward(const Tensor& dx, const Tensor& dw, const Tensor& logits, const Tensor& lse,
                                 const Tensor& targets, float scale, int64_t begin, int64_t valid, const Tensor& x,
                                 const Tensor& w);

}  // namespace mt
