// Tensor-core fused causal grouped-query attention (WMMA, 16-bit operands, fp32
// accumulation): see attention_tc.h for the semantics. Flash-style like the fp32 kernels in
// attention.cu (same layout, same deterministic structure), nothing T x T is stored.
//
// Layout: qkv[B, T, W], W = (NH + 2 NKV) D; query head h of token t of batch b at
// qkv + (b T + t) W + h D, its kv head kh = h / G with K at column (NH + kh) D and V at
// column (NH + NKV + kh) D. out[B, T, NH D], lse[B, NH, T], scale = 1/sqrt(D).
//
// Tiles: kTile = 64 query rows and 64 keys per block, 4 warps (128 threads); warp w owns
// the 16 rows [16 w, 16 w + 16) of every 64-row product it computes. Products use 16x16x16
// WMMA fragments (T16 = __nv_bfloat16 or half operands, float accumulators). Operand tiles
// live in shared memory as T16 with row stride ldh = D + 8 (a multiple of 8 elements, as
// WMMA wants for 16-bit types); fp32 score tiles with stride kLdS = 68, 16-bit probability
// tiles with kLdP = 72, fp32 accumulators (O, dK, dV, dQ) with ldo = D + 4. Every array
// starts 128-byte aligned, so every fragment pointer (row multiple of 16, column multiple of
// 16) is 32-byte aligned. Running accumulators stay in shared fp32 and go through
// load_matrix_sync / mma_sync / store_matrix_sync each step (the forward rescales O per row
// in shared memory, which fragment registers would not allow).
//
// Shared memory at D = 128: forward 112,640 bytes, dK/dV 190,976, dQ 147,968 (the limit is
// raised with cudaFuncSetAttribute; the H100 allows 227 KB per block).
//
// Determinism: no atomics. Warp reductions are butterflies; every fragment product sums
// its k-steps in a fixed order, accumulators run over key tiles (forward, dQ) or query
// heads of the group then query tiles (dK/dV) in order. The grid depends only on shapes.
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/attention_tc.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;               // query rows per query tile, keys per key tile
constexpr int kWarps = 4;               // warps per block; warp w owns rows [16 w, 16 w + 16)
constexpr int kThreads = kWarps * 32;   // threads per block
constexpr int kF = 16;                  // WMMA fragment size (16 x 16 x 16)
constexpr int kLdS = kTile + 4;         // row stride of fp32 [64, 64] score tiles
constexpr int kLdP = kTile + 8;         // row stride of 16-bit [64, 64] probability tiles
constexpr int kMaxD = 128;
static_assert(kTile == kWarps * kF, "each warp owns one 16-row slice of a tile");

struct TcDims {
  int T, D, NH, NKV, G;
  int64_t W, OW;  // qkv and out row widths
  float scale;
};

__host__ __device__ inline int ld_h(int D) { return D + 8; }  // 16-bit operand tiles
__host__ __device__ inline int ld_o(int D) { return D + 4; }  // fp32 accumulator tiles

// Byte offset of the next array (128-byte aligned), advancing `off` past `bytes`.
__host__ __device__ inline size_t carve(size_t& off, size_t bytes) {
  const size_t at = off;
  off = (off + bytes + 127) & ~(size_t)127;
  return at;
}

