#include "nn/block.h"

#include <optional>
#include <string>

#include "core/error.h"

#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "ops/rope.h"

namespace mt {

namespace {

// Parameter views of one block; the fused weights span consecutive Hugging Face tensors.
// Under mixed precision the four weight matrices are views of the 16-bit working copy where
// the products read it as it is (Unit::w16), the norms' weights and the biases of the fp32
// widening.
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
        w = shape.size() == 2 ? u.matrix_view(s.offset, shape) : u.w.view(s.offset, shape);
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
// Under sequence parallelism the residual stream and the norms' outputs and statistics
// hold this rank's Tl = T / tp positions (a norm's output is gathered into a workspace
// for the layer it feeds, and again in backward for that layer's weight gradient); the
// split layers' inputs and outputs hold all T.
template <class Fn>
void BlockActs::each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn) {
  const int64_t C = d.C, F = d.F, NH = d.NH, Tl = T / d.seq_split;
  fn(ln1, {B, Tl, C}), fn(ln1_mean, {B, Tl}), fn(ln1_rstd, {B, Tl});
  fn(qkv, {B, T, d.qkv()});
  if (cfg.fused_attention()) fn(lse, {B, NH, T});
  else fn(att, {B, NH, T, T});
  fn(atty, {B, T, d.attn()}), fn(mid, {B, Tl, C});
  fn(ln2, {B, Tl, C}), fn(ln2_mean, {B, Tl}), fn(ln2_rstd, {B, Tl});
  fn(fc, {B, T, cfg.is_llama() ? 2 * F : F}), fn(act, {B, T, F});
}

template <class Fn>
void BlockScratch::each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn) {
  const int64_t C = d.C, F = d.F, NH = d.NH;
  fn(dln, {B, T, C}), fn(dqkv, {B, T, d.qkv()}), fn(datty, {B, T, d.attn()});
  if (!cfg.fused_attention()) fn(datt, {B, NH, T, T});
  fn(dfc, {B, T, cfg.is_llama() ? 2 * F : F}), fn(dact, {B, T, F});
  if (d.kv_sharers > 1) fn(dwqkv, {d.qkv(), C});
  if (d.seq_split > 1) fn(seq, {B, T, C}), fn(local, {B, T / d.seq_split, C}), fn(rep, {6 * C});
  fn(qkv, {B, T, d.qkv()}), fn(atty, {B, T, d.attn()});  // allocated with 16-bit kept activations only
}

template <class Fn>
void BlockWeightInputs::each(const ModelConfig& cfg, const LocalDims& d, int64_t B, int64_t T, Fn fn) {
  fn(dproj, {B, T, d.C}), fn(dfc, {B, T, cfg.is_llama() ? 2 * d.F : d.F});
  fn(dwo, {B, T, d.C}), fn(dqkv, {B, T, d.qkv()});
}

namespace {

// What the per-tensor lists (each) of BlockActs, BlockScratch and BlockWeightInputs do:
// allocate every tensor for [micro_batch, d.T], or view a smaller batch at offset 0.
auto allocate_in(Allocator& alloc) {
  return [&alloc](Tensor& t, const Shape& s) { t = Tensor::empty(s, DType::f32, alloc, MemTag::activations); };
}
void view_at_start(Tensor& t, const Shape& s) {
  if (t.defined()) t = t.view(0, s);
}

}  // namespace

BlockActs::BlockActs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc, DType kept) {
  each(cfg, d, B, d.T, [&](Tensor& t, const Shape& s) {
    const bool in_kept = &t == &ln1 || &t == &ln2 || &t == &qkv || &t == &atty || &t == &fc || &t == &act;
    t = Tensor::empty(s, in_kept ? kept : DType::f32, alloc, MemTag::activations);
  });
}

BlockActs BlockActs::at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const {
  BlockActs v = *this;
  v.each(cfg, d, B, T, view_at_start);
  return v;
}

BlockScratch::BlockScratch(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc, DType kept) {
  each(cfg, d, B, d.T, [&](Tensor& t, const Shape& s) {
    if ((&t == &qkv || &t == &atty) && kept == DType::f32) return;
    t = Tensor::empty(s, DType::f32, alloc, MemTag::activations);
  });
}

