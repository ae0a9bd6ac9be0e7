#include "nn/model.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "nn/block.h"
#include "nn/kv_cache.h"
#include "ops/activation.h"
#include "ops/autocast.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/norm.h"

namespace mt {

namespace {

const ModelConfig& validated(const ModelConfig& cfg) {
  cfg.validate();
  return cfg;
}

// The whole model as one chunk when no share is given.
std::vector<ChunkSpec> chunks_of(const ModelConfig& cfg, const ModelShare& share) {
  if (!share.chunks.empty()) return share.chunks;
  return {ChunkSpec{0, cfg.n_layer, true, true, 1}};
}

}  // namespace

int64_t activation_bytes(const ModelConfig& cfg, const LocalDims& d, int64_t B, Recompute recompute,
                         const ModelShare& share, int64_t kept_bytes) {
  const int64_t T = d.T, Tl = T / d.seq_split, C = d.C, F = d.F, NH = d.NH;
  const int64_t up = cfg.is_llama() ? 2 * F : F;  // the up projection's outputs (llama: gate and up)
  const bool fused = cfg.fused_attention();
  // One layer, in floats (Korthikanti et al.'s per-layer count, in fp32 and without dropout):
  // residual-stream tensors (norm outputs, the residual after attention; sequence-sharded
  // with sequence parallelism) and the norms' statistics, then what the split layers keep
  // (divided by tp through LocalDims): q|k|v, the attention output, the MLP's two tensors,
  // and the attention's softmax state (fused: a log-sum-exp per row, instead of NH T^2).
  const int64_t layer = B * Tl * 3 * C + B * Tl * 4 + B * T * (d.qkv() + d.attn() + up + F) +
                        (fused ? B * NH * T : B * NH * T * T);
  // ln1, ln2, qkv, atty, fc and act take kept_bytes each instead of 4.
  const int64_t saved = (B * Tl * 2 * C + B * T * (d.qkv() + d.attn() + up + F)) * (4 - kept_bytes);
  // A split backward keeps each layer's linear output gradients from BI to BW.
  const int64_t pending = share.split_backward ? B * T * (2 * C + up + d.qkv()) : 0;
  // One layer's backward workspace, shared by all layers.
  int64_t scratch = B * T * (C + d.qkv() + d.attn() + up + F) + (fused ? 0 : B * NH * T * T);
  if (d.kv_sharers > 1) scratch += d.qkv() * C;
  if (d.seq_split > 1) scratch += B * T * C + B * Tl * C + 6 * C;
  if (kept_bytes < 4) scratch += B * T * (d.qkv() + d.attn());  // the kept qkv and atty in fp32
  // Each slot of a chunk of n layers: the activations of the n - r layers that keep theirs
  // (r recompute), the residual stream (n + 1 tensors) and its gradient, the token and
  // target ids; the head's chunk also the final norm (gathered output, statistics), logits
  // over this rank's vocabulary rows and the loss's rows (losses, lse, row max, target
  // logit). Recomputing blocks share one set of activations, rebuilt in backward.
  int64_t slots = 0, layers_kept = recompute.any() ? 1 : 0;
  for (const ChunkSpec& ch : chunks_of(cfg, share)) {
    const int64_t n = ch.end_layer - ch.first_layer, kept = n - recompute.of(static_cast<int>(n));
    int64_t one = kept * layer + n * pending + (n + 2) * B * Tl * C + 2 * B * T;
    if (ch.head) one += B * T * C + 2 * B * Tl + B * T * d.V + 4 * B * T;
    slots += ch.slots * one;
    layers_kept += ch.slots * kept;
  }
  return 4 * ((recompute.any() ? layer : 0) + scratch + slots) - layers_kept * saved;
}

// What one slot of a chunk keeps for a micro-batch in flight.
struct Model::Slot {
  int B = 0, T = 0;
  bool has_targets = false;
  Tensor tokens, targets;  // [B, T] i32
  // The residual stream holds Tl = T / tp positions with sequence parallelism, else T.
  std::vector<Tensor> resid;  // [n + 1] x [B, Tl, C]: input of the chunk's block i; [n] its output
  std::vector<std::unique_ptr<BlockActs>> acts;             // [n] (null for a block that recomputes)
  std::vector<std::unique_ptr<BlockWeightInputs>> pending;  // [n] split backward only
  Tensor dresid;  // [B, Tl, C] gradient of the residual stream
  // the head's chunk only:
  Tensor lnf, lnf_mean, lnf_rstd;  // [B, T, C] (the head's input), [B, Tl], [B, Tl]
  Tensor logits, losses, lse;      // [B, T, V], [B, T], [B, T] (V: this rank's vocabulary rows)
  Tensor row_max, target_logit;    // [B, T], [B, T]: the vocabulary-parallel loss's statistics
};

struct Model::Chunk {
  ChunkSpec spec;
  std::vector<Slot> slots;
};

Model::Model(const ModelConfig& cfg, Allocator& alloc, int micro_batch, Recompute recompute, bool allocate_state,
             TpMappings* tp, const ModelShare& share, CpMappings* cp)
    : cfg_(validated(cfg)),  // before any size is read from it
      tp_(tp ? *tp : no_tp_),
      cp_(cp ? *cp : no_cp_),
      positions_(cp_positions(cfg.seq_len, cp_.shard())),
      dims_(local_dims(cfg, tp_.shard())),
      alloc_(alloc),
      micro_batch_(micro_batch),
      recompute_(recompute),
      units_(model_layout(cfg, tp_.shard())),
      share_(share) {
  MT_CHECK(micro_batch >= 1, "training.micro_batch = " << micro_batch << " must be at least 1");
  dims_.T = static_cast<int64_t>(positions_.size());
  if (tp_.sequence_parallel()) {
    dims_.seq_split = tp_.shard().size;
    MT_CHECK(dims_.T % dims_.seq_split == 0, "model.seq_len = " << cfg.seq_len << " (" << dims_.T << " positions per "
                                                 << "parallel.cp rank) does not split over parallel.tp = "
                                                 << dims_.seq_split << " ranks for parallel.sequence_parallel; "
                                                 << "use a seq_len that tp x cp divides, or sequence_parallel=false");
  }
  MT_CHECK(!(recompute.any() && share.split_backward),
           "training.recompute cannot run with a split backward (parallel.pp_schedule zb-h1 or zbv): the weight half "
           "would need the activations again; use parallel.pp_schedule=1f1b or interleaved, or recompute=false");
  share_.chunks = chunks_of(cfg, share);
  // Units this rank does not hold keep their names and no parameters.
  std::vector<bool> held(units_.size(), false);
  for (const ChunkSpec& ch : share_.chunks) {
    MT_CHECK(ch.first_layer >= 0 && ch.first_layer <= ch.end_layer && ch.end_layer <= cfg.n_layer && ch.slots >= 1,
             "internal: chunk of layers [" << ch.first_layer << ", " << ch.end_layer << ") with " << ch.slots << " slots");
    for (int l = ch.first_layer; l < ch.end_layer; ++l) held[l + 1] = true;
    if (ch.embed) held[0] = true;
    if (ch.head) held[cfg.n_layer + 1] = true;
    if (ch.head && cfg.tied()) held[0] = true;  // the head's weight
  }
  for (size_t u = 0; u < units_.size(); ++u)
    if (!held[u]) {
      units_[u].params.clear();
      units_[u].numel = 0;
    }
  if (allocate_state) {
    // All gradients in one buffer, units in backward order (final unit first), so that a
    // data-parallel bucket of consecutive units is one contiguous range, reduced in place.
    int64_t total = 0;
    for (const Unit& u : units_) total += u.numel;
    Tensor grads = Tensor::zeros({total}, grad_dtype(cfg), alloc, MemTag::grads);
    int64_t off = total;
    for (Unit& u : units_) {
      u.w = Tensor::zeros({u.numel}, working_dtype(cfg), alloc, MemTag::params);
      off -= u.numel;
      u.g = grads.view(off, {u.numel});
    }
  }
  const int64_t B = micro_batch, T = dims_.T, C = cfg.d_model, V = dims_.V;
  const int64_t Tl = T / dims_.seq_split;  // positions of the residual stream on this rank
  auto make = [&](const Shape& s, DType t = DType::f32) { return Tensor::empty(s, t, alloc, MemTag::activations); };
  // The activations a block keeps, in 16 bits under the 16-bit precisions (BlockActs:
  // rounded where they are produced, or rounded by the products that read them).
  const DType kept = working_dtype(cfg);
  if (recompute.any()) shared_acts_ = std::make_unique<BlockActs>(cfg, dims_, B, alloc, kept);
  for (const ChunkSpec& spec : share_.chunks) {
    Chunk& ch = chunks_.emplace_back();
    ch.spec = spec;
    ch.slots.resize(spec.slots);
    const int n = spec.end_layer - spec.first_layer;
    for (Slot& sl : ch.slots) {
      sl.tokens = make({B, T}, DType::i32);
      sl.targets = make({B, T}, DType::i32);
      sl.acts.resize(n);  // the first recompute.of(n) blocks recompute theirs
      for (int i = recompute.of(n); i < n; ++i) sl.acts[i] = std::make_unique<BlockActs>(cfg, dims_, B, alloc, kept);
      for (int i = 0; i < n && share.split_backward; ++i)
        sl.pending.push_back(std::make_unique<BlockWeightInputs>(cfg, dims_, B, alloc));
      for (int i = 0; i <= n; ++i) sl.resid.push_back(make({B, Tl, C}));
      sl.dresid = make({B, Tl, C});
      if (!spec.head) continue;
      sl.lnf = make({B, T, C});
      sl.lnf_mean = make({B, Tl});
      sl.lnf_rstd = make({B, Tl});
      sl.logits = make({B, T, V});
      sl.losses = make({B, T});
      sl.lse = make({B, T});
      sl.row_max = make({B, T});
      sl.target_logit = make({B, T});
    }
  }
  scratch_ = std::make_unique<BlockScratch>(cfg, dims_, B, alloc, kept);
  if (cfg.mixed_precision()) {  // the staging for the largest set of units one unit's compute reads
    int64_t most = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      int64_t n = 0;
      for (int v : units_used(static_cast<int>(u))) n += units_[v].numel;
      if (units_[u].numel > 0) most = std::max(most, n);
    }
    wide_ = Tensor::empty({std::max<int64_t>(most, 1)}, DType::f32, alloc, MemTag::other);
    narrow_w_.resize(units_.size());
    if (cfg.grad_working()) {  // the fp32 gradients one unit's backward computes, added into the 16-bit g after it
      wide_g_ = Tensor::empty({std::max<int64_t>(most, 1)}, DType::f32, alloc, MemTag::other);
      narrow_g_.resize(units_.size());
    }
  }
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
  for (size_t u = 0; u < units_.size(); ++u) {
    const Tensor& dst = units_[u].w;
    std::vector<float> w(units_[u].numel);
    init_range(static_cast<int>(u), 0, units_[u].numel, w.data(), seed);
    std::vector<char> narrow(dst.nbytes());  // in the working dtype, then to wherever w lives
    convert(dst.dtype(), narrow.data(), DType::f32, w.data(), units_[u].numel);
    dst.copy_from(Tensor::wrap(narrow.data(), dst.shape(), dst.dtype()));
  }
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
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = p.global_index(first + i);  // -1: padding
      out[i] = g < 0 ? 0.0f : static_cast<float>(rng.normal(stream, g) * p.init_std);
    }
  }
}