// Shared-memory layouts (byte offsets), the same on host (size) and device (pointers).
struct FwdLayout {
  size_t q, k, v, s, p, o, bytes;
};
__host__ __device__ inline FwdLayout fwd_layout(int D) {
  const size_t h16 = (size_t)kTile * ld_h(D) * 2, f32 = (size_t)kTile * ld_o(D) * 4;
  FwdLayout L;
  size_t off = 0;
  L.q = carve(off, h16);
  L.k = carve(off, h16);
  L.v = carve(off, h16);
  L.s = carve(off, (size_t)kTile * kLdS * 4);
  L.p = carve(off, (size_t)kTile * kLdP * 2);
  L.o = carve(off, f32);
  L.bytes = off;
  return L;
}
// dK/dV kernel (all fields) and dQ kernel (no p, dk, dv: with_dkv false).
struct BwdLayout {
  size_t q, dout, k, v, s, dp, p, ds, acc0, acc1, lse, delta, bytes;
};
__host__ __device__ inline BwdLayout bwd_layout(int D, bool with_dkv) {
  const size_t h16 = (size_t)kTile * ld_h(D) * 2, f32 = (size_t)kTile * ld_o(D) * 4;
  BwdLayout L;
  size_t off = 0;
  L.q = carve(off, h16);
  L.dout = carve(off, h16);
  L.k = carve(off, h16);
  L.v = carve(off, h16);
  L.s = carve(off, (size_t)kTile * kLdS * 4);
  L.dp = carve(off, (size_t)kTile * kLdS * 4);
  L.p = with_dkv ? carve(off, (size_t)kTile * kLdP * 2) : 0;
  L.ds = carve(off, (size_t)kTile * kLdP * 2);
  L.acc0 = carve(off, f32);                  // dK (dK/dV kernel) or dQ (dQ kernel)
  L.acc1 = with_dkv ? carve(off, f32) : 0;   // dV
  L.lse = carve(off, kTile * 4);
  L.delta = carve(off, kTile * 4);
  L.bytes = off;
  return L;
}

template <class T16> __device__ __forceinline__ T16 to16(float x);
template <> __device__ __forceinline__ __nv_bfloat16 to16<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ half to16<half>(float x) { return __float2half_rn(x); }
template <class T16> __device__ __forceinline__ float from16(T16 x);
template <> __device__ __forceinline__ float from16<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float from16<half>(half x) { return __half2float(x); }

__device__ __forceinline__ float warp_max(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// dst[64, ldh] (shared, T16) = rows [r0, r0 + 64) of a [T, D] fp32 matrix at src with row
// stride ld_src (global), rounded to T16; rows >= T are zeros. All threads take part.
template <class T16>
__device__ void load_tile16(T16* dst, const float* src, int64_t ld_src, int r0, const TcDims& z) {
  const int ldh = ld_h(z.D);
  for (int idx = threadIdx.x; idx < kTile * z.D; idx += blockDim.x) {
    const int r = idx / z.D, d = idx % z.D, row = r0 + r;
    dst[r * ldh + d] = to16<T16>(row < z.T ? src[(int64_t)row * ld_src + d] : 0.0f);
  }
}

// dst[64] (shared) = src[r0 .. r0 + 64) (global), zeros past T.
__device__ void load_vec(float* dst, const float* src, int r0, int T) {
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) dst[r] = r0 + r < T ? src[r0 + r] : 0.0f;
}

using FragAcc = wmma::fragment<wmma::accumulator, kF, kF, kF, float>;
template <class T16, class Layout> using FragA = wmma::fragment<wmma::matrix_a, kF, kF, kF, T16, Layout>;
template <class T16, class Layout> using FragB = wmma::fragment<wmma::matrix_b, kF, kF, kF, T16, Layout>;

// One warp: S[r0 .. r0 + 16, 0 .. 64) (fp32, stride kLdS) = A[r0 .., :D] B[0 .. 64, :D]^T,
// A and B [64, ldh] T16 tiles (rows of A against rows of B; k-steps over D in order).
template <class T16>
__device__ void warp_abt(float* S, const T16* A, const T16* B, int r0, int D) {
  const int ldh = ld_h(D);
  for (int n = 0; n < kTile; n += kF) {
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < D; kk += kF) {
      FragA<T16, wmma::row_major> a;
      FragB<T16, wmma::col_major> b;  // B^T[kk.., n..] read from B's rows n..
      wmma::load_matrix_sync(a, A + r0 * ldh + kk, ldh);
      wmma::load_matrix_sync(b, B + n * ldh + kk, ldh);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(S + r0 * kLdS + n, acc, kLdS, wmma::mem_row_major);
  }
}