BlockScratch BlockScratch::at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const {
  BlockScratch v = *this;
  v.each(cfg, d, B, T, view_at_start);
  return v;
}

BlockWeightInputs::BlockWeightInputs(const ModelConfig& cfg, const LocalDims& d, int B, Allocator& alloc) {
  each(cfg, d, B, d.T, allocate_in(alloc));
}

BlockWeightInputs BlockWeightInputs::at(const ModelConfig& cfg, const LocalDims& d, int B, int T) const {
  BlockWeightInputs v = *this;
  v.each(cfg, d, B, T, view_at_start);
  return v;
}

namespace {

bool sequence_parallel(const BlockEnv& env) { return env.d.seq_split > 1; }

// A row-parallel layer: y = x @ w (this rank's input features: partial sums) summed over
// tp (reduce; under sequence parallelism reduce-scattered into this rank's positions, via
// `full`), then the bias, added once. On one rank the bias rides in the product.
void row_parallel_forward(const BlockEnv& env, const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b,
                          const Tensor& full) {
  if (env.tp.shard().size == 1) return linear_io_forward(y, x, w, b);
  if (sequence_parallel(env)) {
    linear_io_forward(full, x, w, nullptr);
    env.tp.reduce_scatter_sequence(y, full);
  } else {
    linear_io_forward(y, x, w, nullptr);
    env.tp.reduce_forward(y);
  }
  if (b) add_bias(y, *b);
}

// Its output gradient over all positions from dy (this rank's positions under sequence
// parallelism, gathered into `full`, and db += column sums of this rank's dy: the bias's
// gradient, summed over tp later; on whole sequences it rides with the weight's instead).
// Returns dy itself, or full.
Tensor row_parallel_dy(const BlockEnv& env, const Tensor* db, const Tensor& dy, const Tensor& full) {
  if (!sequence_parallel(env)) return dy;
  env.tp.gather_sequence(full, dy);
  if (db) bias_backward(*db, dy);
  return full;
}

// A column-parallel layer's input [B, T, C] for its weight gradient: the norm output kept
// for backward, or under sequence parallelism (which kept this rank's [B, T / tp, C]) every
// rank's positions gathered again into s.seq.
Tensor column_input(const BlockEnv& env, const BlockScratch& s, const Tensor& saved) {
  if (!sequence_parallel(env)) return saved;  // 16-bit: the product reads it as it is
  Tensor local = saved;
  if (saved.dtype() != DType::f32) {  // kept in 16 bits: widened before the gather
    s.local.convert_from(saved);
    local = s.local;
  }
  env.tp.gather_sequence(s.seq, local);
  return s.seq;
}

// The block's four linear layers, in backward order.
enum class Layer { proj, fc, wo, qkv };

// A product's weight gradient dw (and db) with, given dx, its input gradient in the same
// call: linear_backward, which rounds dy to 16 bits once for both.
void weight_and_input(bool io, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                      const Tensor* dx, const Tensor& w) {
  if (!dx) return io ? linear_io_backward_weight(dw, db, dy, x) : linear_backward_weight(dw, db, dy, x);
  if (io) linear_io_backward(*dx, dw, db, dy, x, w);
  else linear_backward(*dx, dw, db, dy, x, w);
}

// One layer's weight gradient from its output gradient dy ([B, T, out], all T positions)
// and the kept activations: dw += (the layer's input)^T dy, and db += column sums of dy for
// the biases that ride with it (all of them except the row-parallel ones under sequence
// parallelism: see row_parallel_dy); given dx, the layer's input gradient into it too.
// The one piece of code both the whole backward and its weight half
// (block_backward_weight) run.
void weight_grad(const BlockEnv& env, const BlockParams& p, const BlockActs& a, const BlockScratch& s, Layer layer,
                 const Tensor& dy, const Tensor* dx = nullptr) {
  const bool sp = sequence_parallel(env);
  switch (layer) {
    case Layer::proj: return weight_and_input(true, p.g_wproj, sp ? nullptr : opt(p.g_bproj), dy, a.act, dx, p.wproj);
    case Layer::fc:
      return weight_and_input(false, p.g_wfc, opt(p.g_bfc), dy, column_input(env, s, a.ln2), dx, p.wfc);
    case Layer::wo: return weight_and_input(true, p.g_wo, sp ? nullptr : opt(p.g_bo), dy, a.atty, dx, p.wo);
    case Layer::qkv: break;
  }
  const Tensor ln1 = column_input(env, s, a.ln1);
  if (env.d.kv_sharers == 1) return weight_and_input(false, p.g_wqkv, opt(p.g_bqkv), dy, ln1, dx, p.wqkv);
  // This rank's key/value head is also held by other ranks, each with its own query
  // heads: this micro-batch's key/value gradient is the sum of theirs (Llama: no bias).
  s.dwqkv.zero_();
  weight_and_input(false, s.dwqkv, nullptr, dy, ln1, dx, p.wqkv);
  const int64_t q = env.d.attn() * env.d.C;
  env.tp.sum_over_kv_sharers(s.dwqkv.reshape({s.dwqkv.numel()}).view(q, {s.dwqkv.numel() - q}),
                             static_cast<int>(env.d.kv_sharers));
  add_inplace(p.g_wqkv, s.dwqkv);
}

}  // namespace

