// LayerNorm and RMSNorm over the last dim. Rows are independent in forward; backward's
// dw/db reductions over rows go through fixed chunks of kRowChunk rows: each chunk sums its
// rows in order into its own partial, then the partials are added in chunk order. The
// chunking depends only on N, so the result is the same for any number of threads.
#include "ops/norm.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/half.h"
#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {

constexpr int64_t kRowChunk = 32;

// dst[c] += sum over chunks k (in order) of part[k * stride + c], parallel over c.
void add_chunk_partials(float* dst, const float* part, int64_t nchunk, int64_t C, int64_t stride) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    float s = 0.0f;
    for (int64_t k = 0; k < nchunk; ++k) s += part[k * stride + c];
    dst[c] += s;
  }
}

// One row of layernorm backward: dx += (dout w - mean(dout w) - xhat mean(dout w xhat)) rstd,
// and this row's dout xhat / dout added to its chunk's dw / db partials. A function with
// restrict parameters so that GCC vectorises it without alias checks (dx, dout, x, w and
// the partials are distinct buffers).
inline void layernorm_backward_row(float* __restrict d, float* __restrict pdw, float* __restrict pdb,
                                   const float* __restrict g, const float* __restrict xr,
                                   const float* __restrict w, float m, float s, int64_t C) {
  // First pass: mean(dout * w) and mean(dout * w * xhat).
  float a1[kLanes] = {}, a2[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= C; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float dn = g[i + j] * w[i + j];
      a1[j] += dn;
      a2[j] += dn * ((xr[i + j] - m) * s);
    }
  for (int j = 0; j < kLanes && i < C; ++i, ++j) {
    const float dn = g[i] * w[i];
    a1[j] += dn;
    a2[j] += dn * ((xr[i] - m) * s);
  }
  const float dn_mean = reduce_lanes(a1) / (float)C;
  const float dnx_mean = reduce_lanes(a2) / (float)C;
  // Second pass: dx and the partials.
  for (int64_t c = 0; c < C; ++c) {
    const float xh = (xr[c] - m) * s;
    d[c] += (g[c] * w[c] - dn_mean - xh * dnx_mean) * s;
    pdw[c] += g[c] * xh;
    pdb[c] += g[c];
  }
}

// One row of rmsnorm backward: dx += (dout w - xhat mean(dout w xhat)) rstd ; pdw += dout xhat.
inline void rmsnorm_backward_row(float* __restrict d, float* __restrict pdw, const float* __restrict g,
                                 const float* __restrict xr, const float* __restrict w, float s, int64_t C) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= C; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += g[i + j] * w[i + j] * (xr[i + j] * s);
  for (int j = 0; j < kLanes && i < C; ++i, ++j) acc[j] += g[i] * w[i] * (xr[i] * s);
  const float dnx_mean = reduce_lanes(acc) / (float)C;
  for (int64_t c = 0; c < C; ++c) {
    const float xh = xr[c] * s;
    d[c] += (g[c] * w[c] - xh * dnx_mean) * s;
    pdw[c] += g[c] * xh;
  }
}

void check_norm_io(const Tensor& out, const Tensor& x, const Tensor& w, int64_t& N, int64_t& C, const char* op,
                   bool out_16bit = false) {
  if (!out_16bit || (out.dtype() != DType::bf16 && out.dtype() != DType::f16)) check_f32(out, op);
  check_f32(x, op);
  check_f32(w, op);
  C = w.numel();
  MT_CHECK(C > 0, op << ": weight is empty");
  N = rows_of(x, C, op);
  check_numel(out, N * C, op);
  if (out.dtype() != DType::f32) {  // a 16-bit out in place of x would overwrite what other rows read
    const uintptr_t o = reinterpret_cast<uintptr_t>(out.raw()), xs = reinterpret_cast<uintptr_t>(x.raw());
    MT_CHECK(o + out.nbytes() <= xs || xs + x.nbytes() <= o, op << ": a 16-bit out must not overlap x");
  }
}