void Model::zero_grad() {
  for (Unit& u : units_) u.g.zero_();
}

bool Model::holds(int unit) const { return units_[unit].numel > 0; }

Model::Slot& Model::slot(int chunk, int slot) {
  MT_CHECK(chunk >= 0 && chunk < static_cast<int>(chunks_.size()) && slot >= 0 &&
               slot < static_cast<int>(chunks_[chunk].slots.size()),
           "internal: no slot " << slot << " of chunk " << chunk);
  return chunks_[chunk].slots[slot];
}

const Model::Slot& Model::slot(int chunk, int slot) const { return const_cast<Model*>(this)->slot(chunk, slot); }

bool Model::holds_embedding() const {
  return std::any_of(chunks_.begin(), chunks_.end(), [](const Chunk& c) { return c.spec.embed; });
}

int Model::head_chunk() const {
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (chunks_[c].spec.head) return static_cast<int>(c);
  MT_FAIL("internal: this rank holds no head");
}

Tensor Model::chunk_input(int chunk, int s, int B, int T) const {
  return slot(chunk, s).resid.front().view(0, {B, T / dims_.seq_split, cfg_.d_model});
}

Tensor Model::chunk_output(int chunk, int s, int B, int T) const {
  return slot(chunk, s).resid.back().view(0, {B, T / dims_.seq_split, cfg_.d_model});
}