// The norm in front of a column-parallel layer: out[B, T, C] (the layer's input) = norm(x).
// Under sequence parallelism x is this rank's [B, T / tp, C]: the norm writes `local`, and
// gather assembles every rank's positions into out.
void norm_forward(const BlockEnv& env, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                  const Tensor& w, const Tensor& b, const Tensor& local, const Tensor* residual) {
  const Tensor y = sequence_parallel(env) ? local : out;
  if (env.cfg.is_llama()) rmsnorm_forward(y, rstd, x, w, env.cfg.norm_eps, residual);
  else layernorm_forward(y, mean, rstd, x, w, b, env.cfg.norm_eps, residual);
  if (sequence_parallel(env)) env.tp.gather_sequence(out, local);
}

namespace {

// A column-parallel layer's norm in forward, keeping its output in `kept` (this rank's
// positions, [B, Tl, C]). Returns the layer's input [B, T, C]: kept itself (with 16-bit
// kept, the norm's output rounded as the product would round it: written so by the norm),
// or under sequence parallelism s.dln, the positions gathered in fp32. Given residual, x +=
// residual first.
Tensor norm_forward_kept(const BlockEnv& env, const BlockScratch& s, const Tensor& kept, const Tensor& mean,
                         const Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                         const Tensor* residual = nullptr) {
  if (!sequence_parallel(env)) {
    norm_forward(env, kept, mean, rstd, x, w, b, Tensor(), residual);
    return kept;
  }
  const bool half = kept.dtype() != DType::f32;
  const Tensor local = half ? s.local : kept;  // this rank's positions in fp32
  norm_forward(env, s.dln, mean, rstd, x, w, b, local, residual);
  if (half) kept.convert_from(local);
  return s.dln;
}

// Where an activation kept in `kept` is computed (and read downstream): kept itself, or in
// fp32 `work` when kept holds 16 bits.
Tensor fp32_home(const Tensor& kept, const Tensor& work) { return kept.dtype() == DType::f32 ? kept : work; }

// An activation computed in fp32 in x: under a 16-bit Autocast scope rounded in place to
// the scope's dtype, as a 16-bit op returns its output.
void round_activation(const Tensor& x) {
  const DType t = autocast_dtype();
  if (t != DType::f32) round_tensor(t, x);
}

// The same, and stored into kept when that is not x itself (16 bits), in the same pass:
// exact, as x holds 16-bit values.
void round_and_keep(const Tensor& x, const Tensor& kept) {
  if (x.raw() == kept.raw()) return round_activation(x);
  MT_CHECK(kept.dtype() == autocast_dtype(), "internal: activations kept in " << dtype_name(kept.dtype())
                                                  << " outside a " << dtype_name(kept.dtype()) << " Autocast scope");
  round_tensor(kept.dtype(), x, &kept);
}

// The same where nothing reads x afterwards (what follows reads the kept copy): only the 16
// bits are written, the values round_and_keep stores, without x rounded back in place.
void keep_rounded(const Tensor& x, const Tensor& kept) {
  if (x.raw() == kept.raw()) return round_activation(x);
  MT_CHECK(kept.dtype() == autocast_dtype(), "internal: activations kept in " << dtype_name(kept.dtype())
                                                  << " outside a " << dtype_name(kept.dtype()) << " Autocast scope");
  kept.convert_from(x);
}

// A kept activation in fp32 for an op that reads it: kept itself, or widened into work.
Tensor widened(const Tensor& kept, const Tensor& work) {
  if (kept.dtype() == DType::f32) return kept;
  work.convert_from(kept);
  return work;
}

// The MLP's up (and gate) projection and its activation, kept in a.fc and a.act, where no
// fused product (linear_gelu_fused) computed them: in fp32, then rounded and kept. GELU
// reads the product's fp32 result, as a fused epilogue does; SwiGLU reads the rounded one.
void mlp_up_forward(bool llama, const BlockActs& a, const BlockScratch& s, const Tensor& ln2, const BlockParams& p) {
  const Tensor fc = fp32_home(a.fc, s.dfc), act = fp32_home(a.act, s.dact);
  linear_forward(fc, ln2, p.wfc, opt(p.bfc));
  if (llama) {
    round_and_keep(fc, a.fc);
    swiglu_forward(act, fc);
  } else {
    gelu_forward(act, fc);
    round_and_keep(fc, a.fc);
  }
  if (act.raw() != a.act.raw()) a.act.convert_from(act);  // exact: the down projection rounds act anyway
}

}  // namespace

