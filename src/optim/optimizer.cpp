#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/cuda/ops.h"

namespace mt {

void OptimConfig::validate() const {
  MT_CHECK(optim_moments(name) > 0, "optim.name = \"" << name << "\" is not an optimizer; use adamw, sgd, lamb or lars");
  MT_CHECK(schedule == "constant" || schedule == "cosine" || schedule == "linear" || schedule == "step",
           "optim.schedule = \"" << schedule << "\" is not a schedule; use constant, cosine, linear or step");
  MT_CHECK(lr >= 0, "optim.lr = " << lr << " must not be negative");
  MT_CHECK(weight_decay >= 0, "optim.weight_decay = " << weight_decay << " must not be negative");
  MT_CHECK(beta1 >= 0 && beta1 < 1, "optim.beta1 = " << beta1 << " must be in [0, 1)");
  MT_CHECK(beta2 >= 0 && beta2 < 1, "optim.beta2 = " << beta2 << " must be in [0, 1)");
  MT_CHECK(eps > 0, "optim.eps = " << eps << " must be positive");
  MT_CHECK(momentum >= 0 && momentum < 1, "optim.momentum = " << momentum << " must be in [0, 1)");
  MT_CHECK(trust_coef > 0 && std::isfinite(trust_coef),
           "optim.trust_coef = " << trust_coef << " must be a positive number (LARS's trust coefficient, e.g. 0.001)");
  MT_CHECK(lr_base_batch >= 0, "optim.lr_base_batch = " << lr_base_batch
                                   << " must not be negative (0 turns the linear scaling rule off; else the global "
                                      "batch that optim.lr was tuned for)");
  MT_CHECK(grad_clip >= 0, "optim.grad_clip = " << grad_clip << " must not be negative (0 disables clipping)");
  MT_CHECK(warmup_steps >= 0, "optim.warmup_steps = " << warmup_steps << " must not be negative");
  MT_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "optim.min_lr_ratio = " << min_lr_ratio << " must be in [0, 1]");
  MT_CHECK(step_size >= 1, "optim.step_size = " << step_size << " must be at least 1");
  MT_CHECK(step_gamma > 0, "optim.step_gamma = " << step_gamma << " must be positive");
  // Above 2^32 the first steps only overflow and halve it (1e39, past fp32, skipped 110 steps).
  MT_CHECK(loss_scale >= 1 && loss_scale <= 0x1p32,
           "optim.loss_scale = " << loss_scale << " must be from 1 to 2^32 = 4294967296 (65536 is the usual start; "
                                 << "a scale the gradients overflow at is halved, one skipped step each)");
  MT_CHECK(loss_scale_window >= 1, "optim.loss_scale_window = " << loss_scale_window << " must be at least 1");
}

Optimizer::Optimizer(const OptimConfig& cfg, std::vector<OptimSegment> segments, Allocator& alloc)
    : cfg_(cfg), segments_(std::move(segments)) {
  cfg_.validate();
  const bool per_tensor = cfg_.name == "lamb" || cfg_.name == "lars";
  int64_t widest = 0;  // 16-bit gradients: the largest segment's, read through fp32 scratch
  for (const OptimSegment& s : segments_)
    if (s.g.dtype() != DType::f32) widest = std::max(widest, s.g.numel());
  if (widest > 0) scratch_ = Tensor::empty({widest}, DType::f32, alloc, MemTag::other);
  for (const OptimSegment& s : segments_) {
    m_.push_back(Tensor::zeros({s.w.numel()}, DType::f32, alloc, MemTag::optim));
    if (optim_moments(cfg_.name) == 2) v_.push_back(Tensor::zeros({s.w.numel()}, DType::f32, alloc, MemTag::optim));
    if (!per_tensor) continue;
    int64_t covered = 0;  // the nonempty tensors tile the segment
    for (const OptimTensor& t : s.tensors) {
      if (t.end <= t.begin) continue;
      MT_CHECK(t.begin == covered, "optim.name = " << cfg_.name << ": the segment's tensors do not tile it (a tensor at "
                                                   << t.begin << ", expected " << covered << ")");
      covered = t.end;
    }
    MT_CHECK(covered == s.w.numel(), "optim.name = " << cfg_.name << ": the segment's tensors cover " << covered
                                                     << " of its " << s.w.numel() << " elements");
  }
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state(int i) const {
  if (optim_moments(cfg_.name) == 2) return {{"adam_m", m_[i]}, {"adam_v", v_[i]}};
  return {{"momentum", m_[i]}};
}

int64_t Optimizer::norm_sums() const {
  if (cfg_.name != "lamb" && cfg_.name != "lars") return 0;
  int64_t n = 0;
  for (const OptimSegment& s : segments_) n += 2 * static_cast<int64_t>(s.tensors.size());
  return n;
}

namespace {

// PyTorch AdamW (single-tensor path): p *= 1 - lr wd; m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).
void adamw_range(float* p, const float* g, float* m, float* v, int64_t n, float decay_mul, float b1, float b2,
                 float one_minus_b1, float one_minus_b2, float step_size, float bc2_sqrt, float eps) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i] * decay_mul;
    float mi = m[i] * b1 + one_minus_b1 * g[i];
    float vi = v[i] * b2 + one_minus_b2 * g[i] * g[i];
    m[i] = mi;
    v[i] = vi;
    float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * (mi / denom);
  }
}