// Forward. Grid (ceil(T / 64), NH, B), 128 threads: the block takes query rows
// [q0, q0 + 64) of head h of batch b and walks the key tiles k0 = 0, 64, ..., q0 (the last
// is the diagonal tile). Per tile, warp w on its 16 rows: S = Q K^T (WMMA); per row (lanes
// take keys lane and lane + 32) the running max m and sum l are updated with the fp32
// probabilities, O's row is rescaled and P is written as T16; then O += P V (WMMA).
// Finally out = O / l and lse = m + log l for the rows < T.
template <class T16>
__global__ void __launch_bounds__(kThreads)
    attention_tc_forward_kernel(float* __restrict__ out, float* __restrict__ lse, const float* __restrict__ qkv,
                                TcDims z) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FwdLayout L = fwd_layout(z.D);
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);   // [64, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);   // [64, ldh]
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);   // [64, ldh]
  float* Ss = reinterpret_cast<float*>(smem + L.s);  // [64, kLdS] scores
  T16* Ps = reinterpret_cast<T16*>(smem + L.p);   // [64, kLdP] probabilities
  float* Os = reinterpret_cast<float*>(smem + L.o);  // [64, ldo] running output
  const int ldh = ld_h(z.D), ldo = ld_o(z.D);
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * kF;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  const float* Kg = base + (int64_t)(z.NH + kh) * z.D;
  const float* Vg = base + (int64_t)(z.NH + z.NKV + kh) * z.D;
  load_tile16(Qs, base + (int64_t)h * z.D, z.W, q0, z);
  for (int idx = threadIdx.x; idx < kTile * ldo; idx += kThreads) Os[idx] = 0.0f;

  // the warp's rows' running max and sum (every lane holds the same values)
  float m[kF], l[kF];
  #pragma unroll
  for (int r = 0; r < kF; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // the previous tile's readers are done (and Qs, Os are ready)
    load_tile16(Ks, Kg, z.W, k0, z);
    load_tile16(Vs, Vg, z.W, k0, z);
    __syncthreads();
    warp_abt(Ss, Qs, Ks, r0, z.D);
    __syncwarp();
    #pragma unroll
    for (int r = 0; r < kF; ++r) {
      const int i = r0 + r, t = q0 + i;
      const int key0 = k0 + lane, key1 = key0 + 32;
      const bool seen0 = key0 <= t && key0 < z.T, seen1 = key1 <= t && key1 < z.T;
      const float s0 = seen0 ? Ss[i * kLdS + lane] * z.scale : -INFINITY;
      const float s1 = seen1 ? Ss[i * kLdS + lane + 32] * z.scale : -INFINITY;
      // key k0 <= q0 <= t and k0 < T: every row sees a key of every tile, so mn is finite
      const float mn = fmaxf(m[r], warp_max(fmaxf(s0, s1)));
      const float a = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);  // rescales earlier tiles
      const float p0 = seen0 ? expf(s0 - mn) : 0.0f, p1 = seen1 ? expf(s1 - mn) : 0.0f;
      l[r] = a * l[r] + warp_sum(p0 + p1);
      m[r] = mn;
      Ps[i * kLdP + lane] = to16<T16>(p0);
      Ps[i * kLdP + lane + 32] = to16<T16>(p1);
      for (int d = lane; d < z.D; d += 32) Os[i * ldo + d] *= a;
    }
    __syncwarp();
    // O[r0 .., :] += P[r0 .., 0 .. 64) V
    for (int n = 0; n < z.D; n += kF) {
      FragAcc c;
      wmma::load_matrix_sync(c, Os + r0 * ldo + n, ldo, wmma::mem_row_major);
      #pragma unroll
      for (int kk = 0; kk < kTile; kk += kF) {
        FragA<T16, wmma::row_major> a;
        FragB<T16, wmma::row_major> bv;
        wmma::load_matrix_sync(a, Ps + r0 * kLdP + kk, kLdP);
        wmma::load_matrix_sync(bv, Vs + kk * ldh + n, ldh);
        wmma::mma_sync(c, a, bv, c);
      }
      wmma::store_matrix_sync(Os + r0 * ldo + n, c, ldo, wmma::mem_row_major);
    }
    __syncwarp();
  }
  #pragma unroll
  for (int r = 0; r < kF; ++r) {
    const int i = r0 + r, t = q0 + i;
    if (t >= z.T) continue;
    const float inv = 1.0f / l[r];  // every row < T sees key 0, so l > 0
    float* o = out + ((int64_t)b * z.T + t) * z.OW + (int64_t)h * z.D;
    for (int d = lane; d < z.D; d += 32) o[d] = Os[i * ldo + d] * inv;
    if (lane == 0) lse[((int64_t)b * z.NH + h) * z.T + t] = m[r] + logf(l[r]);
  }
}

