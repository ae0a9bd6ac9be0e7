#include "nn/model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "nn/block.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/norm.h"

namespace mt {

Tensor Unit::param(const std::string& suffix) const {
  for (const ParamSpec& p : params)
    if (p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return w.view(p.offset, p.shape);
  MT_FAIL("internal: no parameter ending in " << suffix << " in unit " << name);
}

namespace {

// Appends a parameter to a unit. Matrices decay; vectors (norms, biases) do not.
void add_param(Unit& u, std::string name, Shape shape, Init init, float std = 0.02f, bool hf_transposed = false) {
  ParamSpec p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.offset = u.numel;
  p.decay = p.shape.size() >= 2;
  p.hf_transposed = hf_transposed;
  p.init = init;
  p.init_std = std;
  u.numel += p.numel();
  u.params.push_back(std::move(p));
}

}  // namespace

// Initialisation scheme (GPT-2's): linear and embedding weights N(0, 0.02); the two
// projections that write into the residual stream (attention output, MLP output) use
// 0.02 / sqrt(2 n_layer) so the residual's variance does not grow with depth; learned
// positions N(0, 0.01); biases 0; norm weights 1.
std::vector<Unit> model_layout(const ModelConfig& cfg) {
  cfg.validate();
  const int64_t C = cfg.d_model, F = cfg.ff_dim(), V = cfg.vocab_size, T = cfg.seq_len;
  const int64_t D = cfg.head_dim(), NH = cfg.n_head, NKV = cfg.kv_heads();
  const float resid_std = 0.02f / std::sqrt(2.0f * cfg.n_layer);
  std::vector<Unit> units;
  Unit embed;
  embed.name = "embed";
  if (!cfg.is_llama()) {
    add_param(embed, "transformer.wte.weight", {V, C}, Init::normal);
    add_param(embed, "transformer.wpe.weight", {T, C}, Init::normal, 0.01f);
  } else {
    add_param(embed, "model.embed_tokens.weight", {V, C}, Init::normal);
  }
  units.push_back(std::move(embed));
  for (int l = 0; l < cfg.n_layer; ++l) {
    Unit b;
    b.name = "block." + std::to_string(l);
    if (!cfg.is_llama()) {
      std::string h = "transformer.h." + std::to_string(l) + ".";
      add_param(b, h + "ln_1.weight", {C}, Init::ones);
      add_param(b, h + "ln_1.bias", {C}, Init::zeros);
      add_param(b, h + "attn.c_attn.weight", {3 * C, C}, Init::normal, 0.02f, true);
      add_param(b, h + "attn.c_attn.bias", {3 * C}, Init::zeros);
      add_param(b, h + "attn.c_proj.weight", {C, C}, Init::normal, resid_std, true);
      add_param(b, h + "attn.c_proj.bias", {C}, Init::zeros);
      add_param(b, h + "ln_2.weight", {C}, Init::ones);
      add_param(b, h + "ln_2.bias", {C}, Init::zeros);
      add_param(b, h + "mlp.c_fc.weight", {F, C}, Init::normal, 0.02f, true);
      add_param(b, h + "mlp.c_fc.bias", {F}, Init::zeros);
      add_param(b, h + "mlp.c_proj.weight", {C, F}, Init::normal, resid_std, true);
      add_param(b, h + "mlp.c_proj.bias", {C}, Init::zeros);
    } else {
      std::string h = "model.layers." + std::to_string(l) + ".";
      add_param(b, h + "input_layernorm.weight", {C}, Init::ones);
      add_param(b, h + "self_attn.q_proj.weight", {NH * D, C}, Init::normal);
      add_param(b, h + "self_attn.k_proj.weight", {NKV * D, C}, Init::normal);
      add_param(b, h + "self_attn.v_proj.weight", {NKV * D, C}, Init::normal);
      add_param(b, h + "self_attn.o_proj.weight", {C, NH * D}, Init::normal, resid_std);
      add_param(b, h + "post_attention_layernorm.weight", {C}, Init::ones);
      add_param(b, h + "mlp.gate_proj.weight", {F, C}, Init::normal);
      add_param(b, h + "mlp.up_proj.weight", {F, C}, Init::normal);
      add_param(b, h + "mlp.down_proj.weight", {C, F}, Init::normal, resid_std);
    }
    units.push_back(std::move(b));
  }
  Unit fin;
  fin.name = "final";
  if (!cfg.is_llama()) {
    add_param(fin, "transformer.ln_f.weight", {C}, Init::ones);
    add_param(fin, "transformer.ln_f.bias", {C}, Init::zeros);
  } else {
    add_param(fin, "model.norm.weight", {C}, Init::ones);
  }
  if (!cfg.tied()) add_param(fin, "lm_head.weight", {V, C}, Init::normal);
  units.push_back(std::move(fin));
  return units;
}

Model::Model(const ModelConfig& cfg, Allocator& alloc, int micro_batch, bool recompute, bool allocate_state)
    : cfg_(cfg), alloc_(alloc), micro_batch_(micro_batch), recompute_(recompute), units_(model_layout(cfg)) {
  MT_CHECK(micro_batch >= 1, "training.micro_batch = " << micro_batch << " must be at least 1");
  if (allocate_state) {
    // All gradients in one buffer, units in backward order (final unit first), so that a
    // data-parallel bucket of consecutive units is one contiguous range, reduced in place.
    int64_t total = 0;
    for (const Unit& u : units_) total += u.numel;
    Tensor grads = Tensor::zeros({total}, DType::f32, alloc, MemTag::grads);
    int64_t off = total;
    for (Unit& u : units_) {
      u.w = Tensor::zeros({u.numel}, DType::f32, alloc, MemTag::params);
      off -= u.numel;
      u.g = grads.view(off, {u.numel});
    }
  }
  const int64_t B = micro_batch, T = cfg.seq_len, C = cfg.d_model, V = cfg.vocab_size;
  auto make = [&](const Shape& s, DType t = DType::f32) { return Tensor::empty(s, t, alloc, MemTag::activations); };
  tokens_ = make({B, T}, DType::i32);
  targets_ = make({B, T}, DType::i32);
  for (int l = 0; l < (recompute ? 1 : cfg.n_layer); ++l) acts_.push_back(std::make_unique<BlockActs>(cfg, B, alloc));
  for (int l = 0; l <= cfg.n_layer; ++l) block_in_.push_back(make({B, T, C}));
  lnf_ = make({B, T, C});
  lnf_mean_ = make({B, T});
  lnf_rstd_ = make({B, T});
  logits_ = make({B, T, V});
  losses_ = make({B, T});
  lse_ = make({B, T});
  dresid_ = make({B, T, C});
  scratch_ = std::make_unique<BlockScratch>(cfg, B, alloc);
}

Model::~Model() = default;

int64_t Model::num_params() const {
  int64_t n = 0;
  for (const Unit& u : units_) n += u.numel;
  return n;
}

const ParamSpec* Model::find_param(const std::string& name, int* unit) const {
  for (size_t i = 0; i < units_.size(); ++i)
    for (const ParamSpec& p : units_[i].params)
      if (p.name == name) {
        if (unit) *unit = static_cast<int>(i);
        return &p;
      }
  return nullptr;
}

std::vector<int> Model::units_used(int unit) const {
  if (unit == cfg_.n_layer + 1 && cfg_.tied()) return {unit, 0};
  return {unit};
}

Tensor Model::param(const std::string& name) const {
  int u = 0;
  const ParamSpec* p = find_param(name, &u);
  MT_CHECK(p, "internal: no parameter " << name);
  return units_[u].w.view(p->offset, p->shape);
}

void Model::init(uint64_t seed) {
  for (size_t u = 0; u < units_.size(); ++u) init_range(static_cast<int>(u), 0, units_[u].numel, units_[u].w.f32(), seed);
}

void Model::init_range(int unit, int64_t begin, int64_t end, float* dst, uint64_t seed) const {
  Philox rng{seed};
  for (const ParamSpec& p : units_[unit].params) {
    // the part of this parameter inside [begin, end), by its element index i
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.numel());
    if (lo >= hi) continue;
    float* out = dst + (lo - begin);
    if (p.init != Init::normal) {
      std::fill(out, out + (hi - lo), p.init == Init::ones ? 1.0f : 0.0f);
      continue;
    }
    const uint64_t stream = stream_id(p.name.c_str());
    const int64_t first = lo - p.offset, n = hi - lo;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(rng.normal(stream, first + i) * p.init_std);
  }
}

void Model::zero_grad() {
  for (Unit& u : units_) u.g.zero_();
}

Tensor Model::logits() const { return logits_.view(0, {B_, T_, cfg_.vocab_size}); }

double Model::forward(const int32_t* tokens, const int32_t* targets, int B, int T) {
  MT_CHECK(B >= 1 && B <= micro_batch_, "internal: batch " << B << " exceeds micro_batch " << micro_batch_);
  MT_CHECK(T >= 1 && T <= cfg_.seq_len, "sequence of " << T << " tokens exceeds model.seq_len = " << cfg_.seq_len);
  B_ = B, T_ = T;
  has_targets_ = targets != nullptr;
  const int64_t n = int64_t{B} * T;
  for (int64_t i = 0; i < n; ++i) {
    MT_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size,
             "token id " << tokens[i] << " is outside the vocabulary [0, " << cfg_.vocab_size
                         << "); set model.vocab_size above the largest token id in the data");
    tokens_.i32()[i] = tokens[i];
    if (targets) {
      MT_CHECK(targets[i] >= -1 && targets[i] < cfg_.vocab_size,
               "target id " << targets[i] << " is outside the vocabulary [0, " << cfg_.vocab_size
                            << "); set model.vocab_size above the largest token id in the data");
      targets_.i32()[i] = targets[i];
    }
  }
  UnitHooks& h = hooks_ ? *hooks_ : no_hooks_;
  h.before_forward(0);
  embed_forward();
  h.after_forward(0);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    h.before_forward(l + 1);
    const Tensor x = block_in_[l].view(0, {B, T, cfg_.d_model});
    const Tensor out = block_in_[l + 1].view(0, {B, T, cfg_.d_model});
    block_forward(cfg_, units_[l + 1], *acts_[recompute_ ? 0 : l], x, out, B, T);
    h.after_forward(l + 1);
  }
  h.before_forward(cfg_.n_layer + 1);
  final_forward();
  h.after_forward(cfg_.n_layer + 1);
  if (!targets) return 0.0;
  return cross_entropy_forward(losses_.view(0, {B, T}), lse_.view(0, {B, T}), logits(), targets_.view(0, {B, T}));
}

