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
// tiles with kLdP = 72, fp32 staging with ldo = D + 4 (forward; 68 in the score tile at
// D <= 64) or 16 (backward). Every array starts 128-byte aligned, so every fragment
// pointer (row multiple of 16, column multiple of 16) is 32-byte aligned. The kernels are templated on D (16 .. 128, a switch on
// the host) so the running accumulators (O; dK, dV; dQ: D / 16 fragments per warp) live in
// registers across the whole loop; the forward rescales O through shared memory only when
// its lazily updated row max moves (see the forward kernel).
//
// Shared memory: forward 54,272 bytes at D = 64 (O staged in the score tile) and 112,640 at
// D = 128; both backward
// kernels 49,664 at D = 64 and 82,432 at D = 128 (the limit is raised with
// cudaFuncSetAttribute; the H100 allows 227 KB per block and 228 KB per SM).
//
// Determinism: no atomics. Warp reductions are butterflies; every fragment product sums
// its k-steps in a fixed order, accumulators run over key tiles (forward, dQ) or query
// heads of the group then query tiles (dK/dV) in order, 16-row / 16-key chunks in order
// within a tile; whether a chunk is skipped (wholly masked) or O is rescaled depends only on
// the shapes and the data. The grid depends only on shapes.
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

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
// The forward's O staging (rescale, final store) has row stride ld_fo(D); at D <= 64 it fits
// in the warp's own rows of the score tile (D + 4 <= kLdS) and shares its memory.
__host__ __device__ inline int ld_fo(int D) { return D <= kTile ? kLdS : ld_o(D); }
__host__ __device__ inline FwdLayout fwd_layout(int D) {
  const size_t h16 = (size_t)kTile * ld_h(D) * 2;
  FwdLayout L;
  size_t off = 0;
  L.q = carve(off, h16);
  L.k = carve(off, h16);
  L.v = carve(off, h16);
  L.s = carve(off, (size_t)kTile * kLdS * 4);
  L.p = carve(off, (size_t)kTile * kLdP * 2);
  L.o = D <= kTile ? L.s : carve(off, (size_t)kTile * ld_o(D) * 4);
  L.bytes = off;
  return L;
}
template <class T16> __device__ __forceinline__ T16 to16(float x);
template <> __device__ __forceinline__ __nv_bfloat16 to16<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ half to16<half>(float x) { return __float2half_rn(x); }
template <class T16> __device__ __forceinline__ float from16(T16 x);
template <> __device__ __forceinline__ float from16<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float from16<half>(half x) { return __half2float(x); }

__device__ __forceinline__ float warp_sum(float v) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// dst[64] (shared) = src[r0 .. r0 + 64) (global), zeros past T.
__device__ void load_vec(float* dst, const float* src, int r0, int T) {
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) dst[r] = r0 + r < T ? src[r0 + r] : 0.0f;
}

using FragAcc = wmma::fragment<wmma::accumulator, kF, kF, kF, float>;
template <class T16, class Layout> using FragA = wmma::fragment<wmma::matrix_a, kF, kF, kF, T16, Layout>;
template <class T16, class Layout> using FragB = wmma::fragment<wmma::matrix_b, kF, kF, kF, T16, Layout>;

// dst[64, D + 8] (shared, T16) = rows [r0, r0 + 64) of a [T, D] fp32 matrix at src with row
// stride ld_src (global), rounded to T16; rows >= T are zeros. All threads take part.
template <class T16, int D>
__device__ __forceinline__ void load_rows16(T16* dst, const float* src, int64_t ld_src, int r0, int T) {
  constexpr int ldh = D + 8;
  #pragma unroll 4
  for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
    const int r = idx / D, d = idx % D, row = r0 + r;
    dst[r * ldh + d] = to16<T16>(row < T ? src[(int64_t)row * ld_src + d] : 0.0f);
  }
}

// One warp: C[16, 16] (fp32, row stride ldc, shared) = A[16, :D] B[16, :D]^T, A and B 16-row
// slices of [*, D + 8] T16 tiles (k-steps over D in order).
template <class T16, int D>
__device__ __forceinline__ void warp_abt16(float* C, const T16* A, const T16* B, int ldc) {
  constexpr int ldh = D + 8;
  FragAcc acc;
  wmma::fill_fragment(acc, 0.0f);
  #pragma unroll
  for (int kk = 0; kk < D; kk += kF) {
    FragA<T16, wmma::row_major> a;
    FragB<T16, wmma::col_major> b;  // B^T[kk.., 0..16) read from B's rows
    wmma::load_matrix_sync(a, A + kk, ldh);
    wmma::load_matrix_sync(b, B + kk, ldh);
    wmma::mma_sync(acc, a, b, acc);
  }
  wmma::store_matrix_sync(C, acc, ldc, wmma::mem_row_major);
}

