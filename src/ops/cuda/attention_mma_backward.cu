// Tensor-core causal grouped-query attention BACKWARD on mma.sync.m16n8k16 for D = 64 and
// 128, 16-bit operands (bf16 or f16), fp32 accumulation: the dK/dV and dQ kernels
// attention_tc_backward (attention_tc.cu) runs after its delta kernel where they apply. Same
// semantics, in every rounding step but the fp32 summation order, as the WMMA dK/dV and dQ
// kernels in attention_tc.cu:
//   - q, k, v, dout read in T16, the matrix operands (rounded from fp32 to nearest by the
//     caller where it holds them in fp32: attention_tc_backward; dout by its delta kernel);
//   - s = the fp32-accumulated score of the rounded q, k; p = expf(s * scale - lse) (fp32, the
//     same expression), 0 unless key <= query < T;
//   - dp = the fp32-accumulated dO V^T; ds = p * (dp - delta) * scale (scale = 1/sqrt(D)
//     folded into dS as there), 0 where p is masked; P and dS rounded to T16 as operands;
//   - dV = sum P^T dO, dK = sum dS^T Q over the G query heads of the kv head (in order, then
//     query tiles in order), dQ = sum dS K over key tiles in order; dqkv rows < T overwritten.
// Deterministic: no atomics, each accumulator sums its k-steps in a fixed order, the grid
// depends only on the shapes.
//
// Both kernels: 4 warps (128 threads), 64-row tiles. Shared memory (dynamic): six
// [64][D + 8] T16 tiles (row stride D + 8: the 8 row addresses of an ldmatrix hit distinct
// bank quads, as in the forward): the two the block keeps and two buffers of the two it
// walks; then [64] fp32 vectors (lse, delta), two buffers of them in dK/dV: 56,320 bytes at
// D = 64 (3 blocks per SM), 105,472 at D = 128 (2) (limit raised with cudaFuncSetAttribute).
// Tiles and vectors are copied by cp.async straight into shared memory (zeros past T), the
// next step's into the other buffer while a step computes: one __syncthreads per step.
// Fragment layouts: attention_mma_layout.h (g = lane / 4, t = lane % 4):
//   A operands from shared memory by ldmatrix.x4 (a_ldm_*): 16 rows x 16 cols per x4;
//   B operands of score products (S^T = K Q^T, S = Q K^T) by ldmatrix.x4 (k_ldm_*): 8 rows x
//   32 dims = two k-steps; B operands of the gradient products (P^T dO, dS^T Q, dS K) by
//   ldmatrix.x4.trans (v_ldm_*): 16 rows (k) x 16 dims (two n-tiles of 8);
//   accumulators c_i at (row g + 8 (i / 2), col 2 t + i % 2); the P / dS accumulators of a
//   32-column chunk become the A operand of the k-step over columns [16 st, 16 st + 16) as
//   register j = (acc[p_tile(st, j)][p_elem(j, 0)], acc[..][p_elem(j, 1)]), as in the forward.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/attention_mma_layout.h"
#include "ops/cuda/attention_tc.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/mma_sync.cuh"