// Its backward: dln[B, T, C] is this rank's part of the gradient of the layer's input (the
// copy's backward sums it over tp; under sequence parallelism the gather's reduce-scatters
// it into `local`); the norm's backward adds d(x) into dx.
void norm_backward(const BlockEnv& env, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dln,
                   const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, const Tensor& local) {
  Tensor d = dln;
  if (sequence_parallel(env)) {
    env.tp.reduce_scatter_sequence(local, dln);
    d = local;
  } else {
    env.tp.copy_backward(dln);
  }
  if (env.cfg.is_llama()) rmsnorm_backward(dx, dw, d, x, w, rstd);
  else layernorm_backward(dx, dw, db, d, x, w, mean, rstd);
}

PositionShardGrads::PositionShardGrads(const Tensor& workspace, std::initializer_list<Tensor*> grads) {
  int64_t used = 0;
  for (Tensor* g : grads) {
    if (!g->defined()) continue;
    const Tensor slot = workspace.view(used, g->shape());
    pairs_.emplace_back(*g, slot);
    *g = slot;
    used += slot.numel();
  }
  used_ = workspace.view(0, {used});
  used_.zero_();
}

void PositionShardGrads::finish(TpMappings& tp) {
  tp.sum(used_);
  for (const auto& [grad, slot] : pairs_) add_inplace(grad, slot);
}