// Forward. Grid (ceil(T / 64), NH, B), 128 threads: the block takes query rows
// [q0, q0 + 64) of head h of batch b and walks the key tiles k0 = 0, 64, ..., q0 (the last
// is the diagonal tile). Per tile, warp w on its 16 rows: S = Q K^T (WMMA, staged in shared);
// per row (a pair of lanes, 32 keys each, in a fixed per-lane order, then one shuffle) the
// tile's max; P = exp(scale S - m) as T16 and l += sum P; then O += P V into register
// fragments (D / 16 per warp). m is a lazily updated reference max: it moves only when a
// tile's max exceeds it by more than kSlack (P <= e^kSlack: harmless in fp32, relative for
// the 16-bit rounding of P, and below f16's 65504 as long as kSlack < 11), and only then
// (almost always on the first tiles only, where O is still zero) the warp's O fragments go
// through shared memory to be rescaled per row. out = O / l, lse = m + log l
// for the rows < T (exactly the softmax: any reference m gives the same out and lse).
constexpr float kSlack = 8.0f;
template <class T16, int D>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 4 : 2)
    attention_tc_forward_kernel(float* __restrict__ out, float* __restrict__ lse, const float* __restrict__ qkv,
                                TcDims z) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldh = D + 8, NF = D / kF;
  const int ldo = ld_fo(D);
  const FwdLayout L = fwd_layout(D);
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);      // [64, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);      // [64, ldh]
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);      // [64, ldh]
  float* Ss = reinterpret_cast<float*>(smem + L.s);  // [64, kLdS] scores
  T16* Ps = reinterpret_cast<T16*>(smem + L.p);      // [64, kLdP] probabilities
  float* Os = reinterpret_cast<float*>(smem + L.o);  // [64, ldo] O staging (rescale, final store); may alias Ss
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * kF;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  const float* Kg = base + (int64_t)(z.NH + kh) * D;
  const float* Vg = base + (int64_t)(z.NH + z.NKV + kh) * D;
  load_rows16<T16, D>(Qs, base + (int64_t)h * D, z.W, q0, z.T);

  FragAcc o[NF];  // the warp's O [16 rows, D], column blocks of 16
  #pragma unroll
  for (int n = 0; n < NF; ++n) wmma::fill_fragment(o[n], 0.0f);
  // Softmax lanes: lanes 2 r and 2 r + 1 take row r0 + r of the warp, lane half hf the keys
  // [32 hf, 32 hf + 32) of each tile, visited from a per-lane rotation rot so that the 32
  // lanes' reads of Ss hit 32 different banks (bank = 4 r + rot + j mod 32, rot = 2 hf + r / 8).
  // m, l: the row's reference max and sum (the same in both lanes of the pair).
  const int sr = lane / 2, hf = lane % 2, rot = 2 * hf + sr / 8;
  const int si = r0 + sr, st = q0 + si;  // the lane's row in the tile, its query
  float m = -INFINITY, l = 0.0f;
  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K, V (and Q is loaded)
    load_rows16<T16, D>(Ks, Kg, z.W, k0, z.T);
    load_rows16<T16, D>(Vs, Vg, z.W, k0, z.T);
    __syncthreads();
    #pragma unroll 1
    for (int n = 0; n < kTile; n += kF) warp_abt16<T16, D>(Ss + r0 * kLdS + n, Qs + r0 * ldh, Ks + n * ldh, kLdS);
    __syncwarp();
    float rescale_a;  // the lane's row's rescale factor
    bool rescale;     // whether any row of the warp rescales
    {
      const float* srow = Ss + si * kLdS + 32 * hf;  // the lane's 32 scores
      T16* prow = Ps + si * kLdP + 32 * hf;          // the lane's 32 probabilities
      const int key0 = k0 + 32 * hf;                 // the lane's first key
      // the tile's row max; key k0 <= q0 <= st and k0 < T: every row sees a key of every
      // tile, so the pair's max mt is finite (one half may see none: -inf there)
      float mx = -INFINITY;
      for (int j = 0; j < 32; ++j) {
        const int x = (j + rot) & 31, key = key0 + x;
        if (key <= st && key < z.T) mx = fmaxf(mx, srow[x] * z.scale);
      }
      const float mt = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      float a = 1.0f;  // the row's rescale factor (1: m unchanged)
      bool need = false;
      if (mt > m + kSlack) {  // the same in both lanes of the pair
        if (m != -INFINITY) {  // O and l hold earlier tiles: rescale them
          a = expf(m - mt);
          need = true;
        }
        m = mt;
      }
      float sum = 0.0f;
      for (int j = 0; j < 32; ++j) {
        const int x = (j + rot) & 31, key = key0 + x;
        const float p = key <= st && key < z.T ? expf(srow[x] * z.scale - m) : 0.0f;
        sum += p;
        prow[x] = to16<T16>(p);
      }
      l = a * l + (sum + __shfl_xor_sync(0xffffffffu, sum, 1));  // a + b = b + a: same bits in the pair
      rescale_a = a;
      rescale = __any_sync(0xffffffffu, need);  // warp-uniform
    }
    if (rescale) {  // warp-uniform
      __syncwarp();  // the warp's reads of its Ss rows are done (Os may alias them)
      #pragma unroll
      for (int n = 0; n < NF; ++n) wmma::store_matrix_sync(Os + r0 * ldo + n * kF, o[n], ldo, wmma::mem_row_major);
      __syncwarp();
      for (int d = hf; d < D; d += 2) Os[si * ldo + d] *= rescale_a;  // the pair's row
      __syncwarp();
      #pragma unroll
      for (int n = 0; n < NF; ++n) wmma::load_matrix_sync(o[n], Os + r0 * ldo + n * kF, ldo, wmma::mem_row_major);
    }
    __syncwarp();
    // O[r0 .., :] += P[r0 .., 0 .. 64) V (k-steps over the tile's keys in order)
    #pragma unroll
    for (int kk = 0; kk < kTile; kk += kF) {
      FragA<T16, wmma::row_major> pa;
      wmma::load_matrix_sync(pa, Ps + r0 * kLdP + kk, kLdP);
      #pragma unroll
      for (int n = 0; n < NF; ++n) {
        FragB<T16, wmma::row_major> bv;
        wmma::load_matrix_sync(bv, Vs + kk * ldh + n * kF, ldh);
        wmma::mma_sync(o[n], pa, bv, o[n]);
      }
    }
    __syncwarp();  // the warp's reads of Ss, Ps are done before the next tile rewrites them
  }
  // (the loop ended with __syncwarp: the warp's Ss / Ps reads are done, Os may alias Ss)
  #pragma unroll
  for (int n = 0; n < NF; ++n) wmma::store_matrix_sync(Os + r0 * ldo + n * kF, o[n], ldo, wmma::mem_row_major);
  __syncwarp();
  if (hf == 0 && st < z.T) lse[((int64_t)b * z.NH + h) * z.T + st] = m + logf(l);
  #pragma unroll
  for (int r = 0; r < kF; ++r) {
    const int i = r0 + r, t = q0 + i;
    const float lr = __shfl_sync(0xffffffffu, l, 2 * r);  // row r's sum (every lane takes part)
    if (t >= z.T) continue;
    const float inv = 1.0f / lr;  // every row < T sees key 0, so l > 0
    float* orow = out + ((int64_t)b * z.T + t) * z.OW + (int64_t)h * D;
    for (int d = lane; d < D; d += 32) orow[d] = Os[i * ldo + d] * inv;
  }
}

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float as_float(half x) { return __half2float(x); }

