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

BlockParams block_params(const ModelConfig& cfg, const LocalDims& d, const Unit& u) {
  const int64_t C = d.C, F = d.F, QKV = d.qkv(), A = d.attn();
  BlockParams p;
  auto both = [&](const char* suffix, Tensor& w, Tensor& g, const Shape& shape) {
    for (const ParamSpec& s : u.params) {
      if (s.name.size() >= std::string(suffix).size() &&
          s.name.compare(s.name.size() - std::string(suffix).size(), std::string::npos, suffix) == 0) {
        w = u.w.view(s.offset, shape);
        if (u.g.defined()) g = u.g.view(s.offset, shape);  // gradients may exist only in backward (ZeRO)
        return;
      }
    }
    MT_FAIL("internal: block parameter " << suffix << " missing from " << u.name);
  };
  // The row-parallel weights (wo, wproj) are stored [in, out].
  if (!cfg.is_llama()) {
    both("ln_1.weight", p.ln1_w, p.g_ln1_w, {C});
    both("ln_1.bias", p.ln1_b, p.g_ln1_b, {C});
    both("attn.c_attn.weight", p.wqkv, p.g_wqkv, {QKV, C});
    both("attn.c_attn.bias", p.bqkv, p.g_bqkv, {QKV});
    both("attn.c_proj.weight", p.wo, p.g_wo, {A, C});
    both("attn.c_proj.bias", p.bo, p.g_bo, {C});
    both("ln_2.weight", p.ln2_w, p.g_ln2_w, {C});
    both("ln_2.bias", p.ln2_b, p.g_ln2_b, {C});
    both("mlp.c_fc.weight", p.wfc, p.g_wfc, {F, C});
    both("mlp.c_fc.bias", p.bfc, p.g_bfc, {F});
    both("mlp.c_proj.weight", p.wproj, p.g_wproj, {F, C});
    both("mlp.c_proj.bias", p.bproj, p.g_bproj, {C});
  } else {
    both("input_layernorm.weight", p.ln1_w, p.g_ln1_w, {C});
    both("q_proj.weight", p.wqkv, p.g_wqkv, {QKV, C});  // q, k, v back to back
    both("o_proj.weight", p.wo, p.g_wo, {A, C});
    both("post_attention_layernorm.weight", p.ln2_w, p.g_ln2_w, {C});
    both("gate_proj.weight", p.wfc, p.g_wfc, {2 * F, C});  // gate, up back to back
    both("down_proj.weight", p.wproj, p.g_wproj, {F, C});
  }
  return p;
}

const Tensor* opt(const Tensor& t) { return t.defined() ? &t : nullptr; }

}  // namespace

// Every activation tensor with its shape for a batch of [B, T], listed once.
template <class Fn>
void BlockActs::each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn) {
  const int64_t C = d.C, F = d.F, NH = d.NH;
  fn(ln1, {B, T, C}), fn(ln1_mean, {B, T}), fn(ln1_rstd, {B, T});
  fn(qkv, {B, T, d.qkv()});
  if (cfg.fused_attention()) fn(lse, {B, NH, T});
  else fn(att, {B, NH, T, T});
  fn(atty, {B, T, d.attn()}), fn(mid, {B, T, C});
  fn(ln2, {B, T, C}), fn(ln2_mean, {B, T}), fn(ln2_rstd, {B, T});
  fn(fc, {B, T, cfg.is_llama() ? 2 * F : F}), fn(act, {B, T, F});
}

template <class Fn>
void BlockScratch::each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn) {
  const int64_t C = d.C, F = d.F, NH = d.NH;
  fn(dln, {B, T, C}), fn(dqkv, {B, T, d.qkv()}), fn(datty, {B, T, d.attn()});
  if (!cfg.fused_attention()) fn(datt, {B, NH, T, T});
  fn(dfc, {B, T, cfg.is_llama() ? 2 * F : F}), fn(dact, {B, T, F});
  if (d.kv_sharers > 1) fn(dwqkv, {d.qkv(), C});
}

BlockActs::BlockActs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc) {
  each(cfg, d, B, cfg.seq_len,
       [&](Tensor& t, const Shape& s) { t = Tensor::empty(s, DType::f32, alloc, MemTag::activations); });
}

BlockActs BlockActs::at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const {
  BlockActs v = *this;
  v.each(cfg, d, B, T, [](Tensor& t, const Shape& s) { t = t.view(0, s); });
  return v;
}

BlockScratch::BlockScratch(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc) {
  each(cfg, d, B, cfg.seq_len,
       [&](Tensor& t, const Shape& s) { t = Tensor::empty(s, DType::f32, alloc, MemTag::activations); });
}

BlockScratch BlockScratch::at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const {
  BlockScratch v = *this;
  v.each(cfg, d, B, T, [](Tensor& t, const Shape& s) { t = t.view(0, s); });
  return v;
}

namespace {

// A row-parallel layer: y = x @ w (this rank's input features, partial sums) summed over
// tp (reduce), then the bias, added once. On one rank, the bias rides in the product.
void row_parallel_forward(TpMappings& tp, const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) {
  if (tp.shard().size == 1) return linear_io_forward(y, x, w, b);
  linear_io_forward(y, x, w, nullptr);
  tp.reduce_forward(y);
  if (b) add_bias(y, *b);
}

}  // namespace

