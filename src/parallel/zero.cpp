#include "parallel/zero.h"

#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace mt {

ZeRO::ZeRO(Model& model, Communicator& dp, Allocator& alloc, const ParallelConfig& cfg, const Fill& fill)
    : model_(model), dp_(dp), alloc_(alloc), cfg_(cfg), stage_(cfg.zero), S_(cfg.shard_group), pipelined_(cfg.pp > 1) {
  MT_CHECK(stage_ >= 1 && stage_ <= 3, "internal: ZeRO stage " << stage_);
  MT_CHECK(S_ >= 1 && dp.size() % S_ == 0, "parallel.shard_group = " << S_ << " does not divide dp = " << dp.size());
  const int d = dp.rank();
  shard_ = dp.split(d / S_, d % S_, "shard");
  replicate_ = dp.split(d % S_, d / S_, "replicate");
  k_ = shard_->rank();
  over_replicas_ = replicate_->size() > 1 && cfg.grad_compression != "none";
  // parallel.hierarchical: the gradients' reduce-scatters by node (reduce_scatter_hierarchical).
  MT_CHECK(!cfg.hierarchical || S_ == dp.size(), "internal: hierarchical ZeRO with shard groups of " << S_
                                                   << " of " << dp.size() << " (the configuration refuses it)");
  // Nodes of L consecutive data ranks (parallel.ranks_per_node), for the hierarchical
  // reduce-scatter and the count of bytes between nodes. A shard group of whole nodes has
  // each replica of a shard on another node; shard groups inside a node have L / S
  // consecutive replicas there (the configuration refuses other splits).
  if (const int L = dp.ranks_per_node(); L > 0) {
    MT_CHECK(S_ % L == 0 || L % S_ == 0, "internal: shard groups of " << S_ << " in nodes of " << L);
    shard_->set_ranks_per_node(std::min(S_, L));
    replicate_->set_ranks_per_node(S_ % L == 0 ? 1 : L / S_);
  }
  wd_ = working_dtype(model.config());
  gd_ = grad_dtype(model.config());
  // parallel.grad_comm_dtype: fp32 gradients reduced in 16 bits (the configuration allows a
  // 16-bit grad_comm_dtype over 16-bit gradients only in their own dtype, and no compression)
  const std::string& comm = cfg.grad_comm_dtype;
  cd_ = gd_ == DType::f32 && comm != "fp32" && dp.size() > 1 ? (comm == "bf16" ? DType::bf16 : DType::f16) : gd_;
  const bool mixed = wd_ != DType::f32;
  auto& units = model.units();
  st_.resize(units.size());
  std::vector<ParamSlice> ranges;
  int64_t wide_numel = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    UnitState& s = st_[u];
    Unit& unit = units[u];
    MT_CHECK(!unit.w.defined() && !unit.g.defined(), "internal: ZeRO needs a model made with allocate_state=false");
    s.n = unit.numel;
    s.chunk = (s.n + S_ - 1) / S_;
    const int64_t padded = s.chunk * S_, b = own_begin(static_cast<int>(u)), e = own_end(static_cast<int>(u));
    if (stage_ <= 2) {  // full parameters, padded so every chunk has c elements
      s.full_w = Tensor::zeros({padded}, wd_, alloc, MemTag::params);
      unit.w = s.full_w.view(0, {s.n});
      if (!mixed) ranges.push_back({static_cast<int>(u), 0, s.n, s.full_w.f32()});
    } else {  // only this rank's chunk; gathered when a forward or backward needs it
      s.shard_w = Tensor::zeros({s.chunk}, wd_, alloc, MemTag::params);
      if (!mixed) ranges.push_back({static_cast<int>(u), b, e, s.shard_w.f32()});
    }
    if (mixed) {  // the fp32 master of this rank's chunk, counted with the optimizer's state
      s.master = Tensor::zeros({s.chunk}, DType::f32, alloc, MemTag::optim);
      ranges.push_back({static_cast<int>(u), b, e, s.master.f32()});
    }
    if (stage_ == 1) {
      s.full_g = Tensor::zeros({padded}, gd_, alloc, MemTag::grads);
      unit.g = s.full_g.view(0, {s.n});
      if (cd_ != gd_) s.sent = Tensor::zeros({padded}, cd_, alloc, MemTag::comm);  // its 16-bit copy
    } else {  // the whole gradient exists only during the unit's backward
      s.shard_g = Tensor::zeros({s.chunk}, gd_, alloc, MemTag::grads);
    }
    make_compression(static_cast<int>(u));
    // 16-bit gradients, and gradients on the GPU, are compressed widened in host memory: one
    // fp32 scratch as large as the largest tensor a compression runs on (a unit's padded
    // gradient, or under HYBRID_SHARD a chunk)
    if ((s.int8 || s.psgd) && (gd_ != DType::f32 || alloc.device() != Device::cpu))
      wide_numel = std::max(wide_numel, over_replicas_ ? s.chunk : padded);
  }
  if (wide_numel > 0) wide_ = Tensor::empty({wide_numel}, DType::f32, compression_alloc(dp, alloc), MemTag::comm);
  fill(ranges);
  if (mixed) after_step();  // the working copies from the masters (stages 1-2: gathered)
}

