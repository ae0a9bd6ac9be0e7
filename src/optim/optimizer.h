// Optimizers over flat parameter buffers (one segment per unit, possibly a shard of it):
// AdamW and SGD with momentum, with PyTorch's update formulas, and the layer-wise adaptive
// LAMB and LARS; global-norm clipping and learning-rate schedules.
//
// LAMB and LARS scale each model tensor's update by a trust ratio made of whole-tensor
// norms. A rank may hold only a piece of a tensor (a ZeRO shard, a tp split), so the
// optimizer sums each tensor's squares over the elements it holds and hands the vector of
// partial sums to a SumFn that the caller provides: the caller adds them over the ranks
// that hold the other pieces (the optimizer itself never communicates).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "parallel/optim_segment.h"

namespace mt {

struct OptimConfig {
  std::string name = "adamw";  // adamw | sgd | lamb | lars
  double lr = 3e-3;
  double weight_decay = 0.1;   // applied only to parameters of two or more dims
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.9;       // sgd
  bool nesterov = false;       // sgd, lars
  double trust_coef = 0.001;   // lars: the trust coefficient of the local learning rate
  int64_t lr_base_batch = 0;   // linear scaling rule: lr x global_batch / lr_base_batch (0: off)
  double grad_clip = 1.0;      // global L2 norm; 0 disables
  // training.precision = fp16: dynamic loss scaling. The loss is multiplied by the scale
  // before backward; a step whose gradients hold an inf or NaN on any rank is skipped and
  // the scale halved; after loss_scale_window clean steps in a row it doubles.
  double loss_scale = 65536;   // the starting scale (2^16)
  int loss_scale_window = 1000;
  std::string schedule = "cosine";  // constant | cosine | linear | step
  int warmup_steps = 20;
  double min_lr_ratio = 0.1;   // cosine / linear decay to lr * min_lr_ratio
  int step_size = 1000;        // step schedule: multiply by step_gamma every step_size steps
  double step_gamma = 0.1;
  void validate() const;
};

// Adds per-tensor partial sums (in place) over the ranks that hold the tensors' other
// pieces; every such rank passes a vector of the same length and order.
using SumFn = std::function<void(std::vector<double>&)>;

class Optimizer {
 public:
  Optimizer(const OptimConfig& cfg, std::vector<OptimSegment> segments, Allocator& alloc);
  // One update of every segment with learning rate lr; the step count t starts at 1.
  // LAMB and LARS call sum_over_holders once (none: this rank holds whole tensors).
  // grad_scale: a factor on the gradients as read (what grad_clip left to apply to 16-bit
  // ones; 1 for fp32 gradients, which grad_clip scales in place).
  void step(double lr, const SumFn& sum_over_holders = {}, float grad_scale = 1.0f);
  // The length of the vector step() passes to sum_over_holders (0 for AdamW and SGD).
  int64_t norm_sums() const;
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // The state tensors of segment i with their names ("adam_m", "adam_v" or "momentum").
  std::vector<std::pair<std::string, Tensor>> state(int i) const;
  const std::vector<OptimSegment>& segments() const { return segments_; }

 private:
  OptimConfig cfg_;
  std::vector<OptimSegment> segments_;
  std::vector<Tensor> m_, v_;  // adam / lamb moments, or (m_ only) sgd / lars momentum buffers
  int64_t t_ = 0;
  Tensor scratch_;           // 16-bit gradients: [largest segment] fp32 (MemTag::other), one segment at a time
  float grad_scale_ = 1.0f;  // the step's factor on the gradients as read
  // Segment si's gradients as fp32 times grad_scale_, on the segment's device: g itself (fp32,
  // factor 1), else widened and scaled into scratch_ (valid until the next call; on the GPU
  // the kernels queued before it have read the old contents by then: one stream).
  Tensor grad(size_t si) const;
  void step_lamb(double lr, const SumFn& sum_over_holders);
  void step_lars(double lr, const SumFn& sum_over_holders);
  void step_gpu(double lr, const SumFn& sum_over_holders);  // segments in GPU memory (MESHTRAIN_CUDA builds)
};

// The linear scaling rule's factor on optim.lr: global_batch / lr_base_batch, or 1 when off.
double lr_scale(const OptimConfig& cfg, int64_t global_batch);
// The moment buffers per parameter: 2 for adamw and lamb, 1 for sgd and lars.
int optim_moments(const std::string& name);

// The learning rate at optimizer step `step` (0-based) of `total` steps.
double lr_at(const OptimConfig& cfg, int64_t step, int64_t total);

// Scales every gradient by max_norm / (norm + 1e-6) when that is below 1 (clip_grad_norm_;
// max_norm 0: no clipping), and by `unscale` (1 / the loss scale: norm is the unscaled one).
// fp32 gradients are scaled in place (returns 1); 16-bit ones are left unrounded and the
// factor is returned for Optimizer::step to apply as it reads them.
float grad_clip(const std::vector<OptimSegment>& segments, double norm, double max_norm, double unscale = 1.0);

}  // namespace mt