Tensor Model::chunk_grad(int chunk, int s, int B, int T) const {
  return slot(chunk, s).dresid.view(0, {B, T / dims_.seq_split, cfg_.d_model});
}

Tensor Model::logits(int s) const {
  const Slot& sl = slot(head_chunk(), s);
  return sl.logits.view(0, {sl.B, sl.T, dims_.V});
}

void Model::predictions(int32_t* out, int s) {
  Slot& sl = slot(head_chunk(), s);
  const int64_t n = int64_t{sl.B} * sl.T;
  const Tensor m = sl.row_max.view(0, {n}), first = sl.target_logit.view(0, {n});  // workspaces here
  cross_entropy_row_max(m, logits(s), dims_.vocab_valid);
  tp_.max(m);
  // Each rank's first column holding the maximum, as -(global id) (-inf where it holds
  // none): the maximum over tp is the lowest such id.
  cross_entropy_first_max(first, logits(s), m, dims_.vocab_begin, dims_.vocab_valid);
  tp_.max(first);
  std::vector<float> ids(n);
  Tensor::wrap(ids.data(), {n}, DType::f32).copy_from(first);  // from the GPU too
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(-ids[i]);
}

namespace {

// Ids in [lowest, vocab) into dst (targets may be -1: no loss at that position).
void copy_ids(const Tensor& dst, const int32_t* src, int64_t n, int lowest, int vocab, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    MT_CHECK(src[i] >= lowest && src[i] < vocab,
             what << " id " << src[i] << " is outside the vocabulary [0, " << vocab
                  << "); set model.vocab_size above the largest token id in the data");
  dst.view(0, {n}).copy_from(Tensor::wrap(const_cast<int32_t*>(src), {n}, DType::i32));  // to the GPU too
}

}  // namespace

