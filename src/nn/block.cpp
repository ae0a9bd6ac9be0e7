#include "nn/block.h"

#include <string>

#include "core/error.h"

#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace mt {

namespace {

// Parameter views of one block; the fused weights span consecutive Hugging Face tensors.
struct BlockParams {
  Tensor ln1_w, ln1_b, wqkv, bqkv, wo, bo, ln2_w, ln2_b, wfc, bfc, wproj, bproj;  // params
  Tensor g_ln1_w, g_ln1_b, g_wqkv, g_bqkv, g_wo, g_bo, g_ln2_w, g_ln2_b, g_wfc, g_bfc, g_wproj, g_bproj;
};

BlockParams block_params(const ModelConfig& cfg, const Unit& u) {
  const int C = cfg.d_model, F = cfg.ff_dim(), QKV = cfg.qkv_dim();
  BlockParams p;
  auto both = [&](const char* suffix, Tensor& w, Tensor& g, const Shape& shape) {
    for (const ParamSpec& s : u.params) {
      if (s.name.size() >= std::string(suffix).size() &&
          s.name.compare(s.name.size() - std::string(suffix).size(), std::string::npos, suffix) == 0) {
        w = u.w.view(s.offset, shape);
        g = u.g.view(s.offset, shape);
        return;
      }
    }
    MT_FAIL("internal: block parameter " << suffix << " missing from " << u.name);
  };
  if (!cfg.is_llama()) {
    both("ln_1.weight", p.ln1_w, p.g_ln1_w, {C});
    both("ln_1.bias", p.ln1_b, p.g_ln1_b, {C});
    both("attn.c_attn.weight", p.wqkv, p.g_wqkv, {QKV, C});
    both("attn.c_attn.bias", p.bqkv, p.g_bqkv, {QKV});
    both("attn.c_proj.weight", p.wo, p.g_wo, {C, C});
    both("attn.c_proj.bias", p.bo, p.g_bo, {C});
    both("ln_2.weight", p.ln2_w, p.g_ln2_w, {C});
    both("ln_2.bias", p.ln2_b, p.g_ln2_b, {C});
    both("mlp.c_fc.weight", p.wfc, p.g_wfc, {F, C});
    both("mlp.c_fc.bias", p.bfc, p.g_bfc, {F});
    both("mlp.c_proj.weight", p.wproj, p.g_wproj, {C, F});
    both("mlp.c_proj.bias", p.bproj, p.g_bproj, {C});
  } else {
    both("input_layernorm.weight", p.ln1_w, p.g_ln1_w, {C});
    both("q_proj.weight", p.wqkv, p.g_wqkv, {QKV, C});  // q, k, v back to back
    both("o_proj.weight", p.wo, p.g_wo, {C, C});
    both("post_attention_layernorm.weight", p.ln2_w, p.g_ln2_w, {C});
    both("gate_proj.weight", p.wfc, p.g_wfc, {2 * F, C});  // gate, up back to back
    both("down_proj.weight", p.wproj, p.g_wproj, {C, F});
  }
  return p;
}

const Tensor* opt(const Tensor& t) { return t.defined() ? &t : nullptr; }

Tensor bt(const Tensor& full, int B, int T, int64_t width) { return full.view(0, {B, T, width}); }
Tensor bt(const Tensor& full, int B, int T) { return full.view(0, {B, T}); }

}  // namespace

BlockActs::BlockActs(const ModelConfig& cfg, int B, Allocator& alloc) {
  const int64_t T = cfg.seq_len, C = cfg.d_model, F = cfg.ff_dim(), NH = cfg.n_head;
  auto make = [&](const Shape& s) { return Tensor::empty(s, DType::f32, alloc, MemTag::activations); };
  ln1 = make({B, T, C});
  ln1_mean = make({B, T});
  ln1_rstd = make({B, T});
  qkv = make({B, T, cfg.qkv_dim()});
  att = make({B, NH, T, T});
  atty = make({B, T, C});
  mid = make({B, T, C});
  ln2 = make({B, T, C});
  ln2_mean = make({B, T});
  ln2_rstd = make({B, T});
  fc = make({B, T, cfg.is_llama() ? 2 * F : F});
  act = make({B, T, F});
}

BlockScratch::BlockScratch(const ModelConfig& cfg, int B, Allocator& alloc) {
  const int64_t T = cfg.seq_len, C = cfg.d_model, F = cfg.ff_dim(), NH = cfg.n_head;
  auto make = [&](const Shape& s) { return Tensor::empty(s, DType::f32, alloc, MemTag::activations); };
  dln = make({B, T, C});
  dqkv = make({B, T, cfg.qkv_dim()});
  datt = make({B, NH, T, T});
  datty = make({B, T, C});
  dfc = make({B, T, cfg.is_llama() ? 2 * F : F});
  dact = make({B, T, F});
}