// The residual r for x (nullptr: none): fp32, of x's size, overlapping neither x nor out.
const float* residual_of(const Tensor* r, const Tensor& x, const Tensor& out, int64_t n, const char* op) {
  if (!r) return nullptr;
  check_f32(*r, op);
  check_numel(*r, n, op);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(r->raw()), bytes = n * sizeof(float);
  for (const Tensor* t : {&x, &out}) {
    const uintptr_t tlo = reinterpret_cast<uintptr_t>(t->raw());
    MT_CHECK(lo + bytes <= tlo || tlo + t->nbytes() <= lo, op << ": the residual must not overlap x or out");
  }
  return r->f32();
}

// Where a forward writes row n of out: out's own fp32 row, or for a 16-bit out a row of
// this thread's scratch, rounded into out by store_row.
float* out_row(const Tensor& out, int64_t n, int64_t C) {
  if (out.dtype() == DType::f32) return out.f32() + n * C;
  thread_local std::vector<float> row;
  if (row.size() < static_cast<size_t>(C)) row.resize(C);
  return row.data();
}
void store_row(const Tensor& out, int64_t n, int64_t C, const float* row) {
  if (out.dtype() == DType::f32) return;
  uint16_t* h = static_cast<uint16_t*>(out.raw()) + n * C;
  if (out.dtype() == DType::f16) return f32_to_f16_n(row, h, C);
  for (int64_t c = 0; c < C; ++c) h[c] = f32_to_bf16(row[c]);
}

// x[c] += r[c] over a row (the fused residual add; r == nullptr: nothing).
inline void add_row(float* __restrict x, const float* __restrict r, int64_t C) {
  if (r)
    for (int64_t c = 0; c < C; ++c) x[c] += r[c];
}

}  // namespace

// out[N, C] = (x - mean) * rstd * w + b ; saves mean[N], rstd[N]
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps, const Tensor* r) {
  ProfileScope profile_scope("layernorm");
  MT_ON_CUDA(out, layernorm_forward(out, mean, rstd, x, w, b, eps, r));
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "layernorm_forward: out/x/w (x's last dim must equal w's size)", true);
  check_f32(b, "layernorm_forward: b");
  check_numel(b, C, "layernorm_forward: b");
  check_f32(mean, "layernorm_forward: mean");
  check_f32(rstd, "layernorm_forward: rstd");
  check_numel(mean, N, "layernorm_forward: mean");
  check_numel(rstd, N, "layernorm_forward: rstd");
  const float* res = residual_of(r, x, out, N * C, "layernorm_forward: r");
  const float *wp = w.f32(), *bp = b.f32();
  float *xp = x.f32(), *mp = mean.f32(), *rp = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* xr = xp + n * C;
    add_row(xr, res ? res + n * C : nullptr, C);
    const float m = sum_f32(xr, C) / (float)C;
    // Two-pass variance (sum of squared deviations): no cancellation, and the row is in L1.
    float acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= C; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float d = xr[i + j] - m;
        acc[j] += d * d;
      }
    for (int j = 0; j < kLanes && i < C; ++i, ++j) {
      const float d = xr[i] - m;
      acc[j] += d * d;
    }
    const float s = 1.0f / std::sqrt(reduce_lanes(acc) / (float)C + eps);
    float* o = out_row(out, n, C);
    for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] - m) * s * wp[c] + bp[c];
    store_row(out, n, C, o);
    mp[n] = m;
    rp[n] = s;
  }
}