// delta[b, h, t] = round16(dout[b, t, h]) . out[b, t, h] (D-vectors; dout rounded as in the
// dP = dO V^T product, so dP - delta stays consistent; out (O) in fp32 or already in T16).
// dout16, where given: the rounded dout written there too, the mma kernels' operand. One warp
// per (b, h, t) row: lanes sum columns lane, lane + 32, ... in order, then a butterfly. Grid
// ceil(rows / 4), 128.
template <class T16, class O>
__global__ void attention_tc_delta_kernel(float* __restrict__ delta, T16* __restrict__ dout16,
                                          const float* __restrict__ dout, const O* __restrict__ out, int64_t rows,
                                          TcDims z) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  const int64_t t = row % z.T, bh = row / z.T, h = bh % z.NH, b = bh / z.NH;
  const int64_t at = (b * z.T + t) * z.OW + h * z.D;
  float s = 0.0f;
  for (int d = lane; d < z.D; d += 32) {
    const T16 r = to16<T16>(dout[at + d]);
    if (dout16 != nullptr) dout16[at + d] = r;
    s += from16<T16>(r) * as_float(out[at + d]);
  }
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// ---- Backward ----------------------------------------------------------------------------
// Both backward kernels keep their fp32 accumulators (dK and dV, or dQ: the warp's 16 rows x
// D columns, D / 16 fragments each) in WMMA accumulator fragments in registers for the whole
// loop: no rescaling is needed (P is recomputed from the final lse), so nothing goes through
// shared memory until the one store at the end. Each warp works on 16 x 16 chunks of the
// score matrix that involve only its own 16 rows, staged through a per-warp 16 x 16 shared
// tile (fp32 S, dP; 16-bit P, dS) to apply the elementwise softmax gradient (the fragment
// layout is opaque), so within a tile only __syncwarp is needed; __syncthreads only guards
// the operand tiles every warp reads (Q / dO in dK/dV, K / V in dQ).