void block_forward(const ModelConfig& cfg, const Unit& u, BlockActs& a, const Tensor& x, const Tensor& out,
                   int B, int T) {
  const int C = cfg.d_model, F = cfg.ff_dim(), QKV = cfg.qkv_dim(), NH = cfg.n_head, NKV = cfg.kv_heads();
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, u);
  Tensor ln1 = bt(a.ln1, B, T, C), ln1_mean = bt(a.ln1_mean, B, T), ln1_rstd = bt(a.ln1_rstd, B, T);
  Tensor qkv = bt(a.qkv, B, T, QKV), atty = bt(a.atty, B, T, C), mid = bt(a.mid, B, T, C);
  Tensor ln2 = bt(a.ln2, B, T, C), ln2_mean = bt(a.ln2_mean, B, T), ln2_rstd = bt(a.ln2_rstd, B, T);
  Tensor fc = bt(a.fc, B, T, llama ? 2 * F : F), act = bt(a.act, B, T, F);
  Tensor att = a.att.view(0, {B, NH, T, T});

  // attention branch
  if (llama) rmsnorm_forward(ln1, ln1_rstd, x, p.ln1_w, cfg.norm_eps);
  else layernorm_forward(ln1, ln1_mean, ln1_rstd, x, p.ln1_w, p.ln1_b, cfg.norm_eps);
  linear_forward(qkv, ln1, p.wqkv, opt(p.bqkv));
  if (llama) rope_forward(qkv.reshape({B, T, NH + 2 * NKV, cfg.head_dim()}), NH + NKV, cfg.rope_theta);
  attention_forward(atty, att, qkv, NH, NKV);
  linear_forward(mid, atty, p.wo, opt(p.bo));
  add_inplace(mid, x);  // mid = x + attn

  // MLP branch
  if (llama) rmsnorm_forward(ln2, ln2_rstd, mid, p.ln2_w, cfg.norm_eps);
  else layernorm_forward(ln2, ln2_mean, ln2_rstd, mid, p.ln2_w, p.ln2_b, cfg.norm_eps);
  linear_forward(fc, ln2, p.wfc, opt(p.bfc));
  if (llama) swiglu_forward(act, fc);
  else gelu_forward(act, fc);
  linear_forward(out, act, p.wproj, opt(p.bproj));
  add_inplace(out, mid);  // out = mid + mlp
}

void block_backward(const ModelConfig& cfg, const Unit& u, const BlockActs& a, BlockScratch& s, const Tensor& x,
                    const Tensor& dresid, int B, int T) {
  const int C = cfg.d_model, F = cfg.ff_dim(), QKV = cfg.qkv_dim(), NH = cfg.n_head, NKV = cfg.kv_heads();
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, u);
  Tensor ln1 = bt(a.ln1, B, T, C), ln1_mean = bt(a.ln1_mean, B, T), ln1_rstd = bt(a.ln1_rstd, B, T);
  Tensor qkv = bt(a.qkv, B, T, QKV), atty = bt(a.atty, B, T, C), mid = bt(a.mid, B, T, C);
  Tensor ln2 = bt(a.ln2, B, T, C), ln2_mean = bt(a.ln2_mean, B, T), ln2_rstd = bt(a.ln2_rstd, B, T);
  Tensor fc = bt(a.fc, B, T, llama ? 2 * F : F), act = bt(a.act, B, T, F);
  Tensor att = a.att.view(0, {B, NH, T, T});
  Tensor dln = bt(s.dln, B, T, C), dqkv = bt(s.dqkv, B, T, QKV), datty = bt(s.datty, B, T, C);
  Tensor dfc = bt(s.dfc, B, T, llama ? 2 * F : F), dact = bt(s.dact, B, T, F);
  Tensor datt = s.datt.view(0, {B, NH, T, T});

  // MLP branch: out = mid + proj(act); dresid is d(out) = d(mid) through the skip.
  linear_backward_weight(p.g_wproj, opt(p.g_bproj), dresid, act);
  linear_backward_input(dact, dresid, p.wproj, false);
  if (llama) swiglu_backward(dfc, fc, dact);
  else gelu_backward(dfc, fc, dact);
  linear_backward_weight(p.g_wfc, opt(p.g_bfc), dfc, ln2);
  linear_backward_input(dln, dfc, p.wfc, false);
  // the norm's backward adds into dresid, which then holds d(mid)
  if (llama) rmsnorm_backward(dresid, p.g_ln2_w, dln, mid, p.ln2_w, ln2_rstd);
  else layernorm_backward(dresid, p.g_ln2_w, p.g_ln2_b, dln, mid, p.ln2_w, ln2_mean, ln2_rstd);

  // attention branch: mid = x + proj(atty)
  linear_backward_weight(p.g_wo, opt(p.g_bo), dresid, atty);
  linear_backward_input(datty, dresid, p.wo, false);
  attention_backward(dqkv, datt, datty, qkv, att, NH, NKV);
  if (llama) rope_backward(dqkv.reshape({B, T, NH + 2 * NKV, cfg.head_dim()}), NH + NKV, cfg.rope_theta);
  linear_backward_weight(p.g_wqkv, opt(p.g_bqkv), dqkv, ln1);
  linear_backward_input(dln, dqkv, p.wqkv, false);
  if (llama) rmsnorm_backward(dresid, p.g_ln1_w, dln, x, p.ln1_w, ln1_rstd);
  else layernorm_backward(dresid, p.g_ln1_w, p.g_ln1_b, dln, x, p.ln1_w, ln1_mean, ln1_rstd);
}

}  // namespace mt