// PyTorch SGD: d = g + wd p; buf = d on the first step, else momentum buf + d; p -= lr d'
// with d' = buf (or d + momentum buf with Nesterov). LARS: d = scale (g + wd p), its local
// learning rate `scale` (1 for SGD: exact).
void sgd_range(float* p, const float* g, float* buf, int64_t n, float wd, float lr, float momentum, bool first,
               bool nesterov, float scale = 1.0f) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float d = scale * (g[i] + wd * p[i]);
    float b = first ? d : momentum * buf[i] + d;
    buf[i] = b;
    float upd = nesterov ? d + momentum * b : b;
    p[i] = p[i] - lr * upd;
  }
}

// The sum of f(i)^2 over i in [begin, end), in fixed chunks added in order: the result does
// not depend on the thread count.
template <class F>
double sumsq_of(int64_t begin, int64_t end, F f) {
  constexpr int64_t kChunk = 1 << 14;
  const int64_t nchunks = std::max<int64_t>(0, (end - begin + kChunk - 1) / kChunk);
  std::vector<double> part(nchunks, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t hi = std::min(end, begin + (c + 1) * kChunk);
    double acc = 0.0;
    for (int64_t i = begin + c * kChunk; i < hi; ++i) {
      const double x = f(i);
      acc += x * x;
    }
    part[c] = acc;
  }
  double total = 0.0;
  for (double x : part) total += x;
  return total;
}

// ||a|| / ||b|| from their sums of squares; 1 when either norm is 0.
double norm_ratio(double a2, double b2) { return a2 > 0 && b2 > 0 ? std::sqrt(a2) / std::sqrt(b2) : 1.0; }

// LAMB's constants at step t, rounded to float once (the GPU kernels take the same).
cuda::LambConsts lamb_consts(const OptimConfig& cfg, int64_t t) {
  const double bc1 = 1.0 - std::pow(cfg.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(cfg.beta2, static_cast<double>(t));
  return {static_cast<float>(cfg.beta1),        static_cast<float>(cfg.beta2),
          static_cast<float>(1.0 - cfg.beta1),  static_cast<float>(1.0 - cfg.beta2),
          static_cast<float>(1.0 / bc1),        static_cast<float>(std::sqrt(bc2)),
          static_cast<float>(cfg.eps)};
}

// LARS's local learning rate for a tensor from the sums of squares of its w and g, and the
// weight decay that goes with it (see step_lars).
double lars_scale(const OptimConfig& cfg, bool decay, double w2, double g2, double& wd) {
  const double w_norm = std::sqrt(w2), g_norm = std::sqrt(g2);
  const bool adapt = decay && w_norm > 0 && g_norm > 0;
  wd = adapt ? cfg.weight_decay : 0.0;
  return adapt ? cfg.trust_coef * w_norm / (g_norm + wd * w_norm + cfg.eps) : 1.0;
}

// f(begin, end, decay) over a segment's elements as alternating no-decay / decay ranges
// (empty ones skipped).
template <class F>
void for_each_decay_run(const OptimSegment& s, F f) {
  int64_t pos = 0;
  auto run = [&](int64_t begin, int64_t end, bool decay) {
    if (end > begin) f(begin, end, decay);
  };
  for (const auto& [b, e] : s.decay_ranges) {
    run(pos, b, false);
    run(b, e, true);
    pos = e;
  }
  run(pos, s.w.numel(), false);
}

// x *= c (f32), on x's device.
void scale_in_place(const Tensor& x, float c) {
#if MESHTRAIN_CUDA
  if (x.device() == Device::cuda) {
    if (x.numel()) cuda::scale_inplace(x, c);
    return;
  }
#endif
  float* p = x.f32();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] *= c;
}

}  // namespace

