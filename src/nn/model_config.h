// The model's shape and numerics (the [model] section of the configuration), and how its
// attention is computed (training.attention).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace mt {

// Which blocks recompute their forward in backward instead of keeping their activations
// (training.recompute, training.recompute_blocks): the first `blocks` of each model chunk
// (the whole model, a pipeline stage, or one of an interleaved rank's chunks).
struct Recompute {
  static constexpr int kAll = std::numeric_limits<int>::max();
  int blocks = 0;  // 0: none; kAll: every block
  bool any() const { return blocks > 0; }
  int of(int n) const { return std::min(blocks, n); }  // recomputed blocks of a chunk of n
  bool operator==(const Recompute&) const = default;
};

struct ModelConfig {
  std::string family = "gpt2";  // gpt2 | llama
  int n_layer = 4;
  int n_head = 4;
  int n_kv_head = 0;        // 0: same as n_head (llama grouped-query attention when smaller)
  int d_model = 128;
  int d_ff = 0;             // 0: gpt2 4*d_model; llama 32*ceil(8*d_model/3/32)
  int vocab_size = 257;     // the byte tokenizer's 256 bytes + end-of-text
  int seq_len = 128;
  int tie_embeddings = -1;  // -1: family default (gpt2 tied, llama untied); 0 / 1
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  std::string init_from;    // a safetensors file with Hugging Face names
  // How attention is computed (set by the key training.attention; it changes the memory a
  // step needs, not the model): fused keeps each row's log-sum-exp and recomputes the
  // probabilities in backward; materialized keeps the [B, NH, T, T] probabilities.
  std::string attention = "fused";  // fused | materialized
  // The precision the model computes in (set by the key training.precision): fp32, or bf16 /
  // fp16 with 16-bit working parameters and 16-bit operands in every linear layer's matrix
  // products (ops/autocast.h); the fp32 master parameters live with the data-parallel strategy.
  std::string precision = "fp32";  // fp32 | bf16 | fp16
  // The dtype the units' gradients are kept in (set by the key training.grad_dtype): fp32, or
  // the working 16-bit type (bf16 under precision bf16, fp16 under fp16), which the backward
  // accumulates into once per unit and micro-batch from an fp32 staging buffer (nn/model.h).
  std::string grad_dtype = "fp32";

  bool operator==(const ModelConfig&) const = default;
  bool fused_attention() const { return attention == "fused"; }
  bool mixed_precision() const { return precision != "fp32"; }
  bool grad_working() const { return grad_dtype != "fp32"; }  // gradients in the 16-bit working dtype
  bool is_llama() const { return family == "llama"; }
  int kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int head_dim() const { return d_model / n_head; }
  int ff_dim() const;
  bool tied() const { return tie_embeddings < 0 ? !is_llama() : tie_embeddings != 0; }
  int qkv_dim() const { return (n_head + 2 * kv_heads()) * head_dim(); }
  // Throws mt::Error naming the key and the fix when the shape cannot work.
  void validate() const;
};

}  // namespace mt
