// LayerNorm and RMSNorm on the GPU (ops/norm.h's semantics): forward and the per-row part
// of backward run one block per row; backward's dw / db reductions over rows go through
// fixed chunks of kRowChunk rows (one partial per chunk and column, rows summed in order),
// then a second kernel adds the partials in chunk order into dw / db. Block sums use a
// fixed shuffle tree, so every result depends only on the shape: the same bits every run.
//
// Scratch: the dw / db partials, [nchunk, 2, C] floats, from cudaMallocAsync on the
// compute stream, freed (stream-ordered) right after the kernel that reads them.
#include <algorithm>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kRowThreads = 256;  // threads per row block (a multiple of 32, at most 1024)
constexpr int kColThreads = 256;  // threads per column block of the partials kernels
constexpr int64_t kRowChunk = 32;  // rows summed into one dw / db partial

// The sum of v over the block's threads, returned to every thread. A fixed butterfly per
// warp, then warp 0's sums (read by every warp) in the same fixed tree: every thread gets
// the same bits. `sh` holds 32 floats; the leading barrier lets a call reuse it.
__device__ float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarp = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = lane < nwarp ? sh[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

// x[n, c] += res[n, c] where res is given (the fused residual add), in the forwards' first pass
// over the row: each thread adds the elements it reads again later, so it sees its sums.
__device__ float with_residual(float* xr, const float* res, int64_t n, int64_t C, int64_t c) {
  if (!res) return xr[c];
  const float v = xr[c] + res[n * C + c];
  xr[c] = v;
  return v;
}

// LayerNorm forward. Grid: N blocks (one per row) of kRowThreads; threads stride over C.
// out[n, c] = (x - mean) * rstd * w + b ; mean[n], rstd[n] (two-pass variance); x += res
// first where res is given. Out: float, __nv_bfloat16 or __half.
template <class Out>
__global__ void layernorm_forward_kernel(Out* out, float* mean, float* rstd, float* x, const float* res,
                                         const float* w, const float* b, int64_t C, float eps) {
  __shared__ float sh[32];
  const int64_t n = blockIdx.x;
  float* xr = x + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += with_residual(xr, res, n, C, c);
  const float m = block_sum(s, sh) / (float)C;
  float v = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = xr[c] - m;
    v += d * d;
  }
  const float r = 1.0f / sqrtf(block_sum(v, sh) / (float)C + eps);
  Out* o = out + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_rounded(o + c, (xr[c] - m) * r * w[c] + b[c]);
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

// RMSNorm forward. Grid: N blocks of kRowThreads. out[n, c] = (x * rstd) * w ; rstd[n]; x +=
// res first where res is given. Out as above.
template <class Out>
__global__ void rmsnorm_forward_kernel(Out* out, float* rstd, float* x, const float* res, const float* w, int64_t C,
                                       float eps) {
  __shared__ float sh[32];
  const int64_t n = blockIdx.x;
  float* xr = x + n * C;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float v = with_residual(xr, res, n, C, c);
    ss += v * v;
  }
  const float r = 1.0f / sqrtf(block_sum(ss, sh) / (float)C + eps);
  Out* o = out + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store_rounded(o + c, (xr[c] * r) * w[c]);
  if (threadIdx.x == 0) rstd[n] = r;
}

// The per-row part of norm backward. Grid: N blocks of kRowThreads. With xhat = (x - mean)
// rstd (mean == nullptr: RMSNorm, xhat = x rstd):
//   layernorm: dx += (dout w - mean(dout w) - xhat mean(dout w xhat)) rstd
//   rmsnorm:   dx += (dout w - xhat mean(dout w xhat)) rstd
__global__ void norm_backward_dx_kernel(float* dx, const float* dout, const float* x, const float* w,
                                        const float* mean, const float* rstd, int64_t C) {
  __shared__ float sh[32];
  const int64_t n = blockIdx.x;
  const float* g = dout + n * C;
  const float* xr = x + n * C;
  const float m = mean ? mean[n] : 0.0f;
  const float r = rstd[n];
  float a1 = 0.0f, a2 = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float dn = g[c] * w[c];
    a1 += dn;
    a2 += dn * ((xr[c] - m) * r);
  }
  const float dn_mean = mean ? block_sum(a1, sh) / (float)C : 0.0f;  // same branch for the whole block
  const float dnx_mean = block_sum(a2, sh) / (float)C;
  float* d = dx + n * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xh = (xr[c] - m) * r;
    d[c] += (g[c] * w[c] - dn_mean - xh * dnx_mean) * r;
  }
}