Tensor Optimizer::grad(size_t si) const {
  const Tensor& g = segments_[si].g;
  if (g.dtype() == DType::f32 && grad_scale_ == 1.0f) return g;
  if (g.numel() == 0) return Tensor::wrap(nullptr, {0}, DType::f32);  // a unit this rank holds none of
  MT_CHECK(scratch_.defined(), "internal: fp32 gradients scaled as read (clip them in place: grad_clip)");
  const Tensor out = scratch_.view(0, {g.numel()});  // the segment's gradients widened and scaled
  out.convert_from(g);
  if (grad_scale_ != 1.0f) scale_in_place(out, grad_scale_);
  return out;
}

// LAMB: Adam's moments, u = m^ / (sqrt(v^) + eps) + wd w (wd on tensors of 2+ dims only),
// w -= lr r u with the trust ratio r = ||w|| / ||u|| of the whole tensor (1 when either is 0).
// Two passes: the moments and the partial norms, then (after the norms are summed over the
// tensor's holders) the update, recomputing u from the stored moments.
void Optimizer::step_lamb(double lr, const SumFn& sum_over_holders) {
  const cuda::LambConsts c = lamb_consts(cfg_, t_);
  const float b1 = c.b1, b2 = c.b2, one_minus_b1 = c.one_minus_b1, one_minus_b2 = c.one_minus_b2;
  auto update = [c](float m, float v, float w, float wd) {
    return (m * c.inv_bc1) / (std::sqrt(v) / c.bc2_sqrt + c.eps) + wd * w;
  };
  std::vector<double> sums;  // per tensor: sum of w^2, sum of u^2 over this rank's counted elements
  for (size_t si = 0; si < segments_.size(); ++si) {
    float *p = segments_[si].w.f32(), *m = m_[si].f32(), *v = v_[si].f32();
    const float* g = grad(si).f32();
    for (const OptimTensor& t : segments_[si].tensors) {
      const float wd = t.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = t.begin; i < t.end; ++i) {
        m[i] = m[i] * b1 + one_minus_b1 * g[i];
        v[i] = v[i] * b2 + one_minus_b2 * g[i] * g[i];
      }
      sums.push_back(t.counted ? sumsq_of(t.begin, t.end, [&](int64_t i) { return p[i]; }) : 0.0);
      sums.push_back(t.counted ? sumsq_of(t.begin, t.end, [&](int64_t i) { return update(m[i], v[i], p[i], wd); }) : 0.0);
    }
  }
  if (sum_over_holders) sum_over_holders(sums);
  size_t k = 0;
  for (size_t si = 0; si < segments_.size(); ++si) {
    float *p = segments_[si].w.f32(), *m = m_[si].f32(), *v = v_[si].f32();
    for (const OptimTensor& t : segments_[si].tensors) {
      const float wd = t.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
      const float step = static_cast<float>(lr * norm_ratio(sums[k], sums[k + 1]));
      k += 2;
#pragma omp parallel for simd schedule(static)
      for (int64_t i = t.begin; i < t.end; ++i) p[i] -= step * update(m[i], v[i], p[i], wd);
    }
  }
}

