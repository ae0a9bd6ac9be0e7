#include "nn/kv_cache.h"

#include <cstring>

#include "core/error.h"
#include "ops/attention.h"

namespace mt {

KvCache::KvCache(const ModelConfig& cfg, Allocator& alloc, int batch) : batch_(batch), capacity_(cfg.seq_len) {
  MT_CHECK(batch >= 1, "internal: a key/value cache for " << batch << " sequences");
  for (int l = 0; l < cfg.n_layer; ++l)
    rows_.push_back(Tensor::empty({batch, cfg.seq_len, 2 * int64_t{cfg.kv_heads()} * cfg.head_dim()}, DType::f32,
                                  alloc, MemTag::activations));
}

void KvCache::begin(int n) {  // a forward that threw part way left length_ as it was
  MT_CHECK(n >= 1 && n <= capacity_ - length_, "internal: " << n << " new tokens after the cache's " << length_
                                                             << " do not fit in model.seq_len = " << capacity_);
  adding_ = n;
  layer_ = 0;
}

void KvCache::end() {
  MT_CHECK(adding_ > 0 && layer_ == static_cast<int>(rows_.size()),
           "internal: a cached forward ended after " << layer_ << " of " << rows_.size() << " layers");
  length_ += adding_;
  adding_ = 0;
}

void KvCache::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head) {
  MT_CHECK(adding_ > 0 && layer_ < static_cast<int>(rows_.size()), "internal: attention outside a cached forward");
  const Tensor& held = rows_[layer_++];  // [B, T, KW]
  const int64_t KW = held.dim(2), T = capacity_, W = qkv.ndim() == 3 ? qkv.dim(2) : 0, first_k = W - KW;
  MT_CHECK(qkv.ndim() == 3 && qkv.dim(0) == batch_ && qkv.dim(1) == adding_ && first_k > 0,
           "internal: cached attention takes [" << batch_ << ", " << adding_ << ", W] rows, not "
                                                << shape_str(qkv.shape()));
  const float* src = qkv.f32();
  for (int64_t r = 0; r < batch_ * adding_; ++r) {  // sequence b's new rows after its cached ones
    const int64_t b = r / adding_, t = length_ + r % adding_;
    std::memcpy(held.f32() + (b * T + t) * KW, src + r * W + first_k, KW * sizeof(float));
  }
  attention_kv_forward(out, lse, qkv, {0, adding_, length_}, held, {0, length_ + adding_, 0}, n_head, n_kv_head);
}

void KvCache::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, int) {
  MT_FAIL("internal: a key/value cache is for inference; nothing trains through it");
}

}  // namespace mt