// Per-chunk partials of dw (and db). Grid: (nchunk, ceil(C / kColThreads)) blocks of
// kColThreads; thread (k, c) sums rows [k kRowChunk, min(N, (k+1) kRowChunk)) in order:
//   part[k, 0, c] = sum dout xhat ;  part[k, 1, c] = sum dout (only when with_db)
// part is [nchunk, 2, C] (row stride 2C).
__global__ void norm_partials_kernel(float* part, const float* dout, const float* x, const float* mean,
                                     const float* rstd, int64_t N, int64_t C, bool with_db) {
  const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t k = blockIdx.x;
  const int64_t n0 = k * kRowChunk, n1 = n0 + kRowChunk < N ? n0 + kRowChunk : N;
  float pdw = 0.0f, pdb = 0.0f;
  for (int64_t n = n0; n < n1; ++n) {
    const float g = dout[n * C + c];
    const float xh = (x[n * C + c] - (mean ? mean[n] : 0.0f)) * rstd[n];
    pdw += g * xh;
    pdb += g;
  }
  float* p = part + k * 2 * C;
  p[c] = pdw;
  if (with_db) p[C + c] = pdb;
}

// dst[c] += sum over chunks k (in order) of part[k * stride + c]. Grid: ceil(C / kColThreads)
// blocks of kColThreads, one thread per column.
__global__ void add_partials_kernel(float* dst, const float* part, int64_t nchunk, int64_t C, int64_t stride) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int64_t k = 0; k < nchunk; ++k) s += part[k * stride + c];
  dst[c] += s;
}

void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << " has " << t.numel() << " elements (shape " << shape_str(t.shape())
                                << "), expected " << n);
}

// out / x / w checks shared by all four ops: C = numel(w), N = rows of x.
void check_norm_io(const Tensor& out, const Tensor& x, const Tensor& w, int64_t& N, int64_t& C, const char* op,
                   bool out_16bit = false) {
  if (!out_16bit || out.device() != Device::cuda || (out.dtype() != DType::bf16 && out.dtype() != DType::f16))
    check_device_f32(out, op);
  check_device_f32(x, op);
  check_device_f32(w, op);
  C = w.numel();
  MT_CHECK(C > 0, op << ": weight is empty");
  MT_CHECK(x.ndim() >= 1 && x.dim(-1) == C, op << ": x has shape " << shape_str(x.shape()) << ", expected last dim "
                                               << C);
  N = x.numel() / C;
  check_numel(out, N * C, op);
  if (out.dtype() != DType::f32) {  // a 16-bit out in place of x would overwrite what other rows read
    const uintptr_t o = reinterpret_cast<uintptr_t>(out.raw()), xs = reinterpret_cast<uintptr_t>(x.raw());
    MT_CHECK(o + out.nbytes() <= xs || xs + x.nbytes() <= o, op << ": a 16-bit out must not overlap x");
  }
}

// The residual r for x (nullptr: none): fp32 on the device, of x's size, overlapping neither x nor out.
const float* residual_of(const Tensor* r, const Tensor& x, const Tensor& out, int64_t n, const char* op) {
  if (!r) return nullptr;
  check_device_f32(*r, op);
  check_numel(*r, n, op);
  const uintptr_t lo = reinterpret_cast<uintptr_t>(r->raw()), bytes = n * sizeof(float);
  for (const Tensor* t : {&x, &out}) {
    const uintptr_t tlo = reinterpret_cast<uintptr_t>(t->raw());
    MT_CHECK(lo + bytes <= tlo || tlo + t->nbytes() <= lo, op << ": the residual must not overlap x or out");
  }
  return r->f32();
}

// dw (+= ) and db (+=, when db is given) from the chunk partials: two launches plus the
// scratch buffer's allocation and stream-ordered free.
void reduce_weight_grads(const Tensor& dw, const Tensor* db, const Tensor& dout, const Tensor& x, const float* mean,
                         const Tensor& rstd, int64_t N, int64_t C) {
  if (N == 0) return;
  const int64_t nchunk = ceil_div(N, kRowChunk);
  const Scratch part_slot((size_t)(nchunk * 2 * C) * sizeof(float), "a norm's backward");
  float* part = part_slot.as<float>();  // [nchunk, 2, C]
  const dim3 pgrid((unsigned)nchunk, (unsigned)ceil_div(C, kColThreads));
  norm_partials_kernel<<<pgrid, kColThreads, 0, stream()>>>(part, dout.f32(), x.f32(), mean, rstd.f32(), N, C,
                                                           db != nullptr);
  MT_CUDA_LAUNCHED("norm_partials_kernel");
  const unsigned cblocks = (unsigned)ceil_div(C, kColThreads);
  add_partials_kernel<<<cblocks, kColThreads, 0, stream()>>>(dw.f32(), part, nchunk, C, 2 * C);
  MT_CUDA_LAUNCHED("add_partials_kernel (dw)");
  if (db) {
    add_partials_kernel<<<cblocks, kColThreads, 0, stream()>>>(db->f32(), part + C, nchunk, C, 2 * C);
    MT_CUDA_LAUNCHED("add_partials_kernel (db)");
  }
}