void block_forward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& out, int B,
                   int T) {
  const ModelConfig& cfg = env.cfg;
  const LocalDims& d = env.d;
  const int NH = static_cast<int>(d.NH), NKV = static_cast<int>(d.NKV);
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, d, u);
  const BlockActs a = acts.at(cfg, d, B, T);

  // attention branch: copy into the column-parallel q|k|v (this rank's heads), reduce after
  // the row-parallel output projection
  if (llama) rmsnorm_forward(a.ln1, a.ln1_rstd, x, p.ln1_w, cfg.norm_eps);
  else layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, p.ln1_w, p.ln1_b, cfg.norm_eps);
  linear_forward(a.qkv, a.ln1, p.wqkv, opt(p.bqkv));
  if (llama) rope_forward(a.qkv.reshape({B, T, NH + 2 * NKV, d.D}), NH + NKV, cfg.rope_theta);
  if (cfg.fused_attention()) attention_fused_forward(a.atty, a.lse, a.qkv, NH, NKV);
  else attention_forward(a.atty, a.att, a.qkv, NH, NKV);
  row_parallel_forward(env.tp, a.mid, a.atty, p.wo, opt(p.bo));
  add_inplace(a.mid, x);  // mid = x + attn

  // MLP branch: the same around the column-parallel up (and gate) and row-parallel down
  if (llama) rmsnorm_forward(a.ln2, a.ln2_rstd, a.mid, p.ln2_w, cfg.norm_eps);
  else layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.mid, p.ln2_w, p.ln2_b, cfg.norm_eps);
  linear_forward(a.fc, a.ln2, p.wfc, opt(p.bfc));
  if (llama) swiglu_forward(a.act, a.fc);
  else gelu_forward(a.act, a.fc);
  row_parallel_forward(env.tp, out, a.act, p.wproj, opt(p.bproj));
  add_inplace(out, a.mid);  // out = mid + mlp
}

void block_backward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const BlockScratch& scratch,
                    const Tensor& x, const Tensor& dresid, int B, int T) {
  const ModelConfig& cfg = env.cfg;
  const LocalDims& d = env.d;
  const int NH = static_cast<int>(d.NH), NKV = static_cast<int>(d.NKV);
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, d, u);
  const BlockActs a = acts.at(cfg, d, B, T);
  const BlockScratch s = scratch.at(cfg, d, B, T);

  // MLP branch: out = mid + proj(act); dresid is d(out) = d(mid) through the skip. The
  // reduce's backward is the identity; the copy's sums the norm input's gradient over tp.
  linear_io_backward_weight(p.g_wproj, opt(p.g_bproj), dresid, a.act);
  linear_io_backward_input(s.dact, dresid, p.wproj, false);
  if (llama) swiglu_backward(s.dfc, a.fc, s.dact);
  else gelu_backward(s.dfc, a.fc, s.dact);
  linear_backward_weight(p.g_wfc, opt(p.g_bfc), s.dfc, a.ln2);
  linear_backward_input(s.dln, s.dfc, p.wfc, false);
  env.tp.copy_backward(s.dln);
  // the norm's backward adds into dresid, which then holds d(mid)
  if (llama) rmsnorm_backward(dresid, p.g_ln2_w, s.dln, a.mid, p.ln2_w, a.ln2_rstd);
  else layernorm_backward(dresid, p.g_ln2_w, p.g_ln2_b, s.dln, a.mid, p.ln2_w, a.ln2_mean, a.ln2_rstd);

  // attention branch: mid = x + proj(atty)
  linear_io_backward_weight(p.g_wo, opt(p.g_bo), dresid, a.atty);
  linear_io_backward_input(s.datty, dresid, p.wo, false);
  if (cfg.fused_attention()) attention_fused_backward(s.dqkv, s.datty, a.qkv, a.atty, a.lse, NH, NKV);
  else attention_backward(s.dqkv, s.datt, s.datty, a.qkv, a.att, NH, NKV);
  if (llama) rope_backward(s.dqkv.reshape({B, T, NH + 2 * NKV, d.D}), NH + NKV, cfg.rope_theta);
  if (d.kv_sharers == 1) {
    linear_backward_weight(p.g_wqkv, opt(p.g_bqkv), s.dqkv, a.ln1);
  } else {
    // This rank's key/value head is also held by other ranks, each with its own query
    // heads: this micro-batch's key/value gradient is the sum of theirs (Llama: no bias).
    s.dwqkv.zero_();
    linear_backward_weight(s.dwqkv, nullptr, s.dqkv, a.ln1);
    const int64_t q = d.attn() * d.C;
    env.tp.sum_over_kv_sharers(s.dwqkv.reshape({s.dwqkv.numel()}).view(q, {s.dwqkv.numel() - q}),
                               static_cast<int>(d.kv_sharers));
    add_inplace(p.g_wqkv, s.dwqkv);
  }
  linear_backward_input(s.dln, s.dqkv, p.wqkv, false);
  env.tp.copy_backward(s.dln);
  if (llama) rmsnorm_backward(dresid, p.g_ln1_w, s.dln, x, p.ln1_w, a.ln1_rstd);
  else layernorm_backward(dresid, p.g_ln1_w, p.g_ln1_b, s.dln, x, p.ln1_w, a.ln1_mean, a.ln1_rstd);
}

}  // namespace mt