// One warp: global rows row0 .. row0 + 16 (those < T) at dst (row stride ld), columns
// 0 .. D = the accumulator fragments acc[D / 16] (column blocks in order), staged through the
// warp's fp32 [16, 16] tile St.
template <int D>
__device__ __forceinline__ void warp_store_rows(float* dst, int64_t ld, int row0, int T, const FragAcc (&acc)[D / kF],
                                                float* St) {
  const int lane = threadIdx.x % 32;
  #pragma unroll
  for (int n = 0; n < D / kF; ++n) {
    __syncwarp();  // the previous readers of St are done
    wmma::store_matrix_sync(St, acc[n], kF, wmma::mem_row_major);
    __syncwarp();
    #pragma unroll
    for (int e = 0; e < kF * kF / 32; ++e) {
      const int idx = lane + 32 * e, r = idx / kF, j = idx % kF;
      if (row0 + r < T) dst[(int64_t)(row0 + r) * ld + n * kF + j] = St[idx];
    }
  }
}

// Blocks per SM the backward kernels ask ptxas to fit by registers (65536 / (128 threads x
// blocks) registers per thread: 128 at D <= 64, 170 at D <= 96, 255 above), matching what
// their shared memory allows (4, 3, 2 blocks of the H100's 228 KB).
constexpr int bwd_min_blocks(int D) { return D <= 64 ? 4 : D <= 96 ? 3 : 2; }