void Model::backward(float scale) {
  MT_CHECK(has_targets_, "internal: backward needs a forward with targets");
  const int B = B_, T = T_, L = cfg_.n_layer;
  UnitHooks& h = hooks_ ? *hooks_ : no_hooks_;
  h.before_backward(L + 1);
  final_backward(scale);
  h.after_backward(L + 1);
  const Tensor dresid = dresid_.view(0, {B, T, cfg_.d_model});
  for (int l = L - 1; l >= 0; --l) {
    h.before_backward(l + 1);
    const Tensor x = block_in_[l].view(0, {B, T, cfg_.d_model});
    BlockActs& a = *acts_[recompute_ ? 0 : l];
    // Recomputation rewrites the block's output into block_in_[l + 1], bit-identical to
    // what the forward wrote, and no longer needed: the block above is done.
    if (recompute_) block_forward(cfg_, units_[l + 1], a, x, block_in_[l + 1].view(0, {B, T, cfg_.d_model}), B, T);
    block_backward(cfg_, units_[l + 1], a, *scratch_, x, dresid, B, T);
    h.after_backward(l + 1);
  }
  h.before_backward(0);
  embed_backward();
  h.after_backward(0);
}

void Model::embed_forward() {
  const Unit& u = units_[0];
  const Tensor out = block_in_[0].view(0, {B_, T_, cfg_.d_model});
  const Tensor tok = tokens_.view(0, {B_, T_});
  if (!cfg_.is_llama()) {
    Tensor wpe = u.param("wpe.weight");
    embedding_forward(out, tok, u.param("wte.weight"), &wpe);
  } else {
    embedding_forward(out, tok, u.param("embed_tokens.weight"), nullptr);
  }
}