// parallel.grad_compression. One shard group: the unit's reduction over it, of its whole
// gradient (int8's reduce-scatter, with error feedback at stage 1 only; PowerSGD's
// all-reduces of factors, with its full-size residual). HYBRID_SHARD: the all-reduce of
// this rank's chunk over the replicas of its shard, with error feedback on the chunk.
void ZeRO::make_compression(int u) {
  UnitState& s = st_[u];
  const Unit& unit = model_.units()[u];
  const std::string& kind = cfg_.grad_compression;
  if (kind == "none" || s.n == 0) return;
  const int rank = cfg_.powersgd_rank;
  Allocator& host = compression_alloc(*shard_, alloc_);  // the state in host memory (the model maybe on the GPU)
  if (over_replicas_) {
    const int64_t b = own_begin(u), len = own_end(u) - b;
    if (len == 0) return;  // a chunk of padding only: nothing to send
    if (kind == "int8") s.int8 = std::make_unique<Int8Reduction>(len, *replicate_, host);
    else s.psgd = std::make_unique<PowerSGDReduction>(len, psgd_matrices(unit.params, b, b + len), rank, *replicate_, host);
    return;
  }
  if (S_ == 1) return;
  if (kind == "int8")
    s.int8 = std::make_unique<Int8Reduction>(s.n, *shard_, host, Int8Reduction::Mode::reduce_scatter, stage_ == 1);
  else
    s.psgd = std::make_unique<PowerSGDReduction>(s.n, psgd_matrices(unit.params, 0, s.n), rank, *shard_, host);
}

// The unit's compressed reduction of g (its padded gradient, or under HYBRID_SHARD its
// chunk), blocking: in place when g is fp32 in host memory, else in g widened (or copied from
// the GPU) into wide_. Returns where the result is (g, or the scratch's first g.numel() elements).
Tensor ZeRO::compressed_reduce(UnitState& s, const Tensor& g) {
  const Tensor x = g.dtype() == DType::f32 && g.device() == Device::cpu ? g : wide_.view(0, {g.numel()});
  if (x.raw() != g.raw()) x.convert_from(g);
  if (s.psgd) s.psgd->reduce(x.f32());
  else if (over_replicas_) s.int8->reduce(x.f32());
  else s.int8->reduce_scatter(x.f32());  // into chunk k; the rest is scratch
  return x;
}

ZeRO::~ZeRO() {
  for (UnitState& s : st_)
    for (WorkPtr* w : {&s.gather, &s.reduce})
      if (*w) try {
          (*w)->wait();
        } catch (...) {
        }
}

int64_t ZeRO::own_begin(int u) const { return std::min<int64_t>(k_ * st_[u].chunk, st_[u].n); }
int64_t ZeRO::own_end(int u) const { return std::min<int64_t>((k_ + 1) * st_[u].chunk, st_[u].n); }

Tensor ZeRO::own_w(int u) const {
  const int64_t b = own_begin(u), len = own_end(u) - b;
  return stage_ <= 2 ? st_[u].full_w.view(b, {len}) : st_[u].shard_w.view(0, {len});
}

// ---- stage 3: gathering and freeing parameters --------------------------------------

void ZeRO::start_gather(int u) {
  UnitState& s = st_[u];
  if (s.full_w.defined()) return;  // live or already on its way
  // Gathered copies are communication buffers: the model state proper stays 16Ψ/N.
  s.full_w = Tensor::empty({s.chunk * S_}, wd_, alloc_, MemTag::comm);
  s.gather = shard_->allgather_async(s.shard_w, s.full_w);
}

void ZeRO::ensure_gathered(int u) {
  UnitState& s = st_[u];
  start_gather(u);
  if (s.gather) {
    s.gather->wait();
    s.gather.reset();
  }
  model_.units()[u].w = s.full_w.view(0, {s.n});
}