// Backward shared memory: the four [64, D + 8] T16 operand tiles, lse and delta of the
// query tile, and per warp the [16, 16] staging tiles S, dP (fp32) and P, dS (T16). D = 64:
// 49,664 bytes; D = 128: 82,432 (both kernels use this layout; dQ leaves P unused).
constexpr int kStage = kF * kF;  // elements of one per-warp staging tile
struct BwdLayout {
  size_t q, dout, k, v, lse, delta, s, dp, p, ds, bytes;
};
inline BwdLayout bwd_layout(int D) {
  const size_t h16 = (size_t)kTile * ld_h(D) * 2;
  BwdLayout L;
  size_t off = 0;
  L.q = carve(off, h16);
  L.dout = carve(off, h16);
  L.k = carve(off, h16);
  L.v = carve(off, h16);
  L.lse = carve(off, kTile * 4);
  L.delta = carve(off, kTile * 4);
  L.s = carve(off, (size_t)kWarps * kStage * 4);
  L.dp = carve(off, (size_t)kWarps * kStage * 4);
  L.p = carve(off, (size_t)kWarps * kStage * 2);
  L.ds = carve(off, (size_t)kWarps * kStage * 2);
  L.bytes = off;
  return L;
}
// dK, dV. Grid (ceil(T / 64), NKV, B), 128 threads: the block owns keys [k0, k0 + 64) of kv
// head kh of batch b, warp w the 16 keys k0 + 16 w ... For each query head h of the group
// (in order) and query tile q0 = k0, k0 + 64, ... < T (all threads load Q, dO, lse, delta),
// warp w walks the tile's four 16-query chunks c in order (skipping those wholly before its
// keys, which contribute exact zeros): S^T = K_w Q_c^T, dP^T = V_w dO_c^T (WMMA), then per
// element P^T = exp(scale S^T - lse_q), dS^T = scale P^T (dP^T - delta_q) (0 unless key <=
// query < T) as T16, then dV_w += P^T dO_c, dK_w += dS^T Q_c into register fragments.
// Writes the block's dK and dV rows < T (overwriting).
template <class T16, int D>
__global__ void __launch_bounds__(kThreads, bwd_min_blocks(D))
    attention_tc_dkv_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv, const float* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta, TcDims z, BwdLayout L) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldh = D + 8, NF = D / kF;
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);       // [64 queries, ldh]
  T16* dOs = reinterpret_cast<T16*>(smem + L.dout);   // [64 queries, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);       // [64 keys, ldh] the block's keys
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);       // [64 keys, ldh]
  float* Ls = reinterpret_cast<float*>(smem + L.lse);    // [64]
  float* Ds = reinterpret_cast<float*>(smem + L.delta);  // [64]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * kF;
  float* Sst = reinterpret_cast<float*>(smem + L.s) + warp * kStage;    // [16 keys, 16 queries]
  float* dPst = reinterpret_cast<float*>(smem + L.dp) + warp * kStage;  // [16 keys, 16 queries]
  T16* Pst = reinterpret_cast<T16*>(smem + L.p) + warp * kStage;        // [16 keys, 16 queries]
  T16* dSst = reinterpret_cast<T16*>(smem + L.ds) + warp * kStage;      // [16 keys, 16 queries]
  const int k0 = blockIdx.x * kTile, kh = blockIdx.y, b = blockIdx.z;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_rows16<T16, D>(Ks, base + (int64_t)(z.NH + kh) * D, z.W, k0, z.T);
  load_rows16<T16, D>(Vs, base + (int64_t)(z.NH + z.NKV + kh) * D, z.W, k0, z.T);

  FragAcc dk[NF], dv[NF];  // the warp's dK, dV [16 keys, D], column blocks of 16
  #pragma unroll
  for (int n = 0; n < NF; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int g = 0; g < z.G; ++g) {
    const int h = kh * z.G + g;
    const int64_t bh = (int64_t)b * z.NH + h;
    for (int q0 = k0; q0 < z.T; q0 += kTile) {
      __syncthreads();  // every warp is done with the previous Q / dO / lse / delta (and K, V loaded)
      load_rows16<T16, D>(Qs, base + (int64_t)h * D, z.W, q0, z.T);
      load_rows16<T16, D>(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * D, z.OW, q0, z.T);
      load_vec(Ls, lse + bh * z.T, q0, z.T);
      load_vec(Ds, delta + bh * z.T, q0, z.T);
      __syncthreads();
      #pragma unroll 1
      for (int c = 0; c < kTile / kF; ++c) {
        const int qc = c * kF;  // the chunk's first query row in the tile
        if (q0 + qc + kF - 1 < k0 + r0) continue;  // every query precedes every key of the warp: P = 0
        warp_abt16<T16, D>(Sst, Ks + r0 * ldh, Qs + qc * ldh, kF);
        warp_abt16<T16, D>(dPst, Vs + r0 * ldh, dOs + qc * ldh, kF);
        __syncwarp();
        #pragma unroll
        for (int e = 0; e < kStage / 32; ++e) {
          const int idx = lane + 32 * e, r = idx / kF, j = idx % kF;
          const int key = k0 + r0 + r, t = q0 + qc + j;
          const bool seen = key <= t && t < z.T;
          const float p = seen ? expf(Sst[idx] * z.scale - Ls[qc + j]) : 0.0f;
          const float ds = seen ? p * (dPst[idx] - Ds[qc + j]) * z.scale : 0.0f;
          Pst[idx] = to16<T16>(p);
          dSst[idx] = to16<T16>(ds);
        }
        __syncwarp();
        FragA<T16, wmma::row_major> pa, dsa;
        wmma::load_matrix_sync(pa, Pst, kF);
        wmma::load_matrix_sync(dsa, dSst, kF);
        #pragma unroll
        for (int n = 0; n < NF; ++n) {
          FragB<T16, wmma::row_major> bm;
          wmma::load_matrix_sync(bm, dOs + qc * ldh + n * kF, ldh);
          wmma::mma_sync(dv[n], pa, bm, dv[n]);
          wmma::load_matrix_sync(bm, Qs + qc * ldh + n * kF, ldh);
          wmma::mma_sync(dk[n], dsa, bm, dk[n]);
        }
      }
    }
  }
  float* rows = dqkv + (int64_t)b * z.T * z.W;
  warp_store_rows<D>(rows + (int64_t)(z.NH + kh) * D, z.W, k0 + r0, z.T, dk, Sst);
  warp_store_rows<D>(rows + (int64_t)(z.NH + z.NKV + kh) * D, z.W, k0 + r0, z.T, dv, dPst);
}

