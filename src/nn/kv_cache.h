// Keys and values of the tokens a model has read, for generating text a token at a time
// (meshtrain sample): Model::forward_cached runs only the new tokens through the blocks,
// and their attention reads the cached rows instead of recomputing them.
//
//   KvCache cache(cfg, alloc, B);                             // B sequences side by side
//   Tensor rows = model.forward_cached(prompts, B, n, cache); // [B, V]: the logits of token n
//   rows = model.forward_cached(next, B, 1, cache);           // at position n, and so on
//
// The cache is the attention the blocks are handed (the context-parallel seam, nn/cp.h):
// in each block, in order, the new rows' keys and values join the layer's cache and their queries
// attend causally to every row held. Up to model.seq_len tokens (learned positions end
// there); clear() starts new sequences at position 0. The B sequences have the same length.
#pragma once
#include <vector>

#include "core/allocator.h"
#include "core/tensor.h"
#include "nn/cp.h"
#include "nn/model_config.h"

namespace mt {

class KvCache final : public CpMappings {
 public:
  // Room for B sequences of cfg.seq_len tokens in every layer (MemTag::activations):
  // n_layer x B x seq_len x 2 NKV D floats (the keys and values; queries are not kept).
  KvCache(const ModelConfig& cfg, Allocator& alloc, int batch = 1);
  int batch() const { return batch_; }
  int length() const { return length_; }      // tokens held, at positions 0 .. length() - 1
  int capacity() const { return capacity_; }  // model.seq_len
  void clear() { length_ = 0; }

  // Model::forward_cached's bracket around the blocks' forward of n new tokens.
  void begin(int n);
  void end();

  // One block's attention: the k|v columns of qkv [B, n, W], the new rows (rope applied), are
  // stored after the layer's cached rows; out [B, n, NH D] and lse [B, NH, n] of their
  // queries over all rows.
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head,
                         int n_kv_head) override;
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int n_head, int n_kv_head) override;
  bool takes_kept(const Tensor&, int, int) const override { return false; }  // fp32 rows

 private:
  std::vector<Tensor> rows_;  // [n_layer] x [B, seq_len, 2 NKV D]: k|v of the tokens held
  int batch_ = 1;
  int capacity_ = 0;
  int length_ = 0;
  int adding_ = 0;  // new tokens in the forward under way (0: none)
  int layer_ = 0;   // the next block's layer in it
};

}  // namespace mt