void block_forward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& out, int B,
                   int T) {
  const ModelConfig& cfg = env.cfg;
  const LocalDims& d = env.d;
  const int NH = static_cast<int>(d.NH), NKV = static_cast<int>(d.NKV);
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, d, u);
  const BlockActs a = acts.at(cfg, d, B, T);
  const BlockScratch s = env.scratch.at(cfg, d, B, T);

  // attention branch: copy (or gather) into the column-parallel q|k|v of this rank's heads,
  // reduce (or reduce-scatter) after the row-parallel output projection. Each kept
  // activation is computed in fp32 (fp32_home), rounded under a 16-bit scope and stored;
  // the ops that follow read the rounded fp32 values (but GELU: mlp_up_forward), the
  // products (and one rank's attention on the GPU) the kept ones.
  const Tensor ln1 = norm_forward_kept(env, s, a.ln1, a.ln1_mean, a.ln1_rstd, x, p.ln1_w, p.ln1_b);
  const Tensor qkv = fp32_home(a.qkv, s.qkv);
  linear_forward(qkv, ln1, p.wqkv, opt(p.bqkv));
  if (llama) {  // q|k|v rounded as the linear layer's output, and again after rope
    round_activation(qkv);
    rope_forward(qkv.reshape({B, T, NH + 2 * NKV, d.D}), NH + NKV, cfg.rope_theta, env.positions);
  }
  // attention reads the kept 16-bit q|k|v where its kernels read them as they are (and then
  // writes the kept 16-bit output itself), else the rounded fp32 ones; the output
  // projection reads the kept output
  const bool kept_qkv = cfg.fused_attention() && env.cp.takes_kept(a.qkv, NH, NKV);
  if (kept_qkv) {
    keep_rounded(qkv, a.qkv);
    env.cp.attention_forward(a.atty, a.lse, a.qkv, NH, NKV);
  } else {
    round_and_keep(qkv, a.qkv);
    const Tensor atty = fp32_home(a.atty, s.atty);
    if (cfg.fused_attention()) env.cp.attention_forward(atty, a.lse, qkv, NH, NKV);
    else attention_forward(atty, a.att, qkv, NH, NKV);
    keep_rounded(atty, a.atty);
  }
  row_parallel_forward(env, a.mid, a.atty, p.wo, opt(p.bo), s.seq);

  // MLP branch: the same around the column-parallel up (and gate) and row-parallel down,
  // its norm fused with the residual add mid = attn + x
  const Tensor ln2 = norm_forward_kept(env, s, a.ln2, a.ln2_mean, a.ln2_rstd, a.mid, p.ln2_w, p.ln2_b, &x);
  if (llama || !linear_gelu_fused(a.act, a.fc, ln2, p.wfc, opt(p.bfc))) mlp_up_forward(llama, a, s, ln2, p);
  row_parallel_forward(env, out, a.act, p.wproj, opt(p.bproj), s.seq);
  add_inplace(out, a.mid);  // out = mid + mlp
}