// fn(out's data as float*, __nv_bfloat16* or __half*): a forward's launch for out's dtype.
template <class Fn>
void with_out(const Tensor& out, Fn fn) {
  if (out.dtype() == DType::bf16) fn(static_cast<__nv_bfloat16*>(out.raw()));
  else if (out.dtype() == DType::f16) fn(static_cast<__half*>(out.raw()));
  else fn(out.f32());
}

}  // namespace

// out[N, C] = (x - mean) * rstd * w + b ; saves mean[N], rstd[N]
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b, float eps, const Tensor* r) {
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "layernorm_forward: out/x/w (x's last dim must equal w's size)", true);
  check_device_f32(b, "layernorm_forward: b");
  check_numel(b, C, "layernorm_forward: b");
  check_device_f32(mean, "layernorm_forward: mean");
  check_device_f32(rstd, "layernorm_forward: rstd");
  check_numel(mean, N, "layernorm_forward: mean");
  check_numel(rstd, N, "layernorm_forward: rstd");
  const float* res = residual_of(r, x, out, N * C, "layernorm_forward: r");
  if (N == 0) return;
  with_out(out, [&](auto* o) {
    layernorm_forward_kernel<<<(unsigned)N, kRowThreads, 0, stream()>>>(o, mean.f32(), rstd.f32(), x.f32(), res,
                                                                        w.f32(), b.f32(), C, eps);
  });
  MT_CUDA_LAUNCHED("layernorm_forward_kernel");
}

// dx += dL/dx ; dw += sum_n dout * xhat ; db += sum_n dout
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  int64_t N, C;
  check_norm_io(dout, x, w, N, C, "layernorm_backward: dout/x/w (x's last dim must equal w's size)");
  check_device_f32(dx, "layernorm_backward: dx");
  check_numel(dx, N * C, "layernorm_backward: dx");
  check_device_f32(dw, "layernorm_backward: dw");
  check_numel(dw, C, "layernorm_backward: dw");
  check_device_f32(db, "layernorm_backward: db");
  check_numel(db, C, "layernorm_backward: db");
  check_device_f32(mean, "layernorm_backward: mean");
  check_device_f32(rstd, "layernorm_backward: rstd");
  check_numel(mean, N, "layernorm_backward: mean");
  check_numel(rstd, N, "layernorm_backward: rstd");
  if (N == 0) return;
  norm_backward_dx_kernel<<<(unsigned)N, kRowThreads, 0, stream()>>>(dx.f32(), dout.f32(), x.f32(), w.f32(),
                                                                     mean.f32(), rstd.f32(), C);
  MT_CUDA_LAUNCHED("norm_backward_dx_kernel (layernorm)");
  reduce_weight_grads(dw, &db, dout, x, mean.f32(), rstd, N, C);
}

// out[N, C] = (x * rstd) * w with rstd = 1 / sqrt(mean(x^2) + eps) ; saves rstd[N]
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                     const Tensor* r) {
  int64_t N, C;
  check_norm_io(out, x, w, N, C, "rmsnorm_forward: out/x/w (x's last dim must equal w's size)", true);
  check_device_f32(rstd, "rmsnorm_forward: rstd");
  check_numel(rstd, N, "rmsnorm_forward: rstd");
  const float* res = residual_of(r, x, out, N * C, "rmsnorm_forward: r");
  if (N == 0) return;
  with_out(out, [&](auto* o) {
    rmsnorm_forward_kernel<<<(unsigned)N, kRowThreads, 0, stream()>>>(o, rstd.f32(), x.f32(), res, w.f32(), C, eps);
  });
  MT_CUDA_LAUNCHED("rmsnorm_forward_kernel");
}

// dx += r (w dout - xhat mean(w dout xhat)) ; dw += sum_n dout xhat
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  int64_t N, C;
  check_norm_io(dout, x, w, N, C, "rmsnorm_backward: dout/x/w (x's last dim must equal w's size)");
  check_device_f32(dx, "rmsnorm_backward: dx");
  check_numel(dx, N * C, "rmsnorm_backward: dx");
  check_device_f32(dw, "rmsnorm_backward: dw");
  check_numel(dw, C, "rmsnorm_backward: dw");
  check_device_f32(rstd, "rmsnorm_backward: rstd");
  check_numel(rstd, N, "rmsnorm_backward: rstd");
  if (N == 0) return;
  norm_backward_dx_kernel<<<(unsigned)N, kRowThreads, 0, stream()>>>(dx.f32(), dout.f32(), x.f32(), w.f32(),
                                                                     nullptr, rstd.f32(), C);
  MT_CUDA_LAUNCHED("norm_backward_dx_kernel (rmsnorm)");
  reduce_weight_grads(dw, nullptr, dout, x, nullptr, rstd, N, C);
}

}  // namespace mt::cuda