// dQ. Grid (ceil(T / 64), NH, B), 128 threads: the block owns query rows [q0, q0 + 64) of
// head h of batch b, warp w the 16 rows q0 + 16 w ... For each key tile k0 = 0, 64, ..., q0
// (all threads load K, V), warp w walks the tile's 16-key chunks c in order (stopping at the
// first wholly after its rows): S = Q_w K_c^T, dP = dO_w V_c^T (WMMA), dS per element as in
// dK/dV, then dQ_w += dS K_c into register fragments. Writes the rows < T of the query
// columns of dqkv (overwriting).
template <class T16, int D>
__global__ void __launch_bounds__(kThreads, bwd_min_blocks(D))
    attention_tc_dq_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv, const float* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta, TcDims z, BwdLayout L) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldh = D + 8, NF = D / kF;
  T16* Qs = reinterpret_cast<T16*>(smem + L.q);       // [64 queries, ldh] the block's queries
  T16* dOs = reinterpret_cast<T16*>(smem + L.dout);   // [64 queries, ldh]
  T16* Ks = reinterpret_cast<T16*>(smem + L.k);       // [64 keys, ldh] key tile
  T16* Vs = reinterpret_cast<T16*>(smem + L.v);       // [64 keys, ldh]
  float* Ls = reinterpret_cast<float*>(smem + L.lse);    // [64]
  float* Ds = reinterpret_cast<float*>(smem + L.delta);  // [64]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * kF;
  float* Sst = reinterpret_cast<float*>(smem + L.s) + warp * kStage;    // [16 queries, 16 keys]
  float* dPst = reinterpret_cast<float*>(smem + L.dp) + warp * kStage;  // [16 queries, 16 keys]
  T16* dSst = reinterpret_cast<T16*>(smem + L.ds) + warp * kStage;      // [16 queries, 16 keys]
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int64_t bh = (int64_t)b * z.NH + h;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_rows16<T16, D>(Qs, base + (int64_t)h * D, z.W, q0, z.T);
  load_rows16<T16, D>(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * D, z.OW, q0, z.T);
  load_vec(Ls, lse + bh * z.T, q0, z.T);
  load_vec(Ds, delta + bh * z.T, q0, z.T);

  FragAcc dq[NF];  // the warp's dQ [16 queries, D], column blocks of 16
  #pragma unroll
  for (int n = 0; n < NF; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous K / V (and Q, dO, lse, delta loaded)
    load_rows16<T16, D>(Ks, base + (int64_t)(z.NH + kh) * D, z.W, k0, z.T);
    load_rows16<T16, D>(Vs, base + (int64_t)(z.NH + z.NKV + kh) * D, z.W, k0, z.T);
    __syncthreads();
    #pragma unroll 1
    for (int c = 0; c < kTile / kF; ++c) {
      const int kc = c * kF;  // the chunk's first key in the tile
      if (k0 + kc > q0 + r0 + kF - 1) break;  // every key follows every query of the warp (so do later chunks)
      warp_abt16<T16, D>(Sst, Qs + r0 * ldh, Ks + kc * ldh, kF);
      warp_abt16<T16, D>(dPst, dOs + r0 * ldh, Vs + kc * ldh, kF);
      __syncwarp();
      #pragma unroll
      for (int e = 0; e < kStage / 32; ++e) {
        const int idx = lane + 32 * e, r = idx / kF, j = idx % kF;
        const int t = q0 + r0 + r, key = k0 + kc + j;
        const bool seen = key <= t && t < z.T;
        const float p = seen ? expf(Sst[idx] * z.scale - Ls[r0 + r]) : 0.0f;
        dSst[idx] = to16<T16>(seen ? p * (dPst[idx] - Ds[r0 + r]) * z.scale : 0.0f);
      }
      __syncwarp();
      FragA<T16, wmma::row_major> dsa;
      wmma::load_matrix_sync(dsa, dSst, kF);
      #pragma unroll
      for (int n = 0; n < NF; ++n) {
        FragB<T16, wmma::row_major> bk;
        wmma::load_matrix_sync(bk, Ks + kc * ldh + n * kF, ldh);
        wmma::mma_sync(dq[n], dsa, bk, dq[n]);
      }
    }
  }
  warp_store_rows<D>(dqkv + (int64_t)b * z.T * z.W + (int64_t)h * D, z.W, q0 + r0, z.T, dq, Sst);
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

// Raises the kernel's dynamic shared-memory limit when `bytes` exceed the default 48 KB, and
// asks for the largest shared-memory carveout (a hint) so the blocks the registers allow fit.
template <class Kernel>
size_t with_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
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

template <class T16, int D>
void forward_d(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  const TcDims z = make_dims(s);
  const size_t bytes = with_smem(attention_tc_forward_kernel<T16, D>, fwd_layout(D).bytes);
  const dim3 grid((unsigned)ceil_div(s.T, kTile), (unsigned)s.NH, (unsigned)s.B);
  attention_tc_forward_kernel<T16, D><<<grid, kThreads, bytes, stream()>>>(out.f32(), lse.f32(), qkv.f32(), z);
  MT_CUDA_LAUNCHED("attention_tc_forward_kernel");
}