void block_backward(const BlockEnv& env, const Unit& u, const BlockActs& acts, const Tensor& x, const Tensor& dresid,
                    int B, int T, const BlockWeightInputs* defer) {
  const ModelConfig& cfg = env.cfg;
  const LocalDims& d = env.d;
  const int NH = static_cast<int>(d.NH), NKV = static_cast<int>(d.NKV);
  const bool llama = cfg.is_llama();
  BlockParams p = block_params(cfg, d, u);
  const BlockActs a = acts.at(cfg, d, B, T);
  const BlockScratch s = env.scratch.at(cfg, d, B, T);
  // Under sequence parallelism the norms and the row-parallel biases see this rank's
  // positions only: g points their gradients at workspace slots, summed over tp at the end.
  BlockParams g = p;
  std::optional<PositionShardGrads> shard_grads;
  if (sequence_parallel(env))
    shard_grads.emplace(s.rep, std::initializer_list<Tensor*>{&g.g_ln1_w, &g.g_ln1_b, &g.g_bo, &g.g_ln2_w,
                                                              &g.g_ln2_b, &g.g_bproj});
  // Where the four layers' output gradients go: without defer the workspace, each layer's
  // weight gradient running with its input gradient as soon as its output gradient is
  // known; with defer, its tensors, kept for the weight half (copied there when the
  // gradient is dresid, which the norms' backward overwrites; else computed or gathered
  // there in the first place).
  Tensor dproj = s.seq, dfc = s.dfc, dwo = s.seq, dqkv = s.dqkv;  // s.seq: sequence parallelism only
  if (defer) {
    const BlockWeightInputs k = defer->at(cfg, d, B, T);
    dproj = k.dproj, dfc = k.dfc, dwo = k.dwo, dqkv = k.dqkv;
  }
  // A layer's weight gradient, or with defer, its output gradient dy kept for the weight half.
  auto weight_half = [&](Layer layer, const Tensor& dy, const Tensor& kept) {
    if (!defer) weight_grad(env, p, a, s, layer, dy);
    else if (dy.raw() != kept.raw()) kept.copy_from(dy);
  };
  // A layer's input gradient dx (dy w, or dy w^T for io: w stored [in, out]) and its weight
  // half, in one call where the weight gradient runs now (linear_backward: dy rounded once
  // for both).
  auto layer_backward = [&](Layer layer, const Tensor& dy, const Tensor& dx, const Tensor& w, bool io,
                            const Tensor& kept) {
    if (!defer) return weight_grad(env, p, a, s, layer, dy, &dx);
    if (io) linear_io_backward_input(dx, dy, w, false);
    else linear_backward_input(dx, dy, w, false);
    weight_half(layer, dy, kept);
  };

  // MLP branch: out = mid + proj(act); dresid is d(out) = d(mid) through the skip. GPT-2's
  // d(fc) comes from the down projection's product with GELU's derivative in its epilogue
  // where the device fuses them (the GPU under bf16/fp16), else through d(act) in s.dact.
  const Tensor dyp = row_parallel_dy(env, opt(g.g_bproj), dresid, dproj);
  if (!llama && linear_dgelu_fused(dfc, dyp, p.wproj, a.fc)) {
    weight_half(Layer::proj, dyp, dproj);
  } else {
    layer_backward(Layer::proj, dyp, s.dact, p.wproj, true, dproj);
    const Tensor fc = widened(a.fc, dfc);  // 16-bit kept: widened into dfc, the backward in place
    if (llama) swiglu_backward(dfc, fc, s.dact);
    else gelu_backward(dfc, fc, s.dact);
  }
  layer_backward(Layer::fc, dfc, s.dln, p.wfc, false, dfc);
  // the norm's backward adds into dresid, which then holds d(mid)
  norm_backward(env, dresid, g.g_ln2_w, g.g_ln2_b, s.dln, a.mid, p.ln2_w, a.ln2_mean, a.ln2_rstd, s.local);

  // attention branch: mid = x + proj(atty)
  layer_backward(Layer::wo, row_parallel_dy(env, opt(g.g_bo), dresid, dwo), s.datty, p.wo, true, dwo);
  if (cfg.fused_attention() && env.cp.takes_kept(a.qkv, NH, NKV)) {  // 16-bit q|k|v and out read as they are
    env.cp.attention_backward(dqkv, s.datty, a.qkv, a.atty, a.lse, NH, NKV);
  } else {
    const Tensor qkv = widened(a.qkv, s.qkv);
    if (cfg.fused_attention()) env.cp.attention_backward(dqkv, s.datty, qkv, widened(a.atty, s.atty), a.lse, NH, NKV);
    else attention_backward(dqkv, s.datt, s.datty, qkv, a.att, NH, NKV);
  }
  if (llama) rope_backward(dqkv.reshape({B, T, NH + 2 * NKV, d.D}), NH + NKV, cfg.rope_theta, env.positions);
  layer_backward(Layer::qkv, dqkv, s.dln, p.wqkv, false, dqkv);
  norm_backward(env, dresid, g.g_ln1_w, g.g_ln1_b, s.dln, x, p.ln1_w, a.ln1_mean, a.ln1_rstd, s.local);

  if (shard_grads) shard_grads->finish(env.tp);
}

void block_backward_weight(const BlockEnv& env, const Unit& u, const BlockActs& acts, const BlockWeightInputs& w,
                           int B, int T) {
  const BlockParams p = block_params(env.cfg, env.d, u);
  const BlockActs a = acts.at(env.cfg, env.d, B, T);
  const BlockScratch s = env.scratch.at(env.cfg, env.d, B, T);
  const BlockWeightInputs k = w.at(env.cfg, env.d, B, T);
  weight_grad(env, p, a, s, Layer::proj, k.dproj);
  weight_grad(env, p, a, s, Layer::fc, k.dfc);
  weight_grad(env, p, a, s, Layer::wo, k.dwo);
  weight_grad(env, p, a, s, Layer::qkv, k.dqkv);
}

}  // namespace mt