double Model::forward(int chunk, int s, const int32_t* tokens, const int32_t* targets, int B, int T) {
  MT_CHECK(B >= 1 && B <= micro_batch_, "internal: batch " << B << " exceeds micro_batch " << micro_batch_);
  MT_CHECK(T >= 1 && T <= cfg_.seq_len, "sequence of " << T << " tokens exceeds model.seq_len = " << cfg_.seq_len);
  MT_CHECK(cp_.shard().size == 1 || T == dims_.T, "internal: context parallelism takes this rank's " << dims_.T
                                                      << " positions of whole sequences, not " << T);
  MT_CHECK(T % dims_.seq_split == 0, "a sequence of " << T << " tokens does not split over the " << dims_.seq_split
                                                      << " ranks of parallel.tp with parallel.sequence_parallel=true");
  const ChunkSpec& spec = chunks_[chunk].spec;
  Slot& sl = slot(chunk, s);
  B_ = sl.B = B, T_ = sl.T = T;
  sl.has_targets = targets != nullptr;
  if (spec.embed) copy_ids(sl.tokens, tokens, int64_t{B} * T, 0, cfg_.vocab_size, "token");
  if (spec.head && targets) copy_ids(sl.targets, targets, int64_t{B} * T, -1, cfg_.vocab_size, "target");
  UnitHooks& h = hooks_ ? *hooks_ : no_hooks_;
  Autocast autocast(working_dtype(cfg_));
  if (spec.embed) {
    h.before_forward(0);
    widen(0);
    embed_forward(sl);
    narrow(0);
    h.after_forward(0);
  }
  for (int l = spec.first_layer; l < spec.end_layer; ++l) {
    const int i = l - spec.first_layer;
    h.before_forward(l + 1);
    widen(l + 1);
    block_forward(env(), units_[l + 1], sl.acts[i] ? *sl.acts[i] : *shared_acts_, resid(sl.resid[i]),
                  resid(sl.resid[i + 1]), B, T);
    narrow(l + 1);
    h.after_forward(l + 1);
  }
  if (!spec.head) return 0.0;
  h.before_forward(cfg_.n_layer + 1);
  widen(cfg_.n_layer + 1);
  final_forward(sl, resid(sl.resid.back()));
  narrow(cfg_.n_layer + 1);
  h.after_forward(cfg_.n_layer + 1);
  return targets ? loss_forward(sl) : 0.0;
}