// The dK/dV and dQ kernels at compile-time head dim D (fragment arrays need a fixed size).
template <class T16, int D>
void backward_d(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse, const float* delta,
                const TcDims& z, const AttentionShape& s) {
  const BwdLayout L = bwd_layout(D);
  const unsigned tiles = (unsigned)ceil_div(s.T, kTile);
  const size_t dkv_bytes = with_smem(attention_tc_dkv_kernel<T16, D>, L.bytes);
  attention_tc_dkv_kernel<T16, D><<<dim3(tiles, (unsigned)s.NKV, (unsigned)s.B), kThreads, dkv_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z, L);
  MT_CUDA_LAUNCHED("attention_tc_dkv_kernel");
  const size_t dq_bytes = with_smem(attention_tc_dq_kernel<T16, D>, L.bytes);
  attention_tc_dq_kernel<T16, D><<<dim3(tiles, (unsigned)s.NH, (unsigned)s.B), kThreads, dq_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z, L);
  MT_CUDA_LAUNCHED("attention_tc_dq_kernel");
}

// Calls f(std::integral_constant<int, D>) for the run-time head dim D (the kernels are
// templated on it so their fragment arrays have a compile-time size).
template <class F>
void with_head_dim(int64_t D, const char* op, F&& f) {
  switch (D) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 48: return f(std::integral_constant<int, 48>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 80: return f(std::integral_constant<int, 80>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 112: return f(std::integral_constant<int, 112>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: MT_CHECK(false, op << ": head dim D = " << D << " has no tensor-core kernel");
  }
}

template <class T16>
void forward_typed(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  with_head_dim(s.D, "attention_tc_forward", [&](auto d) { forward_d<T16, decltype(d)::value>(out, lse, qkv, s); });
}

template <class T16>
void backward_kernels(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& lse, const float* delta,
                      const TcDims& z, const AttentionShape& s) {
  with_head_dim(s.D, "attention_tc_backward",
                [&](auto d) { backward_d<T16, decltype(d)::value>(dqkv, dout, qkv, lse, delta, z, s); });
}

// Blocks per SM of the three kernels at head dim D (their shared-memory limits raised first).
template <class T16>
AttentionTcOccupancy occupancy_typed(int64_t D) {
  AttentionTcOccupancy r{};
  with_head_dim(D, "attention_tc_occupancy", [&](auto d) {
    constexpr int Dc = decltype(d)::value;
    r.forward_smem = (int64_t)fwd_layout(Dc).bytes;
    r.backward_smem = (int64_t)bwd_layout(Dc).bytes;
    auto fk = attention_tc_forward_kernel<T16, Dc>;
    auto kk = attention_tc_dkv_kernel<T16, Dc>;
    auto qk = attention_tc_dq_kernel<T16, Dc>;
    MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.forward, fk, kThreads,
                                                                with_smem(fk, (size_t)r.forward_smem)));
    MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.dkv, kk, kThreads,
                                                                with_smem(kk, (size_t)r.backward_smem)));
    MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.dq, qk, kThreads,
                                                                with_smem(qk, (size_t)r.backward_smem)));
  });
  return r;
}

template <class T16>
void backward_typed(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                    const AttentionShape& s, DType dt, bool mma) {
  const TcDims z = make_dims(s);
  const int64_t rows = s.B * s.NH * s.T;
  // delta[B, NH, T]; for the mma kernels dout rounded to T16 [B, T, NH D] in the same pass
  Scratch delta(sizeof(float) * rows), dout16(mma ? sizeof(T16) * dout.numel() : 0);
  const unsigned grid = (unsigned)ceil_div(rows, kWarps);
  if (out.dtype() == DType::f32)
    attention_tc_delta_kernel<T16, float><<<grid, kThreads, 0, stream()>>>(delta.as<float>(), dout16.as<T16>(),
                                                                          dout.f32(), out.f32(), rows, z);
  else
    attention_tc_delta_kernel<T16, T16><<<grid, kThreads, 0, stream()>>>(
        delta.as<float>(), dout16.as<T16>(), dout.f32(), static_cast<const T16*>(out.raw()), rows, z);
  MT_CUDA_LAUNCHED("attention_tc_delta_kernel");

  Scratch q_slot;
  if (mma)
    attention_mma_backward_kernels(dqkv, Tensor::wrap(dout16.get(), dout.shape(), dt), as_dtype(qkv, dt, q_slot), lse,
                                   delta.as<float>(), s, dt);
  else
    backward_kernels<T16>(dqkv, dout, as_dtype(qkv, DType::f32, q_slot), lse, delta.as<float>(), z, s);
}

