// The loss-spike and NaN guard (training.skip_spikes = Z).
//
// A step whose loss or gradient norm lies more than Z standard deviations above the mean of
// the last kWindow applied steps, or is not finite, is skipped: no update, and its values do
// not enter the statistics. Nothing is judged before kMinHistory steps have been applied
// (the first steps' values move too fast to be a baseline); the deviation is taken as at
// least a thousandth of the mean. After training.max_skips
// skipped steps in a row the run stops: a model that keeps spiking needs a lower learning
// rate, not more skipping.
//
// The trainer calls check() with values that are the same on every rank (the loss summed
// over the data and pipeline ranks, the global gradient norm), and then makes the ranks
// agree on the verdict with one reduction, so a rank whose view differed cannot update
// alone.
//
//   SpikeGuard guard(c.training.skip_spikes, c.training.max_skips);
//   if (std::string why = guard.check(loss, norm); !why.empty()) { skip the step; }
//   else { update; guard.applied(loss, norm); }
//
// Checkpoints carry state() (the window's values and the skips in a row) and a resumed run
// restore()s it, so that it judges every later step exactly as the uninterrupted run does.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <string>
#include <vector>

namespace mt {

class SpikeGuard {
 public:
  static constexpr int kWindow = 100;     // applied steps the mean and deviation are taken over
  static constexpr int kMinHistory = 10;  // applied steps before anything is judged

  // What a checkpoint keeps: the applied steps' losses and gradient norms in the window,
  // oldest first, and the skips in a row. The values are finite (a non-finite one is always
  // skipped), so they survive a JSON round trip exactly.
  struct State {
    std::vector<double> loss, norm;
    int skips_in_a_row = 0;
  };

  SpikeGuard(double z, int max_skips) : z_(z), max_skips_(max_skips) {}

  bool enabled() const { return z_ > 0; }
  int skips_in_a_row() const { return in_a_row_; }

  // Why this step is a spike ("" when it is not): a non-finite value, or the first of loss
  // and gradient norm more than Z deviations above its window's mean.
  std::string check(double loss, double norm) const {
    if (!enabled()) return "";
    if (!std::isfinite(loss)) return "the loss is " + std::to_string(loss);
    if (!std::isfinite(norm)) return "the gradient norm is " + std::to_string(norm);
    if (static_cast<int>(loss_.size()) < kMinHistory) return "";
    if (std::string why = judge("loss", loss, loss_); !why.empty()) return why;
    return judge("gradient norm", norm, norm_);
  }
  // After the verdict the ranks agreed on: counts a skip, or takes the applied step's values.
  void skipped() { ++in_a_row_; }
  void applied(double loss, double norm) {
    in_a_row_ = 0;
    loss_.push_back(loss);
    norm_.push_back(norm);
    if (static_cast<int>(loss_.size()) > kWindow) loss_.pop_front(), norm_.pop_front();
  }
  bool too_many() const { return max_skips_ > 0 && in_a_row_ >= max_skips_; }

  State state() const { return {{loss_.begin(), loss_.end()}, {norm_.begin(), norm_.end()}, in_a_row_}; }
  // A saved state; of the values, as applied() does, the newest kWindow stay.
  void restore(const State& s) {
    const size_t n = std::min({s.loss.size(), s.norm.size(), size_t{kWindow}});
    loss_.assign(s.loss.end() - n, s.loss.end());
    norm_.assign(s.norm.end() - n, s.norm.end());
    in_a_row_ = s.skips_in_a_row;
  }

 private:
  std::string judge(const char* what, double x, const std::deque<double>& past) const {
    double mean = 0, var = 0;
    for (double v : past) mean += v;
    mean /= past.size();
    for (double v : past) var += (v - mean) * (v - mean);
    // At least a thousandth of the mean: a flat history's rounding noise is no baseline.
    const double sd = std::max(std::sqrt(var / past.size()), 1e-3 * std::fabs(mean));
    if (x <= mean + z_ * sd) return "";
    char buf[200];
    std::snprintf(buf, sizeof buf, "the %s %.6g is %.1f standard deviations above the mean of the last %zu steps "
                  "(%.6g +- %.3g)", what, x, (x - mean) / sd, past.size(), mean, sd);
    return buf;
  }

  double z_;
  int max_skips_;
  int in_a_row_ = 0;
  std::deque<double> loss_, norm_;  // the applied steps' values, newest last
};

}  // namespace mt