// delta[b, h, t] = round16(dout[b, t, h]) . out[b, t, h] (D-vectors; dout rounded as in the
// dP = dO V^T product, so dP - delta stays consistent). One warp per (b, h, t) row: lanes
// sum columns lane, lane + 32, ... in order, then a butterfly. Grid ceil(rows / 4), 128.
template <class T16>
__global__ void attention_tc_delta_kernel(float* __restrict__ delta, const float* __restrict__ dout,
                                          const float* __restrict__ out, int64_t rows, TcDims z) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  const int64_t t = row % z.T, bh = row / z.T, h = bh % z.NH, b = bh / z.NH;
  const int64_t at = (b * z.T + t) * z.OW + h * z.D;
  float s = 0.0f;
  for (int d = lane; d < z.D; d += 32) s += from16<T16>(to16<T16>(dout[at + d])) * out[at + d];
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// The backward's per-pair values, all threads over the [64, 64] tile (query i, key j):
// P = exp(scale S - lse_i), dS = scale P (dP - delta_i), 0 unless key <= query < T; written
// as T16 to Ps (when given) and dSs.
template <class T16>
__device__ void pair_grads(T16* Ps, T16* dSs, const float* Ss, const float* dPs, const float* Ls, const float* Ds,
                           int q0, int k0, const TcDims& z) {
  for (int idx = threadIdx.x; idx < kTile * kTile; idx += blockDim.x) {
    const int i = idx / kTile, j = idx % kTile, t = q0 + i, key = k0 + j;
    const bool seen = key <= t && t < z.T;
    const float p = seen ? expf(Ss[i * kLdS + j] * z.scale - Ls[i]) : 0.0f;
    const float ds = seen ? p * (dPs[i * kLdS + j] - Ds[i]) * z.scale : 0.0f;
    if (Ps) Ps[i * kLdP + j] = to16<T16>(p);
    dSs[i * kLdP + j] = to16<T16>(ds);
  }
}

