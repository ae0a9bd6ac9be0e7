// Dynamic loss scaling for fp16 training (training.precision = fp16).
//
// fp16 holds magnitudes from 6e-8 (subnormal) to 65504: small gradients flush to zero when
// a linear layer's operands are rounded. Multiplying the loss by a scale S moves them into
// range; the optimizer sees the gradients divided by S again. A step whose gradients hold an
// inf or NaN on any rank (an overflow) is skipped and S halves; after `window` clean steps in
// a row S doubles. Starts at optim.loss_scale (2^16); S never falls below 1, where an
// overflow is in the gradients themselves, not in their scaling (the trainer stops after
// training.max_skips of those in a row). Without fp16, S is 1 and nothing is ever skipped.
//
//   LossScaler scaler(precision == "fp16", cfg.loss_scale, cfg.loss_scale_window);
//   backward with scale scaler.scale() / tokens;
//   if (scaler.update(std::isfinite(global_grad_sumsq))) { unscale by 1 / S, clip, step; }
#pragma once

namespace mt {

class LossScaler {
 public:
  LossScaler(bool enabled, double initial, int window)
      : enabled_(enabled), scale_(enabled ? initial : 1.0), window_(window) {}

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int clean_steps() const { return clean_; }
  // Overflows in a row at scale 1, the last step's included: the gradients are not finite
  // unscaled.
  int floor_overflows() const { return floor_overflows_; }
  // Continues from a checkpoint's scale and clean-step count (an fp16 run resumed as fp16).
  void restore(double scale, int clean) {
    if (!enabled_) return;
    scale_ = scale;
    clean_ = clean;
  }
  // After a step's gradients are complete; finite: they hold no inf or NaN on any rank (the
  // same on every rank). Returns whether the step is applied; updates the scale.
  bool update(bool finite) {
    if (!enabled_) return true;
    if (!finite) {
      floor_overflows_ = scale_ <= 1 ? floor_overflows_ + 1 : 0;
      scale_ = scale_ / 2 < 1 ? 1 : scale_ / 2;
      clean_ = 0;
      return false;
    }
    floor_overflows_ = 0;
    if (++clean_ >= window_) {
      scale_ *= 2;
      clean_ = 0;
    }
    return true;
  }

 private:
  bool enabled_;
  double scale_;
  int window_;
  int clean_ = 0;  // clean steps since the scale last changed
  int floor_overflows_ = 0;  // overflows in a row at scale 1 (not kept in checkpoints)
};

}  // namespace mt
