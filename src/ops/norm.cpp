// LayerNorm and RMSNorm over the last dim. Rows are independent in forward; backward's
// dw/db reductions over rows go through fixed chunks of kRowChunk rows: each chunk sums its
// rows in order into its own partial, then the partials are added in chunk order. The
// chunking depends only on N, so the result is the same for any number of threads.
#include "ops/norm.h"

#include <algorithm>
#include <vector>

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

void check_norm_io(const Tensor& out, const Tensor& x, const Tensor& w, int64_t& N, int64_t& C, const char* op) {
  check_f32(out, op);
  check_f32(x, op);
  check_f32(w, op);
  C = w.numel();
  MT_CHECK(C > 0, op << ": weight is empty");
  N = rows_of(x, C, op);
  check_numel(out, N * C, op);
}

}  // namespace

// out[N, C] = (x - mean) * rstd * w + b ; saves mean[N], rstd[N]
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps) {
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "layernorm_forward: out/x/w (x's last dim must equal w's size)");
  check_f32(b, "layernorm_forward: b");
  check_numel(b, C, "layernorm_forward: b");
  check_f32(mean, "layernorm_forward: mean");
  check_f32(rstd, "layernorm_forward: rstd");
  check_numel(mean, N, "layernorm_forward: mean");
  check_numel(rstd, N, "layernorm_forward: rstd");
  const float *xp = x.f32(), *wp = w.f32(), *bp = b.f32();
  float *op = out.f32(), *mp = mean.f32(), *rp = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * C;
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
    float* o = op + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] - m) * s * wp[c] + bp[c];
    mp[n] = m;
    rp[n] = s;
  }
}

// dx += dL/dx ; dw += sum_n dout * xhat ; db += sum_n dout
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) {
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
    // Local copies: the shared pointers live in OpenMP's capture struct, and loads through
    // it inside the row loop (which stores to memory) would block vectorisation.
    const float* __restrict wl = wp;
    float* __restrict pdw = part.data() + k * 2 * C;
    float* __restrict pdb = pdw + C;
    for (int64_t n = k * kRowChunk; n < std::min(N, (k + 1) * kRowChunk); ++n) {
      const float* __restrict xr = xp + n * C;
      const float* __restrict g = gp + n * C;
      const float m = mp[n], s = rp[n];
      // First pass: mean(dout * w) and mean(dout * w * xhat).
      float a1[kLanes] = {}, a2[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= C; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const float dn = g[i + j] * wl[i + j];
          a1[j] += dn;
          a2[j] += dn * ((xr[i + j] - m) * s);
        }
      for (int j = 0; j < kLanes && i < C; ++i, ++j) {
        const float dn = g[i] * wl[i];
        a1[j] += dn;
        a2[j] += dn * ((xr[i] - m) * s);
      }
      const float dn_mean = reduce_lanes(a1) / (float)C;
      const float dnx_mean = reduce_lanes(a2) / (float)C;
      // Second pass: dx, and this chunk's dw/db partials.
      float* __restrict d = dxp + n * C;
      for (int64_t c = 0; c < C; ++c) {
        const float xh = (xr[c] - m) * s;
        d[c] += (g[c] * wl[c] - dn_mean - xh * dnx_mean) * s;
        pdw[c] += g[c] * xh;
        pdb[c] += g[c];
      }
    }
  }
  add_chunk_partials(dw.f32(), part.data(), nchunk, C, 2 * C);
  add_chunk_partials(db.f32(), part.data() + C, nchunk, C, 2 * C);
}

// out[N, C] = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps) ; saves rstd[N]
// (the order of Hugging Face's LlamaRMSNorm: normalise in float32, then scale by w).
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "rmsnorm_forward: out/x/w (x's last dim must equal w's size)");
  check_f32(rstd, "rmsnorm_forward: rstd");
  check_numel(rstd, N, "rmsnorm_forward: rstd");
  const float *xp = x.f32(), *wp = w.f32();
  float *op = out.f32(), *rp = rstd.f32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * C;
    const float s = 1.0f / std::sqrt(dot_f32(xr, xr, C) / (float)C + eps);
    float* o = op + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] * s) * wp[c];
    rp[n] = s;
  }
}

// y = x r w with r = (mean(x^2) + eps)^-1/2:
//   dx += r (w dout - xhat mean(w dout xhat)),  xhat = x r ;  dw += sum_n dout xhat
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
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
    for (int64_t n = k * kRowChunk; n < std::min(N, (k + 1) * kRowChunk); ++n) {
      const float* xr = xp + n * C;
      const float* g = gp + n * C;
      const float s = rp[n];
      float acc[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= C; i += kLanes)
        for (int j = 0; j < kLanes; ++j) acc[j] += g[i + j] * wp[i + j] * (xr[i + j] * s);
      for (int j = 0; j < kLanes && i < C; ++i, ++j) acc[j] += g[i] * wp[i] * (xr[i] * s);
      const float dnx_mean = reduce_lanes(acc) / (float)C;
      float* d = dxp + n * C;
      for (int64_t c = 0; c < C; ++c) {
        const float xh = xr[c] * s;
        d[c] += (g[c] * wp[c] - xh * dnx_mean) * s;
        pdw[c] += g[c] * xh;
      }
    }
  }
  add_chunk_partials(dw.f32(), part.data(), nchunk, C, C);
}

}  // namespace mt
