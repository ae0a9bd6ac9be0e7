// Softmax cross-entropy over the vocabulary. Forward keeps lse per row so backward is a
// single streaming pass: dlogits = exp(logits - lse) * scale, minus scale at the target.
// Each row is handled by one thread with a fixed reduction order (detail.h lanes), and the
// loss total is summed in double in row order: deterministic for any thread count.
#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {

// Sum of exp(row[i] - m) over n elements, in kLanes partial sums added in a fixed order.
float exp_sum(const float* row, int64_t n, float m) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += exp_f32(row[i + j] - m);
  for (int j = 0; j < kLanes && i < n; ++i, ++j) acc[j] += exp_f32(row[i] - m);
  return reduce_lanes(acc);
}

void check_ce(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t& N, int64_t& V,
              const char* op) {
  check_f32(logits, op);
  check_i32(targets, op);
  check_f32(lse, op);
  MT_CHECK(logits.ndim() >= 1 && logits.dim(-1) > 0, op << ": logits must be [N, V] with V > 0, got "
                                                          << shape_str(logits.shape()));
  V = logits.dim(-1);
  N = logits.numel() / V;
  MT_CHECK(targets.numel() == N, op << ": targets has " << targets.numel() << " elements, logits "
                                    << shape_str(logits.shape()) << " has " << N << " rows");
  check_numel(lse, N, op);
  const int32_t* tp = targets.i32();
  int64_t bad = -1;
  for (int64_t n = 0; n < N; ++n)
    if (tp[n] < -1 || tp[n] >= V) {
      bad = n;
      break;
    }
  MT_CHECK(bad < 0, op << ": target " << tp[bad] << " at row " << bad << " is outside [0, " << V
                       << ") (use -1 to ignore a position)");
}
}  // namespace

// losses[N] = lse - logits[n, target] (0 where target == -1); lse[N] saved. Returns the sum.
double cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets) {
  ProfileScope profile_scope("cross_entropy");
#if MESHTRAIN_CUDA
  if (logits.device() == Device::cuda) return cuda::cross_entropy_forward(losses, lse, logits, targets);
#endif
  int64_t N, V;
  check_ce(logits, targets, lse, N, V, "cross_entropy_forward: logits/targets/lse");
  check_f32(losses, "cross_entropy_forward: losses");
  check_numel(losses, N, "cross_entropy_forward: losses");
  const float* lp = logits.f32();
  const int32_t* tp = targets.i32();
  float* lsep = lse.f32();
  float* lossp = losses.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    const float m = max_f32(row, V);
    // the row (V floats) stays in L2 between the max pass and this one
    const float l = m + std::log(exp_sum(row, V, m));
    lsep[n] = l;
    lossp[n] = tp[n] < 0 ? 0.0f : l - row[tp[n]];
  }
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) total += lossp[n];
  return total;
}

// dlogits[N, V] = (softmax(logits) - onehot(target)) * scale; may alias logits.
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            float scale) {
  ProfileScope profile_scope("cross_entropy_backward");
  MT_ON_CUDA(dlogits, cross_entropy_backward(dlogits, logits, lse, targets, scale));
  int64_t N, V;
  check_ce(logits, targets, lse, N, V, "cross_entropy_backward: logits/targets/lse");
  cross_entropy_backward_shard(dlogits, logits, lse, targets, scale, 0, V);
}

namespace {
// Checks a vocabulary shard's operands: logits [N, Vl], `valid` <= Vl, N-element row
// tensors (f32) and targets (i32, when given); returns N and Vl.
void check_shard(const Tensor& logits, const Tensor* targets, std::initializer_list<const Tensor*> rows,
                 int64_t valid, int64_t& N, int64_t& V, const char* op) {
  check_f32(logits, op);
  MT_CHECK(logits.ndim() >= 1 && logits.dim(-1) > 0, op << ": logits must be [N, V], got " << shape_str(logits.shape()));
  V = logits.dim(-1);
  N = logits.numel() / V;
  MT_CHECK(valid >= 0 && valid <= V, op << ": " << valid << " valid columns of " << V);
  if (targets) {
    check_i32(*targets, op);
    check_numel(*targets, N, op);
  }
  for (const Tensor* t : rows) {
    check_f32(*t, op);
    check_numel(*t, N, op);
  }
}
}  // namespace

void cross_entropy_row_max(const Tensor& row_max, const Tensor& logits, int64_t valid) {
  ProfileScope profile_scope("cross_entropy");
  MT_ON_CUDA(row_max, cross_entropy_row_max(row_max, logits, valid));
  int64_t N = 0, V = 0;
  check_shard(logits, nullptr, {&row_max}, valid, N, V, "cross_entropy_row_max");
  const float* lp = logits.f32();
  float* mp = row_max.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) mp[n] = valid > 0 ? max_f32(lp + n * V, valid) : -INFINITY;
}