void Model::embed_backward() {
  const Unit& u = units_[0];
  const Tensor dout = dresid_.view(0, {B_, T_, cfg_.d_model});
  const Tensor tok = tokens_.view(0, {B_, T_});
  if (!cfg_.is_llama()) {
    const ParamSpec* wte = find_param("transformer.wte.weight");
    const ParamSpec* wpe = find_param("transformer.wpe.weight");
    Tensor dwpe = u.g.view(wpe->offset, wpe->shape);
    embedding_backward(u.g.view(wte->offset, wte->shape), &dwpe, dout, tok);
  } else {
    const ParamSpec* wte = find_param("model.embed_tokens.weight");
    embedding_backward(u.g.view(wte->offset, wte->shape), nullptr, dout, tok);
  }
}

// The output head's weight: lm_head.weight, or the token embedding when tied.
static const ParamSpec& head_spec(const Model& m, int* unit) {
  const ModelConfig& c = m.config();
  const char* name = !c.tied() ? "lm_head.weight" : c.is_llama() ? "model.embed_tokens.weight" : "transformer.wte.weight";
  const ParamSpec* p = m.find_param(name, unit);
  return *p;
}

void Model::final_forward() {
  const Unit& u = units_.back();
  const int B = B_, T = T_, C = cfg_.d_model;
  const Tensor x = block_in_[cfg_.n_layer].view(0, {B, T, C});
  const Tensor lnf = lnf_.view(0, {B, T, C});
  if (!cfg_.is_llama())
    layernorm_forward(lnf, lnf_mean_.view(0, {B, T}), lnf_rstd_.view(0, {B, T}), x, u.param("ln_f.weight"),
                      u.param("ln_f.bias"), cfg_.norm_eps);
  else
    rmsnorm_forward(lnf, lnf_rstd_.view(0, {B, T}), x, u.param("model.norm.weight"), cfg_.norm_eps);
  int hu = 0;
  const ParamSpec& hp = head_spec(*this, &hu);
  linear_forward(logits(), lnf, units_[hu].w.view(hp.offset, hp.shape), nullptr);
}