void ZeRO::release_params(int u) {
  UnitState& s = st_[u];
  if (s.gather) {
    s.gather->wait();
    s.gather.reset();
  }
  s.full_w = Tensor();
  model_.units()[u].w = Tensor();
}

void ZeRO::before_forward(int unit) {
  if (stage_ < 3) return;
  for (int d : model_.units_used(unit)) ensure_gathered(d);
  if (cfg_.prefetch && unit + 1 < static_cast<int>(st_.size()) && model_.holds(unit + 1)) start_gather(unit + 1);
}

void ZeRO::after_forward(int unit) {
  if (stage_ < 3 || !cfg_.reshard_after_forward || pipelined_) return;
  for (int d : model_.units_used(unit)) release_params(d);
}

// ---- gradients ------------------------------------------------------------------------

void ZeRO::ensure_grad(int u) {
  UnitState& s = st_[u];
  if (s.reduce) complete_reduce(s);  // a split backward's input half may follow the last weight half's reduction
  if (s.full_g.defined()) return;
  // The unit's whole gradient lives only through its backward: a communication buffer.
  s.full_g = Tensor::zeros({s.chunk * S_}, gd_, alloc_, MemTag::comm);
  model_.units()[u].g = s.full_g.view(0, {s.n});
}

void ZeRO::before_backward(int unit) {
  if (unit == static_cast<int>(st_.size()) - 1) drain();  // the previous micro-step's reductions
  if (stage_ == 3) {
    for (int d : model_.units_used(unit)) ensure_gathered(d);
    if (cfg_.prefetch && unit > 0 && model_.holds(unit - 1)) start_gather(unit - 1);
  }
  if (stage_ >= 2)
    for (int d : model_.units_used(unit)) ensure_grad(d);
}

void ZeRO::launch_reduce(int u) {
  UnitState& s = st_[u];
  auto reduce_scatter = [&](const Tensor& in, const Tensor& out) {
    return cfg_.hierarchical ? shard_->reduce_scatter_hierarchical_async(in, out) : shard_->reduce_scatter_async(in, out);
  };
  if (stage_ == 1) {  // in place: chunk k of the full gradient (or of its 16-bit copy) receives the sum
    if (s.sent.defined()) s.sent.convert_from(s.full_g);
    const Tensor& g = s.sent.defined() ? s.sent : s.full_g;
    s.reduce = reduce_scatter(g, g.view(k_ * s.chunk, {s.chunk}));
    return;
  }
  if ((s.int8 || s.psgd) && !over_replicas_) {  // blocking: chunk k of the result, accumulated at once
    const Tensor sum = compressed_reduce(s, s.full_g);
    Tensor mine = sum.view(k_ * s.chunk, {s.chunk});
    if (mine.device() != s.shard_g.device()) {  // reduced on the host, the shard on the GPU: copied over first
      const Tensor staged = Tensor::empty({s.chunk}, DType::f32, alloc_, MemTag::comm);
      staged.copy_from(mine);
      mine = staged;
    }
    accumulate(s.shard_g, mine);  // 16-bit gradients: rounded once
    s.full_g = Tensor();
    model_.units()[u].g = Tensor();
    return;
  }
  model_.units()[u].g = Tensor();
  if (narrow_shard()) {  // the whole gradient rounded into 16 bits, the fp32 one freed at once
    s.sent = Tensor::empty({s.chunk * S_}, cd_, alloc_, MemTag::comm);
    s.sent.convert_from(s.full_g);
    s.full_g = Tensor();
  }
  s.reduced = Tensor::empty({s.chunk}, narrow_shard() ? cd_ : gd_, alloc_, MemTag::comm);
  s.reduce = reduce_scatter(narrow_shard() ? s.sent : s.full_g, s.reduced);
}

void ZeRO::after_backward(int unit) {
  if (stage_ == 1) {
    const bool compressed = (st_[unit].int8 || st_[unit].psgd) && !over_replicas_;
    if (sync_ && !compressed) launch_reduce(unit);  // compressed: in finish()
    return;
  }
  launch_reduce(unit);  // stages 2-3 reduce every micro-step: no full gradient is kept
  if (stage_ == 3 && !pipelined_) release_params(unit);
  pending_.push_back(unit);
  while (pending_.size() > kReductionsInFlight) {
    if (st_[pending_.front()].reduce) complete_reduce(st_[pending_.front()]);  // else ensure_grad completed it
    pending_.pop_front();
  }
}