namespace mt::cuda {

namespace {

namespace ml = mma_layout;
using namespace mma_sync;

constexpr int kB = kTileRows;  // rows per tile (keys or queries): 64
constexpr int kBW = 4;        // warps per block; warp w owns rows [16 w, 16 w + 16) of its tile
constexpr int kBT = 32 * kBW;  // threads per block
constexpr int kC = 32;        // columns per chunk of the score products (4 accumulators of 8)

struct BwdDims {
  int T, NH, NKV, G;
  int64_t W, OW;
  float scale;
};

// Dynamic shared memory: six tiles (dK/dV: K, V, then Q, dO of buffer 0 and of buffer 1; dQ:
// Q, dO, then K, V of buffer 0 and of buffer 1), then two buffers of the [64] fp32 vectors
// (lse, delta), of which the dQ kernel uses buffer 0.
template <int D> constexpr int bwd_smem_bytes() { return 6 * tile_bytes<D>() + 4 * kB * 4; }

// cp.async of lse[r0 .. r0 + 64) (threads 0..63) and delta[r0 .. r0 + 64) (threads 64..127)
// into the [64] fp32 vectors at shared addresses ls and dl (zeros past T).
__device__ __forceinline__ void issue_vecs(uint32_t ls, const float* __restrict__ lse, uint32_t dl,
                                           const float* __restrict__ delta, int r0, int T) {
  static_assert(kBT == 2 * kB, "one element per thread");
  const int i = threadIdx.x % kB, row = r0 + i;
  const float* src = threadIdx.x < kB ? lse : delta;
  cp_async4((threadIdx.x < kB ? ls : dl) + 4u * (uint32_t)i, row < T ? src + row : src, row < T);
}

// acc[n] (n < kC / 8: columns [8 n, 8 n + 8) of the chunk) += A (16 rows x D, ldmatrix at
// a_lane + 2 (16 kk) bytes per k-step kk) times B^T (B rows = the chunk's columns, at b_lane +
// 2 (8 n LD + 32 c) bytes, two k-steps per x4), k-steps in order. Column blocks n with
// skip(n) true are left alone (zero).
template <class T16, int D, class Skip>
__device__ __forceinline__ void score_chunk(float (&acc)[kC / 8][4], uint32_t a_lane, uint32_t b_lane, Skip skip) {
  constexpr int LD = tile_ld<D>();
  #pragma unroll
  for (int n = 0; n < kC / 8; ++n)
    #pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
  #pragma unroll
  for (int c = 0; c < D / 32; ++c) {
    uint32_t a0[4], a1[4];
    ldsm_x4(a0, a_lane + 2u * (uint32_t)(32 * c));
    ldsm_x4(a1, a_lane + 2u * (uint32_t)(32 * c + 16));
    #pragma unroll
    for (int n = 0; n < kC / 8; ++n) {
      if (skip(n)) continue;
      uint32_t bk[4];
      ldsm_x4(bk, b_lane + 2u * (uint32_t)(8 * n * LD + 32 * c));
      mma16816<T16>(acc[n], a0, bk[0], bk[1]);
      mma16816<T16>(acc[n], a1, bk[2], bk[3]);
    }
  }
}

// One warp's accumulators acc[D / 8] (rows row0 + g + 8 (i / 2), cols 8 n + 2 t + i % 2) to
// dst (row stride ld), rows < T, float2 stores.
template <int D>
__device__ __forceinline__ void store_acc(float* dst, int64_t ld, int row0, int T, const float (&acc)[D / 8][4]) {
  const int lane = threadIdx.x % 32;
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + ml::c_row(lane, 2 * r);
    if (row >= T) continue;
    float* drow = dst + (int64_t)row * ld;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(drow + 8 * n + ml::c_col(lane, 0)) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
  }
}

// dK, dV: attention_mma_dkv_kernel<T16, D>. Grid (ceil(T / 64), NKV, B), 128 threads; block
// x owns keys k0 = 64 x + [0, 64) of kv head kh = y, batch b = z (x = 0, the longest, first);
// warp w the 16 keys wk = k0 + 16 w + [0, 16), its dK, dV [16 keys, D] in registers
// (dk[D / 8][4], dv[D / 8][4]: accumulator layout, row = key, col = dim). Ks, Vs: the
// block's keys, loaded once; step j = 0, 1, ... walks each query head h = kh G + g (g in
// order) and, within it, the query tiles q0 = k0, k0 + 64, ... < T (in order): Qs, dOs
// (queries [q0, q0 + 64)), lse and delta of step j lie in buffer j % 2, copied by cp.async
// during step j - 1 (step 0's with Ks, Vs); warp w walks the tile's two 32-query chunks
// (skipping one wholly before its keys): S^T = K_w Q^T, dP^T = V_w dO^T (score_chunk: A = K_w
// / V_w rows by a_ldm, B = Q / dO rows by k_ldm; s[n][i] at key wk + g + 8 (i / 2), query
// 8 n + 2 t + i % 2 of the chunk), P^T and dS^T elementwise in place, then dV += P^T dO,
// dK += dS^T Q (pv_product: A = the accumulators, B = dO / Q by v_ldm .trans, k = query,
// n = dim).
template <class T16, int D>
__global__ void __launch_bounds__(kBT, D <= 64 ? 3 : 2)
    attention_mma_dkv_kernel(float* __restrict__ dqkv, const T16* __restrict__ qkv, const T16* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta, BwdDims z) {
  static_assert(D == 64 || D == 128, "D = 64 or 128");
  constexpr int LD = tile_ld<D>();
  constexpr uint32_t kTileB = tile_bytes<D>();
  // tiles: K, V, then (Q, dO) of buffer 0 and of buffer 1; then (lse, delta) of buffers 0, 1
  extern __shared__ __align__(128) unsigned char smem[];
  const float* vecs = reinterpret_cast<const float*>(smem + 6 * kTileB);  // [2][lse, delta][64]

  const int k0 = blockIdx.x * kB, kh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wk = k0 + 16 * warp;
  const T16* base = qkv + (int64_t)b * z.T * z.W;
  const uint32_t ks = (uint32_t)__cvta_generic_to_shared(smem), vs = ks + kTileB;
  const uint32_t vec_s = ks + 6 * kTileB;
  const int nq = (z.T - k0 + kB - 1) / kB, steps = z.G * nq;  // query tiles per head (k0 < T), steps
  // Step j's Q, dO, lse, delta (head kh G + j / nq, queries from k0 + 64 (j % nq)) into buffer j % 2.
  auto issue_step = [&](int j) {
    const int h = kh * z.G + j / nq, q0 = k0 + kB * (j % nq);
    const int64_t bh = (int64_t)b * z.NH + h;
    const uint32_t qs = ks + (2 + 2 * (j % 2)) * kTileB, vb = vec_s + (uint32_t)(j % 2) * 2 * kB * 4;
    issue_tile<T16, D, kBT>(qs, base + (int64_t)h * D, z.W, q0, z.T);
    issue_tile<T16, D, kBT>(qs + kTileB, dout + (int64_t)b * z.T * z.OW + (int64_t)h * D, z.OW, q0, z.T);
    issue_vecs(vb, lse + bh * z.T, vb + kB * 4, delta + bh * z.T, q0, z.T);
  };
  issue_tile<T16, D, kBT>(ks, base + (int64_t)(z.NH + kh) * D, z.W, k0, z.T);
  issue_tile<T16, D, kBT>(vs, base + (int64_t)(z.NH + z.NKV + kh) * D, z.W, k0, z.T);
  issue_step(0);
  cp_async_commit();

  const uint32_t a_off = 2u * (uint32_t)((16 * warp + ml::a_ldm_row(lane)) * LD + ml::a_ldm_col(lane));
  const uint32_t b_off = 2u * (uint32_t)(ml::k_ldm_key(lane) * LD + ml::k_ldm_dim(lane));
  const uint32_t bt_off = 2u * (uint32_t)(ml::v_ldm_key(lane) * LD + ml::v_ldm_dim(lane));

  float dk[D / 8][4], dv[D / 8][4];
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;

  for (int j = 0; j < steps; ++j) {
    cp_async_wait_all();  // this thread's copies of step j (and at j = 0 of K, V) have landed
    __syncthreads();      // every thread's have; every warp is done with step j - 1's buffer
    if (j + 1 < steps) {  // step j + 1's tiles in flight into the other buffer during this step
      issue_step(j + 1);
      cp_async_commit();
    }
    const int q0 = k0 + kB * (j % nq);
    const uint32_t qs = ks + (2 + 2 * (j % 2)) * kTileB, dos = qs + kTileB;
    const float* Ls = vecs + (j % 2) * 2 * kB;  // [64]
    const float* Dl = Ls + kB;                  // [64]
    #pragma unroll 1
    for (int qc = 0; qc < kB; qc += kC) {
      const int qa = q0 + qc;  // the chunk's first query
      if (qa + kC - 1 < wk) continue;  // every query precedes every key of the warp: P = 0
      float s[kC / 8][4], dp[kC / 8][4];
      auto skip8 = [&](int n) { return qa + 8 * n + 7 < wk; };  // 8 queries all before the keys
      score_chunk<T16, D>(s, ks + a_off, qs + b_off + 2u * (uint32_t)(qc * LD), skip8);
      score_chunk<T16, D>(dp, vs + a_off, dos + b_off + 2u * (uint32_t)(qc * LD), skip8);
      #pragma unroll
      for (int n = 0; n < kC / 8; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = wk + ml::c_row(lane, i), ql = qc + 8 * n + ml::c_col(lane, i), t = q0 + ql;
          const bool seen = key <= t && t < z.T;
          const float p = seen ? expf(s[n][i] * z.scale - Ls[ql]) : 0.0f;
          const float ds = seen ? p * (dp[n][i] - Dl[ql]) * z.scale : 0.0f;
          s[n][i] = p;
          dp[n][i] = ds;
        }
      auto skip16 = [&](int st) { return qa + 16 * st + 15 < wk; };
      pv_product<T16, D, kC>(dv, s, dos + bt_off + 2u * (uint32_t)(qc * LD), skip16);
      pv_product<T16, D, kC>(dk, dp, qs + bt_off + 2u * (uint32_t)(qc * LD), skip16);
    }
  }
  float* rows = dqkv + (int64_t)b * z.T * z.W;
  store_acc<D>(rows + (int64_t)(z.NH + kh) * D, z.W, wk, z.T, dk);
  store_acc<D>(rows + (int64_t)(z.NH + z.NKV + kh) * D, z.W, wk, z.T, dv);
}

// dQ: attention_mma_dq_kernel<T16, D>. Grid (ceil(T / 64), NH, B), 128 threads; block x owns
// the query rows q0 = 64 qt + [0, 64), qt = gridDim.x - 1 - x (the longest first), of head
// h = y, batch b = z; warp w the 16 rows wq = q0 + 16 w + [0, 16), its dQ [16, D] in
// registers (dq[D / 8][4]). Qs, dOs, lse, delta: loaded once; the key tiles k0 = 64 j,
// j = 0, 1, ..., q0 / 64 (in order) lie in buffer j % 2, copied by cp.async during step j - 1
// (step 0's with Qs, dOs); warp w walks the tile's two 32-key chunks in order, stopping at
// the first wholly after its rows: S = Q_w K^T, dP = dO_w V^T (score_chunk: A = Q_w / dO_w
// rows by a_ldm, B = K / V rows by k_ldm; s[n][i] at row wq + g + 8 (i / 2), key 8 n + 2 t +
// i % 2 of the chunk), P, dS elementwise, then dQ += dS K (pv_product: A = the dS
// accumulators, B = K by v_ldm .trans, k = key, n = dim).
template <class T16, int D>
__global__ void __launch_bounds__(kBT, D <= 64 ? 3 : 2)
    attention_mma_dq_kernel(float* __restrict__ dqkv, const T16* __restrict__ qkv, const T16* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta, BwdDims z) {
  static_assert(D == 64 || D == 128, "D = 64 or 128");
  constexpr int LD = tile_ld<D>();
  constexpr uint32_t kTileB = tile_bytes<D>();
  // tiles: Q, dO, then (K, V) of buffer 0 and of buffer 1; then lse, delta
  extern __shared__ __align__(128) unsigned char smem[];
  const float* Ls = reinterpret_cast<const float*>(smem + 6 * kTileB);  // [64]
  const float* Dl = Ls + kB;                                             // [64]

  const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * kB, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wq = q0 + 16 * warp;
  const int64_t bh = (int64_t)b * z.NH + h;
  const T16* base = qkv + (int64_t)b * z.T * z.W;
  const T16* Kg = base + (int64_t)(z.NH + kh) * D;
  const T16* Vg = base + (int64_t)(z.NH + z.NKV + kh) * D;
  const uint32_t qs = (uint32_t)__cvta_generic_to_shared(smem), dos = qs + kTileB;
  const uint32_t ls = qs + 6 * kTileB;
  issue_tile<T16, D, kBT>(qs, base + (int64_t)h * D, z.W, q0, z.T);
  issue_tile<T16, D, kBT>(dos, dout + (int64_t)b * z.T * z.OW + (int64_t)h * D, z.OW, q0, z.T);
  issue_vecs(ls, lse + bh * z.T, ls + kB * 4, delta + bh * z.T, q0, z.T);
  issue_tile<T16, D, kBT>(qs + 2 * kTileB, Kg, z.W, 0, z.T);  // key tile 0 into buffer 0
  issue_tile<T16, D, kBT>(qs + 3 * kTileB, Vg, z.W, 0, z.T);
  cp_async_commit();

  const uint32_t a_off = 2u * (uint32_t)((16 * warp + ml::a_ldm_row(lane)) * LD + ml::a_ldm_col(lane));
  const uint32_t b_off = 2u * (uint32_t)(ml::k_ldm_key(lane) * LD + ml::k_ldm_dim(lane));
  const uint32_t bt_off = 2u * (uint32_t)(ml::v_ldm_key(lane) * LD + ml::v_ldm_dim(lane));

  float dq[D / 8][4];
  #pragma unroll
  for (int n = 0; n < D / 8; ++n)
    #pragma unroll
    for (int i = 0; i < 4; ++i) dq[n][i] = 0.0f;

  for (int j = 0; j <= qt; ++j) {
    cp_async_wait_all();  // this thread's copies of key tile j (and at j = 0 of Q, dO, lse, delta) landed
    __syncthreads();      // every thread's have; every warp is done with key tile j - 1's buffer
    if (j < qt) {         // key tile j + 1 in flight into the other buffer during this one
      const uint32_t next = qs + (2 + 2 * ((j + 1) % 2)) * kTileB;
      issue_tile<T16, D, kBT>(next, Kg, z.W, kB * (j + 1), z.T);
      issue_tile<T16, D, kBT>(next + kTileB, Vg, z.W, kB * (j + 1), z.T);
      cp_async_commit();
    }
    const int k0 = kB * j;
    const uint32_t ks = qs + (2 + 2 * (j % 2)) * kTileB, vs = ks + kTileB;
    #pragma unroll 1
    for (int kc = 0; kc < kB; kc += kC) {
      const int ka = k0 + kc;  // the chunk's first key
      if (ka > wq + 15) break;  // every key follows every row of the warp (so do later chunks)
      float s[kC / 8][4], dp[kC / 8][4];
      auto skip8 = [&](int n) { return ka + 8 * n > wq + 15; };  // 8 keys all after the rows
      score_chunk<T16, D>(s, qs + a_off, ks + b_off + 2u * (uint32_t)(kc * LD), skip8);
      score_chunk<T16, D>(dp, dos + a_off, vs + b_off + 2u * (uint32_t)(kc * LD), skip8);
      #pragma unroll
      for (int n = 0; n < kC / 8; ++n)
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int rl = 16 * warp + ml::c_row(lane, i), t = q0 + rl, key = ka + 8 * n + ml::c_col(lane, i);
          const bool seen = key <= t && t < z.T;
          const float p = seen ? expf(s[n][i] * z.scale - Ls[rl]) : 0.0f;
          dp[n][i] = seen ? p * (dp[n][i] - Dl[rl]) * z.scale : 0.0f;
        }
      auto skip16 = [&](int st) { return ka + 16 * st > wq + 15; };
      pv_product<T16, D, kC>(dq, dp, ks + bt_off + 2u * (uint32_t)(kc * LD), skip16);
    }
  }
  store_acc<D>(dqkv + (int64_t)b * z.T * z.W + (int64_t)h * D, z.W, wq, z.T, dq);
}

