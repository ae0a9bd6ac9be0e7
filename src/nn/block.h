// One transformer block, forward and backward, for both families.
//
// GPT-2:  h = x + Wo·attn(LN1(x));   out = h + Wp·gelu(Wfc·LN2(h))
// Llama:  h = x + Wo·attn(rope(RMS1(x)));  out = h + Wd·(silu(Wg·RMS2(h)) * Wu·RMS2(h))
//
// q, k and v come from one linear over the fused weight [(NH + 2 NKV) D, C] (GPT-2's
// c_attn; Llama's q_proj, k_proj, v_proj stored back to back), and Llama's gate and up
// from one linear over [2F, C] (gate_proj then up_proj). Under tensor parallelism every
// dimension here is this rank's share (LocalDims: its heads, its F / tp hidden units), and
// the block calls the tp mappings around the split layers (nn/tp.h).
#pragma once
#include "core/tensor.h"
#include "nn/model.h"

namespace mt {

// What a block computes with: the model's configuration, this rank's share of its layers
// and the tensor-parallel mappings.
struct BlockEnv {
  const ModelConfig& cfg;
  const LocalDims& d;
  TpMappings& tp;
};

// Activations kept for backward, allocated for [B, T] = [micro_batch, seq_len];
// at(B, T) gives views of a smaller current batch (at offset 0). Attention keeps lse with
// the fused path (cfg.fused_attention()) and att with the materialized one; the other
// stays undefined, so the fused path holds nothing of size T x T.
struct BlockActs {
  Tensor ln1, ln1_mean, ln1_rstd;  // [B, T, C], [B, T], [B, T] (rmsnorm: mean unused)
  Tensor qkv;                      // [B, T, QKV] (after rope for llama)
  Tensor lse;                      // [B, NH, T] log-sum-exp of each score row (fused)
  Tensor att;                      // [B, NH, T, T] softmax probabilities (materialized)
  Tensor atty;                     // [B, T, NH D] attention output before the projection
  Tensor mid;                      // [B, T, C] residual after the attention branch
  Tensor ln2, ln2_mean, ln2_rstd;  // [B, T, C], [B, T], [B, T]
  Tensor fc;                       // [B, T, F] gpt2 pre-gelu; llama [B, T, 2F] gate|up
  Tensor act;                      // [B, T, F] gelu / swiglu output
  BlockActs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc);
  BlockActs at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const;

 private:
  BlockActs() = default;  // for at()
  template <class Fn> void each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn);
};

// Workspace for one block's backward, shared by all blocks.
struct BlockScratch {
  Tensor dln;    // [B, T, C]
  Tensor dqkv;   // [B, T, QKV]
  Tensor datt;   // [B, NH, T, T] (materialized attention only)
  Tensor datty;  // [B, T, NH D]
  Tensor dfc;    // [B, T, F or 2F]
  Tensor dact;   // [B, T, F]
  Tensor dwqkv;  // [QKV, C] this micro-batch's q|k|v weight gradient (key/value heads held by several tp ranks only)
  BlockScratch(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc);
  BlockScratch at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const;

 private:
  BlockScratch() = default;
  template <class Fn> void each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn);
};

// out[B, T, C] = block(x[B, T, C]); fills a.
void block_forward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& out, int B,
                   int T);
// dresid holds d(out) on entry and d(x) on return; parameter gradients accumulate in u.g.
void block_backward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const BlockScratch& scratch,
                    const Tensor& x, const Tensor& dresid, int B, int T);

}  // namespace mt