// dK, dV. Grid (ceil(T / 64), NKV, B), 128 threads: the block owns keys [k0, k0 + 64) of kv
// head kh of batch b. For each query head h of the group (in order), each query tile
// q0 = k0, k0 + 64, ... < T: S = Q K^T and dP = dO V^T (warp w: query rows 16 w ..), then
// P and dS (all threads), then warp w on its 16 keys: dV += P^T dO, dK += dS^T Q (k-steps
// over the tile's queries in order). Writes the block's dK and dV rows < T (overwriting).
template <class T16>
__global__ void __launch_bounds__(kThreads)
    attention_tc_dkv_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv, const float* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta, TcDims z) {
  extern __shared__ __align__(128) unsigned char smem[];
  const BwdLayout L = bwd_layout(z.D, true);
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);       // [64, ldh] query tile
  T16* dOs = reinterpret_cast<T16*>(smem + L.dout);   // [64, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);       // [64, ldh] the block's keys
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);       // [64, ldh]
  float* Ss = reinterpret_cast<float*>(smem + L.s);   // [64 queries, kLdS]
  float* dPs = reinterpret_cast<float*>(smem + L.dp); // [64 queries, kLdS]
  T16* Ps = reinterpret_cast<T16*>(smem + L.p);       // [64 queries, kLdP]
  T16* dSs = reinterpret_cast<T16*>(smem + L.ds);     // [64 queries, kLdP]
  float* dKs = reinterpret_cast<float*>(smem + L.acc0);  // [64 keys, ldo]
  float* dVs = reinterpret_cast<float*>(smem + L.acc1);  // [64 keys, ldo]
  float* Ls = reinterpret_cast<float*>(smem + L.lse);    // [64]
  float* Ds = reinterpret_cast<float*>(smem + L.delta);  // [64]
  const int ldh = ld_h(z.D), ldo = ld_o(z.D);
  const int k0 = blockIdx.x * kTile, kh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, r0 = warp * kF;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_tile16(Ks, base + (int64_t)(z.NH + kh) * z.D, z.W, k0, z);
  load_tile16(Vs, base + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z);
  for (int idx = threadIdx.x; idx < kTile * ldo; idx += kThreads) dKs[idx] = dVs[idx] = 0.0f;

  for (int g = 0; g < z.G; ++g) {
    const int h = kh * z.G + g;
    const int64_t bh = (int64_t)b * z.NH + h;
    for (int q0 = k0; q0 < z.T; q0 += kTile) {
      __syncthreads();  // readers of the previous Q / dO / P / dS tiles are done
      load_tile16(Qs, base + (int64_t)h * z.D, z.W, q0, z);
      load_tile16(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * z.D, z.OW, q0, z);
      load_vec(Ls, lse + bh * z.T, q0, z.T);
      load_vec(Ds, delta + bh * z.T, q0, z.T);
      __syncthreads();
      warp_abt(Ss, Qs, Ks, r0, z.D);
      warp_abt(dPs, dOs, Vs, r0, z.D);
      __syncthreads();
      pair_grads(Ps, dSs, Ss, dPs, Ls, Ds, q0, k0, z);
      __syncthreads();
      // keys r0 ..: dV += P^T dO, dK += dS^T Q; P^T, dS^T read column-major from P, dS
      for (int n = 0; n < z.D; n += kF) {
        FragAcc cv, ck;
        wmma::load_matrix_sync(cv, dVs + r0 * ldo + n, ldo, wmma::mem_row_major);
        wmma::load_matrix_sync(ck, dKs + r0 * ldo + n, ldo, wmma::mem_row_major);
        #pragma unroll
        for (int kk = 0; kk < kTile; kk += kF) {
          FragA<T16, wmma::col_major> a;
          FragB<T16, wmma::row_major> bm;
          wmma::load_matrix_sync(a, Ps + kk * kLdP + r0, kLdP);
          wmma::load_matrix_sync(bm, dOs + kk * ldh + n, ldh);
          wmma::mma_sync(cv, a, bm, cv);
          wmma::load_matrix_sync(a, dSs + kk * kLdP + r0, kLdP);
          wmma::load_matrix_sync(bm, Qs + kk * ldh + n, ldh);
          wmma::mma_sync(ck, a, bm, ck);
        }
        wmma::store_matrix_sync(dVs + r0 * ldo + n, cv, ldo, wmma::mem_row_major);
        wmma::store_matrix_sync(dKs + r0 * ldo + n, ck, ldo, wmma::mem_row_major);
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTile * z.D; idx += kThreads) {
    const int r = idx / z.D, d = idx % z.D, key = k0 + r;
    if (key >= z.T) continue;
    float* row = dqkv + ((int64_t)b * z.T + key) * z.W;
    row[(int64_t)(z.NH + kh) * z.D + d] = dKs[r * ldo + d];
    row[(int64_t)(z.NH + z.NKV + kh) * z.D + d] = dVs[r * ldo + d];
  }
}

// dQ. Grid (ceil(T / 64), NH, B), 128 threads: the block owns query rows [q0, q0 + 64) of
// head h of batch b. For each key tile k0 = 0, 64, ..., q0: S = Q K^T, dP = dO V^T (warp w:
// rows 16 w ..), dS (all threads), then warp w: dQ[rows] += dS K (k-steps over the tile's
// keys in order). Writes the rows < T of the query columns of dqkv (overwriting).
template <class T16>
__global__ void __launch_bounds__(kThreads)
    attention_tc_dq_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv, const float* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta, TcDims z) {
  extern __shared__ __align__(128) unsigned char smem[];
  const BwdLayout L = bwd_layout(z.D, false);
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);       // [64, ldh] the block's queries
  T16* dOs = reinterpret_cast<T16*>(smem + L.dout);   // [64, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);       // [64, ldh] key tile
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);       // [64, ldh]
  float* Ss = reinterpret_cast<float*>(smem + L.s);   // [64 queries, kLdS]
  float* dPs = reinterpret_cast<float*>(smem + L.dp); // [64 queries, kLdS]
  T16* dSs = reinterpret_cast<T16*>(smem + L.ds);     // [64 queries, kLdP]
  float* dQs = reinterpret_cast<float*>(smem + L.acc0);  // [64 queries, ldo]
  float* Ls = reinterpret_cast<float*>(smem + L.lse);    // [64]
  float* Ds = reinterpret_cast<float*>(smem + L.delta);  // [64]
  const int ldh = ld_h(z.D), ldo = ld_o(z.D);
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, r0 = warp * kF;
  const int64_t bh = (int64_t)b * z.NH + h;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_tile16(Qs, base + (int64_t)h * z.D, z.W, q0, z);
  load_tile16(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * z.D, z.OW, q0, z);
  load_vec(Ls, lse + bh * z.T, q0, z.T);
  load_vec(Ds, delta + bh * z.T, q0, z.T);
  for (int idx = threadIdx.x; idx < kTile * ldo; idx += kThreads) dQs[idx] = 0.0f;

  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // readers of the previous K / V / dS tiles are done (and Q, dO loaded)
    load_tile16(Ks, base + (int64_t)(z.NH + kh) * z.D, z.W, k0, z);
    load_tile16(Vs, base + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z);
    __syncthreads();
    warp_abt(Ss, Qs, Ks, r0, z.D);
    warp_abt(dPs, dOs, Vs, r0, z.D);
    __syncthreads();
    pair_grads<T16>(nullptr, dSs, Ss, dPs, Ls, Ds, q0, k0, z);
    __syncthreads();
    // dQ[r0 .., :] += dS[r0 .., 0 .. 64) K
    for (int n = 0; n < z.D; n += kF) {
      FragAcc c;
      wmma::load_matrix_sync(c, dQs + r0 * ldo + n, ldo, wmma::mem_row_major);
      #pragma unroll
      for (int kk = 0; kk < kTile; kk += kF) {
        FragA<T16, wmma::row_major> a;
        FragB<T16, wmma::row_major> bk;
        wmma::load_matrix_sync(a, dSs + r0 * kLdP + kk, kLdP);
        wmma::load_matrix_sync(bk, Ks + kk * ldh + n, ldh);
        wmma::mma_sync(c, a, bk, c);
      }
      wmma::store_matrix_sync(dQs + r0 * ldo + n, c, ldo, wmma::mem_row_major);
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kTile * z.D; idx += kThreads) {
    const int r = idx / z.D, d = idx % z.D, t = q0 + r;
    if (t < z.T) dqkv[((int64_t)b * z.T + t) * z.W + (int64_t)h * z.D + d] = dQs[r * ldo + d];
  }
}