// dx += dL/dx ; dw += sum_n dout * xhat ; db += sum_n dout
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  ProfileScope profile_scope("layernorm_backward");
  MT_ON_CUDA(dx, layernorm_backward(dx, dw, db, dout, x, w, mean, rstd));
  int64_t N, C;
  check_norm_io(dout, x, w, N, C, "layernorm_backward: dout/x/w (x's last dim must equal w's size)");
  check_f32(dx, "layernorm_backward: dx");
  check_numel(dx, N * C, "layernorm_backward: dx");
  check_f32(dw, "layernorm_backward: dw");
  check_numel(dw, C, "layernorm_backward: dw");
  check_f32(db, "layernorm_backward: db");
  check_numel(db, C, "layernorm_backward: db");
  check_f32(mean, "layernorm_backward: mean");
  check_f32(rstd, "layernorm_backward: rstd");
  check_numel(mean, N, "layernorm_backward: mean");
  check_numel(rstd, N, "layernorm_backward: rstd");
  const float *xp = x.f32(), *wp = w.f32(), *gp = dout.f32(), *mp = mean.f32(), *rp = rstd.f32();
  float* dxp = dx.f32();
  const int64_t nchunk = (N + kRowChunk - 1) / kRowChunk;
  // Per chunk: C partials of dw, then C of db.
  std::vector<float> part(nchunk * 2 * C, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < nchunk; ++k) {
    float* pdw = part.data() + k * 2 * C;
    for (int64_t n = k * kRowChunk; n < std::min(N, (k + 1) * kRowChunk); ++n)
      layernorm_backward_row(dxp + n * C, pdw, pdw + C, gp + n * C, xp + n * C, wp, mp[n], rp[n], C);
  }
  add_chunk_partials(dw.f32(), part.data(), nchunk, C, 2 * C);
  add_chunk_partials(db.f32(), part.data() + C, nchunk, C, 2 * C);
}

// out[N, C] = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps) ; saves rstd[N]
// (the order of Hugging Face's LlamaRMSNorm: normalise in float32, then scale by w).
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                     const Tensor* r) {
  ProfileScope profile_scope("rmsnorm");
  MT_ON_CUDA(out, rmsnorm_forward(out, rstd, x, w, eps, r));
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "rmsnorm_forward: out/x/w (x's last dim must equal w's size)", true);
  check_f32(rstd, "rmsnorm_forward: rstd");
  check_numel(rstd, N, "rmsnorm_forward: rstd");
  const float* res = residual_of(r, x, out, N * C, "rmsnorm_forward: r");
  const float* wp = w.f32();
  float *xp = x.f32(), *rp = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* xr = xp + n * C;
    add_row(xr, res ? res + n * C : nullptr, C);
    const float s = 1.0f / std::sqrt(dot_f32(xr, xr, C) / (float)C + eps);
    float* o = out_row(out, n, C);
    for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] * s) * wp[c];
    store_row(out, n, C, o);
    rp[n] = s;
  }
}

// y = x r w with r = (mean(x^2) + eps)^-1/2:
//   dx += r (w dout - xhat mean(w dout xhat)),  xhat = x r ;  dw += sum_n dout xhat
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  ProfileScope profile_scope("rmsnorm_backward");
  MT_ON_CUDA(dx, rmsnorm_backward(dx, dw, dout, x, w, rstd));
  int64_t N, C;
  check_norm_io(dout, x, w, N, C, "rmsnorm_backward: dout/x/w (x's last dim must equal w's size)");
  check_f32(dx, "rmsnorm_backward: dx");
  check_numel(dx, N * C, "rmsnorm_backward: dx");
  check_f32(dw, "rmsnorm_backward: dw");
  check_numel(dw, C, "rmsnorm_backward: dw");
  check_f32(rstd, "rmsnorm_backward: rstd");
  check_numel(rstd, N, "rmsnorm_backward: rstd");
  const float *xp = x.f32(), *wp = w.f32(), *gp = dout.f32(), *rp = rstd.f32();
  float* dxp = dx.f32();
  const int64_t nchunk = (N + kRowChunk - 1) / kRowChunk;
  std::vector<float> part(nchunk * C, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < nchunk; ++k) {
    float* pdw = part.data() + k * C;
    for (int64_t n = k * kRowChunk; n < std::min(N, (k + 1) * kRowChunk); ++n)
      rmsnorm_backward_row(dxp + n * C, pdw, gp + n * C, xp + n * C, wp, rp[n], C);
  }
  add_chunk_partials(dw.f32(), part.data(), nchunk, C, C);
}

}  // namespace mt