void cross_entropy_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, int64_t begin, int64_t valid, const Tensor& row_max) {
  ProfileScope profile_scope("cross_entropy");
  MT_ON_CUDA(sum_exp, cross_entropy_row_stats(sum_exp, target_logit, logits, targets, begin, valid, row_max));
  int64_t N = 0, V = 0;
  check_shard(logits, &targets, {&sum_exp, &target_logit, &row_max}, valid, N, V, "cross_entropy_row_stats");
  const float* lp = logits.f32();
  const int32_t* tp = targets.i32();
  const float* mp = row_max.f32();
  float* sp = sum_exp.f32();
  float* tl = target_logit.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    sp[n] = exp_sum(row, valid, mp[n]);
    const int64_t t = int64_t{tp[n]} - begin;
    tl[n] = tp[n] >= 0 && t >= 0 && t < valid ? row[t] : 0.0f;
  }
}

double cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sum_exp,
                            const Tensor& target_logit, const Tensor& targets) {
  ProfileScope profile_scope("cross_entropy");
#if MESHTRAIN_CUDA
  if (losses.device() == Device::cuda)
    return cuda::cross_entropy_finish(losses, lse, row_max, sum_exp, target_logit, targets);
#endif
  const int64_t N = losses.numel();
  for (const Tensor* t : {&lse, &row_max, &sum_exp, &target_logit}) check_numel(*t, N, "cross_entropy_finish");
  check_numel(targets, N, "cross_entropy_finish: targets");
  const int32_t* tp = targets.i32();
  float* lossp = losses.f32();
  float* lsep = lse.f32();
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    lsep[n] = row_max.f32()[n] + std::log(sum_exp.f32()[n]);
    lossp[n] = tp[n] < 0 ? 0.0f : lsep[n] - target_logit.f32()[n];
    total += lossp[n];
  }
  return total;
}

void cross_entropy_first_max(const Tensor& first, const Tensor& logits, const Tensor& row_max, int64_t begin,
                             int64_t valid) {
  ProfileScope profile_scope("cross_entropy");
  MT_ON_CUDA(first, cross_entropy_first_max(first, logits, row_max, begin, valid));
  int64_t N = 0, V = 0;
  check_shard(logits, nullptr, {&first, &row_max}, valid, N, V, "cross_entropy_first_max");
  const float* lp = logits.f32();
  const float* mp = row_max.f32();
  float* fp = first.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    const int64_t at = std::find(row, row + valid, mp[n]) - row;
    fp[n] = at < valid ? -static_cast<float>(begin + at) : -INFINITY;
  }
}

void cross_entropy_backward_shard(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                                  const Tensor& targets, float scale, int64_t begin, int64_t valid) {
  ProfileScope profile_scope("cross_entropy_backward");
  MT_ON_CUDA(dlogits, cross_entropy_backward_shard(dlogits, logits, lse, targets, scale, begin, valid));
  int64_t N = 0, V = 0;
  check_shard(logits, &targets, {&lse}, valid, N, V, "cross_entropy_backward");
  check_f32(dlogits, "cross_entropy_backward: dlogits");
  check_numel(dlogits, N * V, "cross_entropy_backward: dlogits (must match logits)");
  const float* lp = logits.f32();
  const int32_t* tp = targets.i32();
  const float* lsep = lse.f32();
  float* dp = dlogits.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    float* d = dp + n * V;
    const int32_t t = tp[n];
    if (t < 0) {
      for (int64_t i = 0; i < V; ++i) d[i] = 0.0f;
      continue;
    }
    const float l = lsep[n];
    // Each element is read before it is written, so d == row (in place) is fine; ivdep
    // keeps GCC from falling back to a scalar loop when it sees the overlap at run time.
#pragma GCC ivdep
    for (int64_t i = 0; i < valid; ++i) d[i] = exp_f32(row[i] - l) * scale;
    for (int64_t i = valid; i < V; ++i) d[i] = 0.0f;  // padding
    if (t - begin >= 0 && t - begin < valid) d[t - begin] -= scale;
  }
}

bool cross_entropy_head_backward(const Tensor& dx, const Tensor& dw, const Tensor& logits, const Tensor& lse,
                                 const Tensor& targets, float scale, int64_t begin, int64_t valid, const Tensor& x,
                                 const Tensor& w) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("cross_entropy_head_backward");
    MT_TRY_ON_CUDA(dx, cross_entropy_head_backward(dx, dw, logits, lse, targets, scale, begin, valid, x, w));
  }
  return false;
}

}  // namespace mt