template <class Kernel>
void prepare(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
}

template <class T16, int D>
void launch(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse, const float* delta,
            const AttentionShape& s) {
  constexpr int bytes = bwd_smem_bytes<D>();
  static_assert(bytes <= 227 * 1024, "shared memory above the H100's 227 KiB per block");
  BwdDims z;
  z.T = (int)s.T;
  z.NH = (int)s.NH;
  z.NKV = (int)s.NKV;
  z.G = (int)s.G;
  z.W = s.W;
  z.OW = s.NH * s.D;
  z.scale = 1.0f / std::sqrt((float)s.D);  // as the WMMA backward
  const unsigned tiles = (unsigned)ceil_div(s.T, kB);
  auto dkv = attention_mma_dkv_kernel<T16, D>;
  prepare(dkv, bytes);
  const T16* q16 = static_cast<const T16*>(qkv.raw());
  const T16* d16 = static_cast<const T16*>(dout.raw());
  dkv<<<dim3(tiles, (unsigned)s.NKV, (unsigned)s.B), kBT, bytes, stream()>>>(dqkv.f32(), q16, d16, lse.f32(), delta,
                                                                           z);
  MT_CUDA_LAUNCHED("attention_mma_dkv_kernel");
  auto dq = attention_mma_dq_kernel<T16, D>;
  prepare(dq, bytes);
  dq<<<dim3(tiles, (unsigned)s.NH, (unsigned)s.B), kBT, bytes, stream()>>>(dqkv.f32(), q16, d16, lse.f32(), delta, z);
  MT_CUDA_LAUNCHED("attention_mma_dq_kernel");
}

