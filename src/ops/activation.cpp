// Pointwise ops. Flat loops run over fixed chunks of kChunk elements (see detail.h) so the
// vectorised body / scalar tail split, and with it every bit of the result, does not depend
// on the thread count. tanh and exp are the branch-free versions from detail.h so that the
// loops vectorise.
#include "ops/activation.h"

#include <algorithm>

#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
}  // namespace

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); out may alias x.
void gelu_forward(const Tensor& out, const Tensor& x) {
  ProfileScope profile_scope("gelu");
  MT_ON_CUDA(out, gelu_forward(out, x));
  check_f32(out, "gelu_forward: out");
  check_f32(x, "gelu_forward: x");
  check_numel(out, x.numel(), "gelu_forward: out (must match x)");
  const int64_t n = x.numel();
  const float* xp = x.f32();
  float* op = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < num_chunks(n); ++k) {
    const int64_t i1 = std::min(n, (k + 1) * kChunk);
    // ivdep: out may alias x (element i is read before it is written, no loop-carried
    // dependence), so no runtime alias check falls back to a scalar loop.
#pragma GCC ivdep
    for (int64_t i = k * kChunk; i < i1; ++i) {
      const float v = xp[i];
      const float t = tanh_f32(kGeluK * (v + kGeluA * v * v * v));
      op[i] = 0.5f * v * (1.0f + t);
    }
  }
}

// dx = dout * gelu'(x); dx may alias dout (each element is read before it is written).
void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout) {
  ProfileScope profile_scope("gelu_backward");
  MT_ON_CUDA(dx, gelu_backward(dx, x, dout));
  check_f32(dx, "gelu_backward: dx");
  check_f32(x, "gelu_backward: x");
  check_f32(dout, "gelu_backward: dout");
  check_numel(dx, x.numel(), "gelu_backward: dx (must match x)");
  check_numel(dout, x.numel(), "gelu_backward: dout (must match x)");
  const int64_t n = x.numel();
  const float* xp = x.f32();
  const float* gp = dout.f32();
  float* dp = dx.f32();
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < num_chunks(n); ++k) {
    const int64_t i1 = std::min(n, (k + 1) * kChunk);
    // ivdep: dx usually aliases dout (in-place backward); see gelu_forward.
#pragma GCC ivdep
    for (int64_t i = k * kChunk; i < i1; ++i) {
      const float v = xp[i];
      const float v2 = v * v;
      const float t = tanh_f32(kGeluK * (v + kGeluA * v2 * v));
      const float sech2 = 1.0f - t * t;
      const float grad = 0.5f * (1.0f + t) + 0.5f * v * sech2 * kGeluK * (1.0f + 3.0f * kGeluA * v2);
      dp[i] = gp[i] * grad;
    }
  }
}

namespace {
void check_swiglu(const Tensor& out, const Tensor& gu, int64_t& N, int64_t& F, const char* op) {
  MT_CHECK(out.ndim() >= 1, op << ": out must be [N, F]");
  F = out.dim(-1);
  N = F ? out.numel() / F : 0;
  MT_CHECK(gu.ndim() >= 1 && gu.dim(-1) == 2 * F && gu.numel() == 2 * N * F,
           op << ": gu must be [N, 2F] = [" << N << ", " << 2 * F << "] for out " << shape_str(out.shape()) << ", got "
              << shape_str(gu.shape()));
}
}  // namespace

// out[N, F] = silu(gate) * up, gate = gu[:, :F], up = gu[:, F:]
void swiglu_forward(const Tensor& out, const Tensor& gu) {
  ProfileScope profile_scope("swiglu");
  MT_ON_CUDA(out, swiglu_forward(out, gu));
  check_f32(out, "swiglu_forward: out");
  check_f32(gu, "swiglu_forward: gu");
  int64_t N, F;
  check_swiglu(out, gu, N, F, "swiglu_forward");
  const float* gup = gu.f32();
  float* op = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gup + n * 2 * F;
    const float* u = g + F;
    float* o = op + n * F;
#pragma GCC ivdep
    for (int64_t f = 0; f < F; ++f) {
      const float sig = 1.0f / (1.0f + exp_f32(-g[f]));
      o[f] = g[f] * sig * u[f];
    }
  }
}

// dgate = dout * up * sig (1 + gate (1 - sig)),  dup = dout * silu(gate)   (overwrites dgu;
// dgu may alias gu)
void swiglu_backward(const Tensor& dgu, const Tensor& gu, const Tensor& dout) {
  ProfileScope profile_scope("swiglu_backward");
  MT_ON_CUDA(dgu, swiglu_backward(dgu, gu, dout));
  check_f32(dgu, "swiglu_backward: dgu");
  check_f32(gu, "swiglu_backward: gu");
  check_f32(dout, "swiglu_backward: dout");
  int64_t N, F;
  check_swiglu(dout, gu, N, F, "swiglu_backward");
  check_numel(dgu, gu.numel(), "swiglu_backward: dgu (must match gu)");
  const float* gup = gu.f32();
  const float* dop = dout.f32();
  float* dgp = dgu.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gup + n * 2 * F;
    const float* u = g + F;
    const float* d = dop + n * F;
    float* dg = dgp + n * 2 * F;
    float* du = dg + F;
    // ivdep: dgu may alias gu (each element is read before it is written).
#pragma GCC ivdep
    for (int64_t f = 0; f < F; ++f) {
      const float sig = 1.0f / (1.0f + exp_f32(-g[f]));
      const float silu = g[f] * sig;
      dg[f] = d[f] * u[f] * sig * (1.0f + g[f] * (1.0f - sig));
      du[f] = d[f] * silu;
    }
  }
}

// a += b
void add_inplace(const Tensor& a, const Tensor& b) {
  ProfileScope profile_scope("add");
  MT_ON_CUDA(a, add_inplace(a, b));
  check_f32(a, "add_inplace: a");
  check_f32(b, "add_inplace: b");
  check_numel(b, a.numel(), "add_inplace: b (must match a)");
  const int64_t n = a.numel();
  float* ap = a.f32();
  const float* bp = b.f32();
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < num_chunks(n); ++k) {
    const int64_t i1 = std::min(n, (k + 1) * kChunk);
#pragma GCC ivdep
    for (int64_t i = k * kChunk; i < i1; ++i) ap[i] += bp[i];
  }
}

void add_bias(const Tensor& y, const Tensor& b) {
  ProfileScope profile_scope("add_bias");
  MT_ON_CUDA(y, add_bias(y, b));
  check_f32(y, "add_bias: y");
  check_f32(b, "add_bias: b");
  const int64_t O = b.numel();
  MT_CHECK(O > 0 && y.numel() % O == 0, "add_bias: y " << shape_str(y.shape()) << " has no rows of " << O);
  const int64_t N = y.numel() / O;
  float* yp = y.f32();
  const float* bp = b.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) yp[n * O + o] += bp[o];
}

}  // namespace mt