// The loss over the vocabulary; under tensor parallelism over this rank's columns, with the
// row statistics (max, sum of exponentials, target logit) reduced over tp, so that no rank
// holds the logits of the whole vocabulary.
double Model::loss_forward(Slot& sl) {
  const int B = sl.B, T = sl.T;
  const Tensor losses = sl.losses.view(0, {B, T}), lse = sl.lse.view(0, {B, T}), tg = sl.targets.view(0, {B, T});
  const Tensor logits = sl.logits.view(0, {B, T, dims_.V});
  if (tp_.shard().size == 1) return cross_entropy_forward(losses, lse, logits, tg);
  const Tensor m = sl.row_max.view(0, {B, T}), t = sl.target_logit.view(0, {B, T});
  const Tensor sum_exp = lse;  // lse holds the sum of exponentials until cross_entropy_finish
  cross_entropy_row_max(m, logits, dims_.vocab_valid);
  tp_.max(m);
  cross_entropy_row_stats(sum_exp, t, logits, tg, dims_.vocab_begin, dims_.vocab_valid, m);
  tp_.sum(sum_exp);
  tp_.sum(t);
  return cross_entropy_finish(losses, lse, m, sum_exp, t, tg);
}

void Model::backward(int chunk, int s, float scale, Backward part) {
  const ChunkSpec& spec = chunks_[chunk].spec;
  Slot& sl = slot(chunk, s);
  MT_CHECK(!spec.head || sl.has_targets, "internal: backward needs a forward with targets");
  MT_CHECK(part == Backward::whole || share_.split_backward, "internal: a split backward on a model made without it");
  B_ = sl.B, T_ = sl.T;
  const int L = cfg_.n_layer;
  if (spec.head) backward_unit(L + 1, sl, -1, scale, part);
  for (int l = spec.end_layer - 1; l >= spec.first_layer; --l) backward_unit(l + 1, sl, l - spec.first_layer, scale, part);
  if (spec.embed) backward_unit(0, sl, -1, scale, part);
}

// One unit's part of a backward, inside its hooks. The head's weight gradient, each block's
// four matrix products' and the embedding's are the weight half; the rest is the input half.
void Model::backward_unit(int unit, Slot& sl, int i, float scale, Backward part) {
  UnitHooks& h = hooks_ ? *hooks_ : no_hooks_;
  const int L = cfg_.n_layer;
  const bool input = part != Backward::weight, weight = part != Backward::input, split = part != Backward::whole;
  h.before_backward(unit);
  Autocast autocast(working_dtype(cfg_));
  if (unit != 0) widen(unit);  // the embedding's backward reads no parameters
  stage_grads(unit);
  if (unit == L + 1) {
    if (input) final_backward(sl, scale, !split);
    if (weight && split) head_backward_weight(sl);
  } else if (unit == 0) {
    if (weight) embed_backward(sl);
  } else {
    const Tensor x = resid(sl.resid[i]);
    const bool recomputes = !sl.acts[i];
    BlockActs& a = recomputes ? *shared_acts_ : *sl.acts[i];
    if (input) {
      // Recomputation rewrites the block's output into resid[i + 1], bit-identical to what
      // the forward wrote, and no longer needed: the block above is done.
      if (recomputes) block_forward(env(), units_[unit], a, x, resid(sl.resid[i + 1]), B_, T_);
      block_backward(env(), units_[unit], a, x, resid(sl.dresid), B_, T_, split ? sl.pending[i].get() : nullptr);
    }
    if (weight && split) block_backward_weight(env(), units_[unit], a, *sl.pending[i], B_, T_);
  }
  narrow(unit);
  unstage_grads(unit);
  if (!weight) return;
  h.after_backward(unit);
  // A tied head on a last stage without the embedding: the copy's gradient is complete too.
  if (unit == L + 1 && cfg_.tied() && !holds_embedding()) h.after_backward(0);
}