void Model::final_backward(float scale) {
  Unit& u = units_.back();
  const int B = B_, T = T_, C = cfg_.d_model;
  const Tensor x = block_in_[cfg_.n_layer].view(0, {B, T, C});
  const Tensor lnf = lnf_.view(0, {B, T, C});
  const Tensor dlogits = logits();  // the gradient overwrites the logits in place
  cross_entropy_backward(dlogits, logits(), lse_.view(0, {B, T}), targets_.view(0, {B, T}), scale);
  int hu = 0;
  const ParamSpec& hp = head_spec(*this, &hu);
  linear_backward_weight(units_[hu].g.view(hp.offset, hp.shape), nullptr, dlogits, lnf);
  const Tensor dln = scratch_->dln.view(0, {B, T, C});
  linear_backward_input(dln, dlogits, units_[hu].w.view(hp.offset, hp.shape), false);
  const Tensor dresid = dresid_.view(0, {B, T, C});
  dresid.zero_();
  auto grad = [&](const char* name) {
    const ParamSpec* p = find_param(name);
    return u.g.view(p->offset, p->shape);
  };
  if (!cfg_.is_llama())
    layernorm_backward(dresid, grad("transformer.ln_f.weight"), grad("transformer.ln_f.bias"), dln, x,
                       u.param("ln_f.weight"), lnf_mean_.view(0, {B, T}), lnf_rstd_.view(0, {B, T}));
  else
    rmsnorm_backward(dresid, grad("model.norm.weight"), dln, x, u.param("model.norm.weight"),
                     lnf_rstd_.view(0, {B, T}));
}

}  // namespace mt