template <class T16>
void launch_typed(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse, const float* delta,
                  const AttentionShape& s) {
  if (s.D == 64)
    launch<T16, 64>(dqkv, dout, qkv, lse, delta, s);
  else
    launch<T16, 128>(dqkv, dout, qkv, lse, delta, s);
}

}  // namespace

bool attention_mma_backward_aligned(const Tensor& dqkv, const Tensor& qkv) {
  // an fp32 qkv is converted into (256-byte aligned) scratch first, as dout always is
  return (qkv.dtype() == DType::f32 || reinterpret_cast<uintptr_t>(qkv.raw()) % 16 == 0) &&
         reinterpret_cast<uintptr_t>(dqkv.f32()) % 8 == 0;
}

void attention_mma_backward_kernels(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse,
                                    const float* delta, const AttentionShape& s, DType dt) {
  MT_CHECK(attention_mma_supported(s.D), "attention_mma_backward: head dim D = " << s.D << " not supported (64, 128)");
  MT_CHECK(dt == DType::bf16 || dt == DType::f16,
           "attention_mma_backward: 16-bit dtype expected, got " << dtype_name(dt));
  MT_CHECK(qkv.dtype() == dt && dout.dtype() == dt, "attention_mma_backward: qkv and dout in "
                                                        << dtype_name(qkv.dtype()) << " and " << dtype_name(dout.dtype())
                                                        << ", expected " << dtype_name(dt));
  MT_CHECK(attention_mma_backward_aligned(dqkv, qkv) && reinterpret_cast<uintptr_t>(dout.raw()) % 16 == 0,
           "attention_mma_backward: qkv, dout must be 16-byte and dqkv 8-byte aligned");
  if (s.B == 0 || s.T == 0) return;
  if (dt == DType::bf16)
    launch_typed<__nv_bfloat16>(dqkv, dout, qkv, lse, delta, s);
  else
    launch_typed<half>(dqkv, dout, qkv, lse, delta, s);
}

}  // namespace mt::cuda