BlockEnv Model::env() const {
  return BlockEnv{cfg_, dims_, tp_, *scratch_, cp_, cp_.shard().size > 1 ? positions_.data() : nullptr};
}

Tensor Model::resid(const Tensor& buf) const { return buf.view(0, {B_, T_ / dims_.seq_split, cfg_.d_model}); }

// The first local row of this rank's part of the residual stream (sequence parallelism), else 0.
int64_t Model::first_row() const {
  return dims_.seq_split > 1 ? int64_t{tp_.shard().rank} * (T_ / dims_.seq_split) : 0;
}

void Model::embed_forward(Slot& sl) {
  const Unit& u = units_[0];
  const Tensor out = resid(sl.resid.front());
  const Tensor tok = sl.tokens.view(0, {B_, T_});
  const Tensor wte = u.param(cfg_.is_llama() ? "embed_tokens.weight" : "wte.weight");
  const bool cp = cp_.shard().size > 1;  // learned positions looked up by position, not row
  if (tp_.shard().size == 1) {
    Tensor wpe;
    if (!cfg_.is_llama()) wpe = u.param("wpe.weight");
    embedding_forward(out, tok, wte, wpe.defined() && !cp ? &wpe : nullptr);
    if (wpe.defined() && cp) position_forward(out, wpe, positions_.data());
    return;
  }
  // vocabulary-parallel: each rank looks up the ids it holds (0 for the others), then the
  // sum over tp (reduce, or reduce-scatter into this rank's positions)
  if (dims_.seq_split > 1) {
    const Tensor full = scratch_->seq.view(0, {B_, T_, cfg_.d_model});
    embedding_shard_forward(full, tok, wte, dims_.vocab_begin, dims_.vocab_valid, cfg_.vocab_size);
    tp_.reduce_scatter_sequence(out, full);
  } else {
    embedding_shard_forward(out, tok, wte, dims_.vocab_begin, dims_.vocab_valid, cfg_.vocab_size);
    tp_.reduce_forward(out);
  }
  if (!cfg_.is_llama()) {
    position_forward(out, u.param("wpe.weight"), positions_.data() + first_row());
  }
}

void Model::embed_backward(Slot& sl) {
  const Unit& u = units_[0];
  const Tensor dout = resid(sl.dresid);
  const Tensor tok = sl.tokens.view(0, {B_, T_});
  auto grad = [&](const char* name) {
    const ParamSpec* p = find_param(name);
    return u.g.view(p->offset, p->shape);
  };
  const Tensor dwte = grad(cfg_.is_llama() ? "model.embed_tokens.weight" : "transformer.wte.weight");
  Tensor dwpe;
  if (!cfg_.is_llama()) dwpe = grad("transformer.wpe.weight");
  const int32_t* pos = positions_.data();
  if (tp_.shard().size == 1) {
    embedding_backward(dwte, dwpe.defined() && cp_.shard().size == 1 ? &dwpe : nullptr, dout, tok);
    if (dwpe.defined() && cp_.shard().size > 1) position_backward(dwpe, dout, pos);
    return;
  }
  if (dims_.seq_split == 1) {
    embedding_shard_backward(dwte, dout, tok, dims_.vocab_begin, dims_.vocab_valid, cfg_.vocab_size);
    if (dwpe.defined()) position_backward(dwpe, dout, pos);
    return;
  }
  // sequence parallel: the reduce-scatter's backward gathers every rank's positions
  const int64_t C = cfg_.d_model, Tl = dout.dim(1);
  const Tensor full = scratch_->seq.view(0, {B_, T_, C});
  tp_.gather_sequence(full, dout);
  embedding_shard_backward(dwte, full, tok, dims_.vocab_begin, dims_.vocab_valid, cfg_.vocab_size);
  if (!dwpe.defined()) return;
  // this rank's positions' rows of the position gradient, gathered from every rank
  const Tensor mine = scratch_->local.view(0, {1, Tl, C}), rows = scratch_->seq.view(0, {1, T_, C});
  mine.zero_();
  position_backward(mine.reshape({Tl, C}), dout);
  tp_.gather_sequence(rows, mine);
  position_backward(dwpe, rows, pos);
}