// q|k|v (and out) of the tensor-core entry points: fp32, or already in the scope's dt.
void check_operand(const Tensor& t, DType dt, const char* op, const char* what) {
  MT_CHECK(t.dtype() == DType::f32 || t.dtype() == dt,
           op << ": " << what << " in " << dtype_name(t.dtype()) << ", expected f32 or the operands' " << dtype_name(dt));
}

}  // namespace

bool attention_tc_supported(int64_t D) { return D >= kF && D <= kMaxD && D % kF == 0; }

// MESHTRAIN_ATTENTION_KERNEL=wmma (read once) keeps the WMMA kernels under automatic.
static bool wmma_from_env() {
  static const bool k = [] {
    const char* e = std::getenv("MESHTRAIN_ATTENTION_KERNEL");
    MT_CHECK(e == nullptr || *e == '\0' || std::strcmp(e, "wmma") == 0,
             "MESHTRAIN_ATTENTION_KERNEL=" << e << " is not a kernel choice: set it to wmma (the WMMA kernels "
                                                  "everywhere) or leave it unset (the mma.sync kernels where they apply)");
    return e != nullptr && std::strcmp(e, "wmma") == 0;
  }();
  return k;
}

bool attention_tc_reads_16bit(const Tensor& qkv, const AttentionShape& s) {
  return !wmma_from_env() && attention_mma_supported(s.D) && qkv.dtype() != DType::f32 &&
         reinterpret_cast<uintptr_t>(qkv.raw()) % 16 == 0;
}

void attention_tc_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s, DType dt,
                          AttentionTcForward kernel) {
  check_tc(s, dt, "attention_tc_forward");
  check_operand(qkv, dt, "attention_tc_forward", "qkv");
  check_operand(out, dt, "attention_tc_forward", "out");
  if (s.B == 0 || s.T == 0) return;
  if (kernel == AttentionTcForward::automatic)
    kernel = wmma_from_env() || !attention_mma_supported(s.D) || !attention_mma_aligned(out, qkv)
                 ? AttentionTcForward::wmma
                 : AttentionTcForward::mma;
  Scratch q_slot, o_slot;
  if (kernel == AttentionTcForward::mma) return attention_mma_forward(out, lse, as_dtype(qkv, dt, q_slot), s, dt);
  const Tensor q32 = as_dtype(qkv, DType::f32, q_slot), o32 = fp32_output(out, o_slot);
  if (dt == DType::bf16)
    forward_typed<__nv_bfloat16>(o32, lse, q32, s);
  else
    forward_typed<half>(o32, lse, q32, s);
  store_output(out, o32);
}

void attention_tc_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                           const Tensor& lse, const AttentionShape& s, DType dt, AttentionTcBackward kernel) {
  check_tc(s, dt, "attention_tc_backward");
  check_operand(qkv, dt, "attention_tc_backward", "qkv");
  check_operand(out, dt, "attention_tc_backward", "out");
  if (kernel == AttentionTcBackward::mma) {
    MT_CHECK(attention_mma_supported(s.D), "attention_tc_backward: the mma kernels take D = 64, 128, not " << s.D);
    MT_CHECK(attention_mma_backward_aligned(dqkv, qkv),
             "attention_tc_backward: the mma kernels need a 16-bit qkv 16-byte and dqkv 8-byte aligned");
  }
  if (s.B == 0 || s.T == 0) return;
  if (kernel == AttentionTcBackward::automatic)
    kernel = wmma_from_env() || !attention_mma_supported(s.D) || !attention_mma_backward_aligned(dqkv, qkv)
                 ? AttentionTcBackward::wmma
                 : AttentionTcBackward::mma;
  const bool mma = kernel == AttentionTcBackward::mma;
  if (dt == DType::bf16)
    backward_typed<__nv_bfloat16>(dqkv, dout, qkv, out, lse, s, dt, mma);
  else
    backward_typed<half>(dqkv, dout, qkv, out, lse, s, dt, mma);
}

AttentionTcOccupancy attention_tc_occupancy(int64_t D, DType dt) {
  MT_CHECK(attention_tc_supported(D), "attention_tc_occupancy: head dim D = " << D << " not supported");
  MT_CHECK(dt == DType::bf16 || dt == DType::f16, "attention_tc_occupancy: 16-bit dtype expected, got " << dtype_name(dt));
  return dt == DType::bf16 ? occupancy_typed<__nv_bfloat16>(D) : occupancy_typed<half>(D);
}

}  // namespace mt::cuda