TcDims make_dims(const AttentionShape& s) {
  TcDims z;
  z.T = (int)s.T;
  z.D = (int)s.D;
  z.NH = (int)s.NH;
  z.NKV = (int)s.NKV;
  z.G = (int)s.G;
  z.W = s.W;
  z.OW = s.NH * s.D;
  z.scale = 1.0f / std::sqrt((float)s.D);
  return z;
}

// Raises the kernel's dynamic shared-memory limit when `bytes` exceed the default 48 KB.
template <class Kernel>
size_t with_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return bytes;
}

void check_tc(const AttentionShape& s, DType dt, const char* op) {
  MT_CHECK(attention_tc_supported(s.D), op << ": head dim D = " << s.D
                                           << " not supported by the tensor-core kernels (D % 16 == 0, D <= 128)");
  MT_CHECK(dt == DType::bf16 || dt == DType::f16, op << ": 16-bit dtype expected, got " << dtype_name(dt));
  MT_CHECK(s.T <= (int64_t)1 << 30 && s.B <= 65535 && s.NH <= 65535,
           op << ": B = " << s.B << ", T = " << s.T << ", NH = " << s.NH
              << " outside the CUDA grid (B, NH <= 65535, T <= 2^30)");
}

template <class T16>
void forward_typed(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  const TcDims z = make_dims(s);
  const size_t bytes = with_smem(attention_tc_forward_kernel<T16>, fwd_layout(z.D).bytes);
  const dim3 grid((unsigned)ceil_div(s.T, kTile), (unsigned)s.NH, (unsigned)s.B);
  attention_tc_forward_kernel<T16><<<grid, kThreads, bytes, stream()>>>(out.f32(), lse.f32(), qkv.f32(), z);
  MT_CUDA_LAUNCHED("attention_tc_forward_kernel");
}