// LARS (as a LARC-style gradient rescaling in front of SGD with momentum): for a tensor of
// 2+ dims with ||w|| > 0 and ||g|| > 0, d = s (g + wd w) with the local learning rate
// s = trust_coef ||w|| / (||g|| + wd ||w|| + eps); otherwise (biases, norm weights, zero
// norms) d = g. Then buf = d (first step) or momentum buf + d, and w -= lr buf (Nesterov:
// lr (d + momentum buf)).
void Optimizer::step_lars(double lr, const SumFn& sum_over_holders) {
  std::vector<double> sums;  // per tensor: sum of w^2, sum of g^2 over this rank's counted elements
  for (size_t si = 0; si < segments_.size(); ++si) {
    const OptimSegment& s = segments_[si];
    const float *p = s.w.f32(), *g = grad(si).f32();
    for (const OptimTensor& t : s.tensors) {
      sums.push_back(t.counted ? sumsq_of(t.begin, t.end, [&](int64_t i) { return p[i]; }) : 0.0);
      sums.push_back(t.counted ? sumsq_of(t.begin, t.end, [&](int64_t i) { return g[i]; }) : 0.0);
    }
  }
  if (sum_over_holders) sum_over_holders(sums);
  size_t k = 0;
  for (size_t si = 0; si < segments_.size(); ++si) {
    const OptimSegment& s = segments_[si];
    const float* g = grad(si).f32();
    for (const OptimTensor& t : s.tensors) {
      double wd = 0.0;
      const double scale = lars_scale(cfg_, t.decay, sums[k], sums[k + 1], wd);
      k += 2;
      sgd_range(s.w.f32() + t.begin, g + t.begin, m_[si].f32() + t.begin, t.end - t.begin,
                static_cast<float>(wd), static_cast<float>(lr), static_cast<float>(cfg_.momentum), t_ == 1,
                cfg_.nesterov, static_cast<float>(scale));
    }
  }
}

// Segments in GPU memory (training.device = cuda).
[[maybe_unused]] static bool on_gpu(const std::vector<OptimSegment>& segments) {
  return !segments.empty() && segments[0].w.device() == Device::cuda;
}

void Optimizer::step(double lr, const SumFn& sum_over_holders, float grad_scale) {
  ++t_;
  grad_scale_ = grad_scale;
#if MESHTRAIN_CUDA
  if (on_gpu(segments_)) return step_gpu(lr, sum_over_holders);
#endif
  if (cfg_.name == "lamb") return step_lamb(lr, sum_over_holders);
  if (cfg_.name == "lars") return step_lars(lr, sum_over_holders);
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  for (size_t si = 0; si < segments_.size(); ++si) {
    const OptimSegment& s = segments_[si];
    float* p = s.w.f32();
    const float* g = grad(si).f32();
    for_each_decay_run(s, [&](int64_t begin, int64_t end, bool decay) {
      const double wd = decay ? cfg_.weight_decay : 0.0;
      if (cfg_.name == "adamw") {
        adamw_range(p + begin, g + begin, m_[si].f32() + begin, v_[si].f32() + begin, end - begin,
                    static_cast<float>(1.0 - lr * wd), static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                    static_cast<float>(1.0 - cfg_.beta1), static_cast<float>(1.0 - cfg_.beta2),
                    static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), static_cast<float>(cfg_.eps));
      } else {
        sgd_range(p + begin, g + begin, m_[si].f32() + begin, end - begin, static_cast<float>(wd),
                  static_cast<float>(lr), static_cast<float>(cfg_.momentum), t_ == 1, cfg_.nesterov);
      }
    });
  }
}