// The output head's weight: lm_head.weight, or the token embedding when tied.
static const ParamSpec& head_spec(const Model& m, int* unit) {
  const ModelConfig& c = m.config();
  const char* name = !c.tied() ? "lm_head.weight" : c.is_llama() ? "model.embed_tokens.weight" : "transformer.wte.weight";
  const ParamSpec* p = m.find_param(name, unit);
  return *p;
}

void Model::final_forward(Slot& sl, const Tensor& x) {
  const Unit& u = units_.back();
  const Tensor lnf = sl.lnf.view(0, {B_, T_, cfg_.d_model});
  const Tensor mean = sl.lnf_mean.view(0, {B_, x.dim(1)}), rstd = sl.lnf_rstd.view(0, {B_, x.dim(1)});
  const Tensor local = dims_.seq_split > 1 ? scratch_->local.view(0, x.shape()) : Tensor();
  if (!cfg_.is_llama()) norm_forward(env(), lnf, mean, rstd, x, u.param("ln_f.weight"), u.param("ln_f.bias"), local);
  else norm_forward(env(), lnf, mean, rstd, x, u.param("model.norm.weight"), Tensor(), local);
  int hu = 0;
  const ParamSpec& hp = head_spec(*this, &hu);
  linear_forward(sl.logits.view(0, {B_, T_, dims_.V}), lnf, units_[hu].matrix_view(hp.offset, hp.shape), nullptr);
}

Tensor Model::forward_cached(const int32_t* tokens, int n, KvCache& cache) {
  MT_CHECK(tp_.shard().size == 1 && cp_.shard().size == 1 && chunks_.size() == 1 && chunks_[0].spec.embed &&
               chunks_[0].spec.head && cfg_.n_layer == chunks_[0].spec.end_layer && !recompute_.any() &&
               cfg_.fused_attention() && !cfg_.mixed_precision() && !hooks_,
           "internal: a cached forward runs the whole model on one rank in fp32, with fused attention and no "
           "recomputation or hooks");
  const int B = cache.batch();
  MT_CHECK(cache.capacity() == cfg_.seq_len && B <= micro_batch_, "internal: a key/value cache of another model");
  MT_CHECK(n >= 1 && n <= cfg_.seq_len - cache.length(), "internal: " << n << " new tokens after the cache's "
                                                                      << cache.length() << " exceed model.seq_len = "
                                                                      << cfg_.seq_len);
  Slot& sl = slot(0, 0);
  copy_ids(sl.tokens, tokens, int64_t{B} * n, 0, cfg_.vocab_size, "token");
  cache.begin(n);
  B_ = sl.B = B, T_ = sl.T = n;
  sl.has_targets = false;
  std::vector<int32_t> pos(n);  // the new tokens' positions
  for (int t = 0; t < n; ++t) pos[t] = cache.length() + t;
  const int64_t C = cfg_.d_model;
  const Unit& e = units_[0];
  const Tensor x0 = resid(sl.resid.front());  // [B, n, C]
  embedding_forward(x0, sl.tokens.view(0, {B, n}), e.param(cfg_.is_llama() ? "embed_tokens.weight" : "wte.weight"),
                    nullptr);
  if (!cfg_.is_llama()) position_forward(x0, e.param("wpe.weight"), pos.data());
  // the blocks as forward runs them, their attention over the cache at the new positions
  const BlockEnv env{cfg_, dims_, tp_, *scratch_, cache, pos.data()};
  for (int l = 0; l < cfg_.n_layer; ++l)
    block_forward(env, units_[l + 1], *sl.acts[l], resid(sl.resid[l]), resid(sl.resid[l + 1]), B, n);
  cache.end();
  // the final norm and the head on each sequence's last token only, gathered into x [B, 1, C]
  // (dresid's room: no backward follows); logits() is then these rows
  const Tensor x = sl.dresid.view(0, {B, 1, C});
  for (int64_t b = 0; b < B; ++b)
    x.view(b * C, {1, 1, C}).copy_from(sl.resid.back().view((b * n + n - 1) * C, {1, 1, C}));
  T_ = sl.T = 1;
  final_forward(sl, x);
  return sl.logits.view(0, {B, dims_.V});
}

