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

}  // namespace mt
