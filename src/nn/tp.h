// What the model needs from tensor parallelism: which share of each layer this rank holds
// (TpShard, LocalDims) and the conjugate mappings at the borders of the split layers
// (TpMappings). The model never communicates itself: it calls these functions, which are
// identities for a single rank; parallel/tensor.h implements them over the tp group.
//
// A block under tensor parallelism (Megatron's split, two reductions forward, two backward):
//   x --copy--> column-parallel q|k|v (this rank's heads) --> attention --> row-parallel
//     output projection (partial sums) --reduce--> + bias --> residual
//   and the same around the MLP: copy, column-parallel up (and gate), row-parallel down, reduce.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "nn/model_config.h"

namespace mt {

// This rank's place in the tp group (size 1: the whole model).
struct TpShard {
  int size = 1, rank = 0;
};

// The dimensions of this rank's share of every layer.
struct LocalDims {
  int64_t C = 0;          // d_model (never split)
  int64_t D = 0;          // head dimension
  int64_t NH = 0;         // query heads held
  int64_t NKV = 0;        // key/value heads held (one when tp is a multiple of n_kv_head)
  int64_t F = 0;          // MLP hidden units held
  int64_t V = 0;          // vocabulary rows held, padding included (the padded vocabulary / tp)
  int64_t vocab_begin = 0, vocab_valid = 0;  // first global vocabulary row held, and how many are real
  int64_t kv_sharers = 1; // ranks that hold each key/value head (tp / n_kv_head when that is > 1)
  int64_t seq_split = 1;  // sequence parallelism: the residual stream holds T / seq_split positions
  int64_t T = 0;          // positions of each sequence this rank computes (seq_len / cp: context parallelism)
  int64_t qkv() const { return (NH + 2 * NKV) * D; }
  int64_t attn() const { return NH * D; }  // the attention output's width before the projection
};

// Throws mt::Error naming the key when the model cannot be split tp ways.
void validate_tp(const ModelConfig& cfg, int tp);
LocalDims local_dims(const ModelConfig& cfg, TpShard tp);
// The vocabulary padded to a multiple of tp (padded logits never count).
int64_t padded_vocab(const ModelConfig& cfg, int tp);

// The conjugate mappings and the reductions of the vocabulary-parallel loss. Every
// function acts in place; for a single rank each is the identity.
class TpMappings {
 public:
  virtual ~TpMappings() = default;
  virtual TpShard shard() const { return {}; }
  // copy: forward identity (the input enters a column-parallel layer on every rank);
  // backward sums the partial input gradients over tp. Called on the gradient.
  virtual void copy_backward(const Tensor& dx) { (void)dx; }
  // reduce: forward sums a row-parallel layer's partial outputs over tp; backward identity.
  virtual void reduce_forward(const Tensor& y) { (void)y; }
  // Element-wise sum and maximum over tp (the vocabulary-parallel loss's row statistics).
  virtual void sum(const Tensor& x) { (void)x; }
  virtual void max(const Tensor& x) { (void)x; }
  // Key/value heads held by several ranks (tp a multiple of n_kv_head): sums the gradient
  // g of this rank's key/value weights over the `sharers` consecutive ranks holding the same head.
  virtual void sum_over_kv_sharers(const Tensor& g, int sharers) { (void)g, (void)sharers; }

  // Sequence parallelism: between the split layers each rank keeps its T / tp positions of
  // every sequence ([B, T / tp, C], positions [rank T / tp, (rank + 1) T / tp)).
  virtual bool sequence_parallel() const { return false; }
  // gather: full[B, T, C] = every rank's local[B, T / tp, C] along T (forward: before a
  // column-parallel layer; backward: before a row-parallel layer's backward).
  virtual void gather_sequence(const Tensor& full, const Tensor& local) { (void)full, (void)local; }
  // reduce-scatter: local[B, T / tp, C] = this rank's positions of full summed over tp
  // (forward: after a row-parallel layer; backward: on a column-parallel layer's input gradient).
  virtual void reduce_scatter_sequence(const Tensor& local, const Tensor& full) { (void)local, (void)full; }
};

}  // namespace mt