// The head's weight gradient from the loss gradient (the logits' buffer) and the head's input.
void Model::head_backward_weight(Slot& sl) {
  int hu = 0;
  const ParamSpec& hp = head_spec(*this, &hu);
  linear_backward_weight(units_[hu].g.view(hp.offset, hp.shape), nullptr, sl.logits.view(0, {B_, T_, dims_.V}),
                         sl.lnf.view(0, {B_, T_, cfg_.d_model}));
}

// The loss's and the final norm's backward (and the head's weight gradient with_weight):
// d(the last block's output) into the slot's dresid.
void Model::final_backward(Slot& sl, float scale, bool with_weight) {
  Unit& u = units_.back();
  const int B = B_, T = T_, C = cfg_.d_model;
  const Tensor x = resid(sl.resid.back());
  const Tensor logits = sl.logits.view(0, {B, T, dims_.V}), lse = sl.lse.view(0, {B, T});
  const Tensor targets = sl.targets.view(0, {B, T}), lnf = sl.lnf.view(0, {B, T, C});
  int hu = 0;
  const ParamSpec& hp = head_spec(*this, &hu);
  const Tensor dln = scratch_->dln.view(0, {B, T, C}), head = units_[hu].matrix_view(hp.offset, hp.shape);
  const Tensor head_g = with_weight ? units_[hu].g.view(hp.offset, hp.shape) : Tensor();
  const int64_t vb = dims_.vocab_begin, vv = dims_.vocab_valid;
  // With the head's weight gradient: on the GPU under bf16/fp16 the loss's gradient goes
  // straight to 16 bits for both products; else it overwrites the logits in place (where the
  // deferred weight half reads it), and both products take it in one call.
  if (!with_weight || !cross_entropy_head_backward(dln, head_g, logits, lse, targets, scale, vb, vv, lnf, head)) {
    cross_entropy_backward_shard(logits, logits, lse, targets, scale, vb, vv);
    if (with_weight) linear_backward(dln, head_g, nullptr, logits, lnf, head);
    else linear_backward_input(dln, logits, head, false);
  }
  const Tensor dresid = resid(sl.dresid);
  dresid.zero_();
  auto grad = [&](const char* name) {
    const ParamSpec* p = find_param(name);
    return u.g.view(p->offset, p->shape);
  };
  Tensor dw = grad(cfg_.is_llama() ? "model.norm.weight" : "transformer.ln_f.weight"), db;
  if (!cfg_.is_llama()) db = grad("transformer.ln_f.bias");
  const Tensor w = u.param(cfg_.is_llama() ? "model.norm.weight" : "ln_f.weight");
  const Tensor mean = sl.lnf_mean.view(0, {B, x.dim(1)}), rstd = sl.lnf_rstd.view(0, {B, x.dim(1)});
  // The head is column-parallel over the vocabulary: its input gradient is summed over tp.
  // Under sequence parallelism the norm sees this rank's positions: its weight (and bias)
  // gradients are summed over tp, from a workspace so that accumulation does not repeat it.
  if (dims_.seq_split == 1) return norm_backward(env(), dresid, dw, db, dln, x, w, mean, rstd, Tensor());
  Tensor gw = dw, gb = db;
  PositionShardGrads shard_grads(scratch_->rep, {&gw, &gb});
  norm_backward(env(), dresid, gw, gb, dln, x, w, mean, rstd, scratch_->local.view(0, x.shape()));
  shard_grads.finish(tp_);
}

}  // namespace mt