void ZeRO::drain() {
  if (stage_ == 1) return;
  for (UnitState& s : st_)
    if (s.reduce) complete_reduce(s);
  pending_.clear();
}

void ZeRO::complete_reduce(UnitState& s) {
  s.reduce->wait();
  s.reduce.reset();
  accumulate(s.shard_g, s.reduced);  // on the parameters' device; 16-bit gradients: rounded once
  s.reduced = Tensor();
  s.full_g = Tensor();
  s.sent = Tensor();
}

void ZeRO::finish() {
  if (stage_ == 1) {
    for (UnitState& s : st_) {
      if (over_replicas_ || (!s.int8 && !s.psgd)) continue;
      const Tensor sum = compressed_reduce(s, s.full_g);  // chunk k as the reduce-scatter leaves it
      const Tensor mine = s.full_g.view(k_ * s.chunk, {s.chunk});
      if (sum.raw() != s.full_g.raw()) mine.convert_from(sum.view(k_ * s.chunk, {s.chunk}));  // rounded once
    }
    for (UnitState& s : st_)
      if (s.reduce) {
        s.reduce->wait();
        s.reduce.reset();
        // 16 bits: widened into chunk k (under HYBRID_SHARD after the replicas' all-reduce below)
        if (s.sent.defined() && replicate_->size() == 1)
          s.full_g.view(k_ * s.chunk, {s.chunk}).convert_from(s.sent.view(k_ * s.chunk, {s.chunk}));
      }
  } else {
    drain();
  }
  if (stage_ == 3 && pipelined_)  // gathered once for the step's micro-batches
    for (size_t u = 0; u < st_.size(); ++u) release_params(static_cast<int>(u));
  if (replicate_->size() == 1) return;
  // HYBRID_SHARD: the same shard's gradients from the other groups (compressed: the
  // chunk's elements, unit by unit, blocking).
  std::vector<WorkPtr> works;
  std::vector<std::pair<Tensor, Tensor>> widen;  // 16 bits: (the chunk, its sum in cd_)
  for (UnitState& s : st_) {
    if (s.n == 0) continue;
    const Tensor chunk = stage_ == 1 ? s.full_g.view(k_ * s.chunk, {s.chunk}) : s.shard_g;
    if (s.int8 || s.psgd) {
      const Tensor sum = compressed_reduce(s, chunk);
      if (sum.raw() != chunk.raw()) chunk.convert_from(sum);  // rounded once
    } else if (over_replicas_) {
      continue;  // a chunk of padding only
    } else if (cd_ == gd_) {
      works.push_back(replicate_->allreduce_async(chunk));
    } else {  // stage 1's 16-bit copy holds the shard group's sum already; else a [c] copy
      const Tensor t = s.sent.defined() ? s.sent.view(k_ * s.chunk, {s.chunk})
                                        : Tensor::empty({s.chunk}, cd_, alloc_, MemTag::comm);
      if (!s.sent.defined()) t.convert_from(chunk);
      works.push_back(replicate_->allreduce_async(t));
      widen.emplace_back(chunk, t);
    }
  }
  for (WorkPtr& w : works) w->wait();
  for (auto& [chunk, sum] : widen) chunk.convert_from(sum);
}

void ZeRO::zero_grad() {
  for (UnitState& s : st_) (stage_ == 1 ? s.full_g : s.shard_g).zero_();
}

// ---- optimizer, norms, checkpoints ------------------------------------------------------

std::vector<OptimSegment> ZeRO::optim_segments() {
  std::vector<OptimSegment> segs;
  for (size_t u = 0; u < st_.size(); ++u) {
    UnitState& s = st_[u];
    const int64_t b = own_begin(static_cast<int>(u)), len = own_end(static_cast<int>(u)) - b;
    OptimSegment seg;
    seg.w = s.master.defined() ? s.master.view(0, {len}) : own_w(static_cast<int>(u));
    seg.g = stage_ == 1 ? s.full_g.view(b, {len}) : s.shard_g.view(0, {len});
    for (const ParamSpec& p : model_.units()[u].params) {
      const int64_t lo = std::max(p.offset, b), hi = std::min(p.offset + p.numel(), b + len);
      if (p.decay && lo < hi) seg.decay_ranges.emplace_back(lo - b, hi - b);
      if (!p.tp_primary && lo < hi) seg.replica_ranges.emplace_back(lo - b, hi - b);
      seg.tensors.push_back(lo < hi ? OptimTensor{lo - b, hi - b, p.decay, p.tp_primary} : OptimTensor{0, 0, p.decay, p.tp_primary});
    }
    segs.push_back(std::move(seg));
  }
  return segs;
}