#if MESHTRAIN_CUDA
// The same updates through the kernels of ops/cuda (loss_optim.cu), which round every
// operation as the host loops do: AdamW in one launch per segment, SGD per decay run, LAMB
// and LARS per tensor, with a segment's per-tensor sums of squares taken together (one wait).
void Optimizer::step_gpu(double lr, const SumFn& sum_over_holders) {
  auto piece = [](const Tensor& x, int64_t begin, int64_t end) { return x.view(begin, {end - begin}); };
  const float momentum = static_cast<float>(cfg_.momentum);
  if (cfg_.name == "adamw" || cfg_.name == "sgd") {
    for (size_t si = 0; si < segments_.size(); ++si) {
      const OptimSegment& s = segments_[si];
      if (s.w.numel() == 0) continue;
      const Tensor g = grad(si);
      if (cfg_.name == "adamw") {
        cuda::adamw_step(s.w, g, m_[si], v_[si], s.decay_ranges, lr, cfg_.beta1, cfg_.beta2, cfg_.eps,
                         cfg_.weight_decay, t_);
        continue;
      }
      for_each_decay_run(s, [&](int64_t begin, int64_t end, bool decay) {
        cuda::sgd_step(piece(s.w, begin, end), piece(g, begin, end), piece(m_[si], begin, end),
                       decay ? static_cast<float>(cfg_.weight_decay) : 0.0f, static_cast<float>(lr), momentum,
                       t_ == 1, cfg_.nesterov, 1.0f);
      });
    }
    return;
  }
  const bool lamb = cfg_.name == "lamb";
  const cuda::LambConsts c = lamb_consts(cfg_, t_);
  auto wd_of = [&](const OptimTensor& t) { return t.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f; };
  std::vector<double> sums;  // per tensor: sum of w^2, sum of u^2 (LAMB) or g^2 (LARS) over the counted elements
  for (size_t si = 0; si < segments_.size(); ++si) {
    const OptimSegment& s = segments_[si];
    const Tensor g = grad(si);  // widened: scratch_ until the next segment's
    std::vector<cuda::SumsqTerm> terms;  // empty where this rank holds or counts none of the tensor
    for (const OptimTensor& t : s.tensors) {
      const bool held = t.end > t.begin;
      if (held && lamb) cuda::lamb_moments(piece(g, t.begin, t.end), piece(m_[si], t.begin, t.end),
                                           piece(v_[si], t.begin, t.end), c);
      if (!held || !t.counted) {
        terms.resize(terms.size() + 2);
        continue;
      }
      const Tensor w = piece(s.w, t.begin, t.end);
      terms.push_back({w, {}, {}, 0.0f});
      if (lamb) terms.push_back({w, piece(m_[si], t.begin, t.end), piece(v_[si], t.begin, t.end), wd_of(t)});
      else terms.push_back({piece(g, t.begin, t.end), {}, {}, 0.0f});
    }
    const std::vector<double> mine = cuda::sumsq_each(terms, c);  // before the next segment's gradients widen
    sums.insert(sums.end(), mine.begin(), mine.end());
  }
  if (sum_over_holders) sum_over_holders(sums);
  size_t k = 0;
  for (size_t si = 0; si < segments_.size(); ++si) {
    const OptimSegment& s = segments_[si];
    const Tensor g = lamb ? Tensor() : grad(si);  // LARS reads it again
    for (const OptimTensor& t : s.tensors) {
      const double a2 = sums[k], b2 = sums[k + 1];
      k += 2;
      if (t.end <= t.begin) continue;
      const Tensor w = piece(s.w, t.begin, t.end), m = piece(m_[si], t.begin, t.end);
      if (lamb) {
        cuda::lamb_apply(w, m, piece(v_[si], t.begin, t.end), c, wd_of(t), static_cast<float>(lr * norm_ratio(a2, b2)));
        continue;
      }
      double wd = 0.0;
      const double scale = lars_scale(cfg_, t.decay, a2, b2, wd);
      cuda::sgd_step(w, piece(g, t.begin, t.end), m, static_cast<float>(wd), static_cast<float>(lr), momentum,
                     t_ == 1, cfg_.nesterov, static_cast<float>(scale));
    }
  }
}
#endif

double lr_scale(const OptimConfig& cfg, int64_t global_batch) {
  return cfg.lr_base_batch > 0 ? static_cast<double>(global_batch) / static_cast<double>(cfg.lr_base_batch) : 1.0;
}

int optim_moments(const std::string& name) {
  if (name == "adamw" || name == "lamb") return 2;
  if (name == "sgd" || name == "lars") return 1;
  return 0;
}

double lr_at(const OptimConfig& cfg, int64_t step, int64_t total) {
  const double lr = cfg.lr;
  if (step < cfg.warmup_steps) return lr * static_cast<double>(step + 1) / cfg.warmup_steps;
  const double min_lr = lr * cfg.min_lr_ratio;
  const int64_t span = std::max<int64_t>(1, total - cfg.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - cfg.warmup_steps) / span);
  if (cfg.schedule == "cosine") return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  if (cfg.schedule == "linear") return min_lr + (lr - min_lr) * (1.0 - progress);
  if (cfg.schedule == "step") return lr * std::pow(cfg.step_gamma, (step - cfg.warmup_steps) / cfg.step_size);
  return lr;
}

float grad_clip(const std::vector<OptimSegment>& segments, double norm, double max_norm, double unscale) {
  const double coef = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
  if (coef * unscale == 1.0) return 1.0f;
  const float c = static_cast<float>(coef * unscale);
  // 16-bit gradients are not rounded again: the optimizer applies c as it reads them.
  if (!segments.empty() && segments[0].g.dtype() != DType::f32) return c;
  for (const OptimSegment& s : segments) scale_in_place(s.g, c);
  return 1.0f;
}

}  // namespace mt
