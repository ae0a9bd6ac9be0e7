#include "nn/model_config.h"

#include "core/error.h"

namespace mt {

int ModelConfig::ff_dim() const {
  if (d_ff > 0) return d_ff;
  if (!is_llama()) return 4 * d_model;
  int f = (8 * d_model + 2) / 3;
  return (f + 31) / 32 * 32;
}

void ModelConfig::validate() const {
  MT_CHECK(family == "gpt2" || family == "llama",
           "model.family = \"" << family << "\" is not a model family; use gpt2 or llama");
  // The upper bounds lie far beyond any model trained; past them the layouts' loops and the
  // products of sizes in int would run away before the memory check could refuse the model.
  MT_CHECK(n_layer >= 1 && n_layer <= 65536, "model.n_layer = " << n_layer << " must be from 1 to 65536");
  MT_CHECK(n_head >= 1 && n_head <= 65536, "model.n_head = " << n_head << " must be from 1 to 65536");
  MT_CHECK(d_model >= 1 && d_model <= (1 << 20), "model.d_model = " << d_model << " must be from 1 to 1048576");
  MT_CHECK(d_model % n_head == 0,
           "model.d_model = " << d_model << " is not divisible by model.n_head = " << n_head
                              << "; pick a d_model that is a multiple of n_head");
  MT_CHECK(n_kv_head >= 0 && n_head % kv_heads() == 0,
           "model.n_kv_head = " << n_kv_head << " must divide model.n_head = " << n_head);
  MT_CHECK(is_llama() || kv_heads() == n_head,
           "model.n_kv_head = " << n_kv_head << " differs from n_head, but gpt2 has no grouped-query attention; "
                                << "remove n_kv_head or use model.family = llama");
  MT_CHECK(!is_llama() || head_dim() % 2 == 0,
           "llama's rotary embedding needs an even head dim, but d_model / n_head = " << head_dim());
  MT_CHECK(d_ff >= 0 && d_ff <= (1 << 24),
           "model.d_ff = " << d_ff << " must be from 1 to 16777216 (or 0 for the family default)");
  MT_CHECK(vocab_size >= 2, "model.vocab_size = " << vocab_size << " must be at least 2");
  MT_CHECK(seq_len >= 1 && seq_len <= (1 << 24), "model.seq_len = " << seq_len << " must be from 1 to 16777216");
  MT_CHECK(norm_eps > 0, "model.norm_eps = " << norm_eps << " must be positive");
  MT_CHECK(rope_theta > 0, "model.rope_theta = " << rope_theta << " must be positive");
  MT_CHECK(precision == "fp32" || precision == "bf16" || precision == "fp16",
           "training.precision = \"" << precision << "\" is not a precision; use fp32, bf16 or fp16");
  MT_CHECK(grad_dtype == "fp32" || grad_dtype == precision,
           "training.grad_dtype = \"" << grad_dtype << "\" under training.precision = " << precision
                                       << ": gradients are kept in fp32 or in the working precision; use fp32"
                                       << (precision == "fp32" ? "" : " or ") << (precision == "fp32" ? "" : precision));
  MT_CHECK(attention == "fused" || attention == "materialized",
           "training.attention = \"" << attention << "\" is not an attention path; use fused or materialized");
}

}  // namespace mt