std::vector<double> ZeRO::grad_sumsq(const std::vector<OptimSegment>& segments) {
  return sum_over_shards(grad_sumsq_each(segments));
}

std::vector<double> ZeRO::sum_over_shards(std::vector<double> x) { return sum_doubles(*shard_, std::move(x)); }

void ZeRO::after_step() {
  for (size_t u = 0; u < st_.size(); ++u) {  // mixed precision: the working chunk = the master rounded
    if (!st_[u].master.defined()) continue;
    const Tensor w = own_w(static_cast<int>(u));
    w.convert_from(st_[u].master.view(0, {w.numel()}));
  }
  if (stage_ == 3) return;  // parameters stay sharded until the next forward gathers them
  std::vector<WorkPtr> works;
  for (UnitState& s : st_)
    if (s.n > 0) works.push_back(shard_->allgather_async(s.full_w.view(k_ * s.chunk, {s.chunk}), s.full_w));
  for (WorkPtr& w : works) w->wait();
}

void ZeRO::check_same_parameters() {
  if (stage_ == 3) {  // the replicas of each shard must agree
    uint64_t h = params_hash(nullptr, 0);
    for (UnitState& s : st_) h = params_hash(host_floats(s.shard_w).data(), s.shard_w.nbytes() / 4, h);
    check_same_hash(*replicate_, h, "parameter shards");
  } else {
    check_same_units(dp_, model_.units());
  }
  if (wd_ == DType::f32) return;
  uint64_t h = params_hash(nullptr, 0);
  for (UnitState& s : st_) h = params_hash(host_floats(s.master).data(), s.chunk, h);
  check_same_hash(*replicate_, h, "fp32 master parameter shards");
}

std::vector<ParamSlice> ZeRO::owned() {
  std::vector<ParamSlice> r;
  for (size_t u = 0; u < st_.size(); ++u) {
    const int64_t b = own_begin(static_cast<int>(u)), e = own_end(static_cast<int>(u));
    float* p = st_[u].master.defined() ? st_[u].master.f32() : own_w(static_cast<int>(u)).f32();
    r.push_back({static_cast<int>(u), b, e, p});
  }
  return r;
}

std::vector<std::pair<std::string, Tensor>> ZeRO::compression_state() {
  std::vector<std::pair<std::string, Tensor>> r;
  for (size_t u = 0; u < st_.size(); ++u)
    if (st_[u].int8 || st_[u].psgd)
      for (auto& [name, t] : st_[u].int8 ? st_[u].int8->state() : st_[u].psgd->state())
        r.emplace_back("unit" + std::to_string(u) + (st_[u].int8 ? ".int8." : ".powersgd.") + name, t);
  return r;
}

std::string ZeRO::compression() const {
  const std::string& kind = cfg_.grad_compression;
  if (kind == "none") return cd_ == gd_ ? "" : cd_ == DType::bf16 ? ", fp32 gradients reduced in bf16" : ", fp32 gradients reduced in fp16";
  if (over_replicas_) return ", " + kind + "-compressed all-reduce over the replicas (error feedback on the chunks)";
  if (kind == "powersgd")
    return std::string(", powersgd-compressed (all-reduced factors, error feedback") +
           (stage_ >= 2 ? "; full-size residual, every micro-step)" : ")");
  return stage_ == 1 ? ", int8-compressed reduce-scatter (error feedback)"
                     : ", int8-compressed reduce-scatter (no error feedback)";
}

std::string ZeRO::describe() const {
  static const char* names[] = {"", "optimizer state", "optimizer state + gradients",
                                "optimizer state + gradients + parameters"};
  char buf[256];
  std::snprintf(buf, sizeof buf, "zero: stage %d (%s sharded) over %d rank%s%s%s%s", stage_, names[stage_], S_,
                S_ > 1 ? "s" : "", replicate_->size() > 1 ? (", replicated x" + std::to_string(replicate_->size())).c_str() : "",
                stage_ != 3   ? ""
                : pipelined_ ? ", each unit gathered once per step (pipeline)"
                              : (std::string(cfg_.reshard_after_forward ? ", reshard after forward" : "") +
                                 (cfg_.prefetch ? ", prefetch" : "")).c_str(),
                compression().c_str());
  return buf;
}

}  // namespace mt