template <class T16>
void backward_typed(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                    const AttentionShape& s) {
  const TcDims z = make_dims(s);
  const int64_t rows = s.B * s.NH * s.T;
  // delta[B, NH, T] scratch, stream-ordered
  float* delta = nullptr;
  MT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&delta), sizeof(float) * rows, stream()));
  attention_tc_delta_kernel<T16><<<(unsigned)ceil_div(rows, kWarps), kThreads, 0, stream()>>>(delta, dout.f32(),
                                                                                             out.f32(), rows, z);
  MT_CUDA_LAUNCHED("attention_tc_delta_kernel");

  const unsigned tiles = (unsigned)ceil_div(s.T, kTile);
  const size_t dkv_bytes = with_smem(attention_tc_dkv_kernel<T16>, bwd_layout(z.D, true).bytes);
  attention_tc_dkv_kernel<T16><<<dim3(tiles, (unsigned)s.NKV, (unsigned)s.B), kThreads, dkv_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z);
  MT_CUDA_LAUNCHED("attention_tc_dkv_kernel");

  const size_t dq_bytes = with_smem(attention_tc_dq_kernel<T16>, bwd_layout(z.D, false).bytes);
  attention_tc_dq_kernel<T16><<<dim3(tiles, (unsigned)s.NH, (unsigned)s.B), kThreads, dq_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z);
  MT_CUDA_LAUNCHED("attention_tc_dq_kernel");

  MT_CUDA_CHECK(cudaFreeAsync(delta, stream()));
}

}  // namespace

bool attention_tc_supported(int64_t D) { return D >= kF && D <= kMaxD && D % kF == 0; }

void attention_tc_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s, DType dt) {
  check_tc(s, dt, "attention_tc_forward");
  if (s.B == 0 || s.T == 0) return;
  if (dt == DType::bf16)
    forward_typed<__nv_bfloat16>(out, lse, qkv, s);
  else
    forward_typed<half>(out, lse, qkv, s);
}

void attention_tc_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                           const Tensor& lse, const AttentionShape& s, DType dt) {
  check_tc(s, dt, "attention_tc_backward");
  if (s.B == 0 || s.T == 0) return;
  if (dt == DType::bf16)
    backward_typed<__nv_bfloat16>(dqkv, dout, qkv, out, lse, s);
  else
    backward_typed<half>(dqkv, dout, qkv, out, lse, s);
}

}  // namespace mt::cuda
