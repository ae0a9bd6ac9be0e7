// Fused causal grouped-query attention on the GPU (flash-style, fp32 SIMT): the forward's
// online softmax over key tiles keeps only each row's log-sum-exp; the backward recomputes
// the probabilities tile by tile. Nothing T x T is ever stored. Semantics as in
// ops/attention.h: the whole sequence (attention_fused_*) and parts of it
// (attention_part_*, declared in attention_part.h, for context parallelism) run the same
// kernels. A part is Tq query rows against Tk key rows (row i sees key j iff j <= i + off,
// off = q.position - k.position; keys no row sees are left out), read from row q.first /
// k.first of their buffers; the whole sequence is the part with Tq = Tk = T and off = 0,
// and the same float operations as a kernel written for it alone.
// Under a bf16 / f16 Autocast scope with D % 16 == 0 (D <= 128) the tensor-core kernels of
// attention_tc.cu run instead (16-bit operands, fp32 accumulation and statistics); the
// parts stay fp32 under any scope (context parallelism then rounds less than one rank).
//
// Layout: qkv[B, T, W], W = (NH + 2 NKV) D; query head h of token t of batch b at
// qkv + (b T + t) W + h D, its kv head kh = h / G with K at column (NH + kh) D and V at
// column (NH + NKV + kh) D. out[B, T, NH D], lse[B, NH, T], scale = 1/sqrt(D).
//
// Tiles: kTile = 32 query rows and 32 keys; a block has 4 warps (128 threads). Each warp
// owns 8 rows of its tile (queries in forward and dQ, keys in dK/dV); a lane holds the
// columns d = lane, lane + 32, lane + 64, lane + 96 of its rows' D-vectors (D <= 128), and
// when a step works per (query, key) pair, lane j takes the j-th key (or query) of the
// other tile. Tiles live in dynamic shared memory with an odd row stride ld = D | 1, so
// lanes reading 32 different rows at the same column hit 32 different banks.
//
// Shared memory: forward 3 tiles (Q, K, V), backward 4 (Q, dO, K, V) of 32 x ld floats,
// plus 2 x 32 floats (lse, delta): at D = 128 (ld = 129) 49,536 and 66,304 bytes, above the
// 48 KB default, so the limit is raised with cudaFuncSetAttribute when needed.
//
// Determinism: no atomics. Warp reductions are butterflies (__shfl_xor_sync, a fixed
// pattern); each output element is owned by one thread, which sums its terms in a fixed
// order (key tiles, then keys in a tile; dK/dV: query heads of the group, query tiles,
// queries in a tile). The grid depends only on the shapes. A part's forward merges into
// out / lse (merge) and its backward adds into dqkv (acc) by read-modify-write of each
// element by the one thread that owns it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "ops/attention.h"
#include "ops/autocast.h"
#include "ops/cuda/attention_part.h"
#include "ops/cuda/attention_tc.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kTile = 32;                 // query rows per query tile, keys per key tile
constexpr int kWarps = 4;                 // warps per block
constexpr int kThreads = kWarps * 32;     // threads per block
constexpr int kRows = kTile / kWarps;     // tile rows per warp (8)
constexpr int kMaxD = 128;                // largest head dim
constexpr int kCols = kMaxD / 32;         // columns per lane (4)
static_assert(kTile == 32, "a lane takes one key (or query) of a tile");

// Sizes and strides shared by the kernels, and the part: Tq query rows from row qf of
// qkv_q / out / dout (Tbq rows per batch entry; lse [B, NH, Tbq]), Tk key rows from row kf
// of qkv_kv (Tbk rows per batch entry); query row i sees key row j iff j <= i + off.
struct Dims {
  int D, ld;  // ld = D | 1: odd row stride of the shared tiles
  int NH, NKV, G;
  int64_t W, OW;  // qkv and out row widths
  float scale;
  int Tq, Tk, Tbq, Tbk, qf, kf, off;
  bool merge;  // forward: merge into what out / lse hold (else overwrite)
  bool acc;    // backward: add into dqkv (else overwrite)
};

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

// dst[kTile, ld] (shared) = rows [r0, r0 + kTile) of a [T, D] matrix at src with row
// stride ld_src (global); rows >= T are zeros. All threads of the block take part.
__device__ void load_tile(float* dst, const float* src, int64_t ld_src, int r0, int T, const Dims& z) {
  for (int idx = threadIdx.x; idx < kTile * z.D; idx += blockDim.x) {
    const int r = idx / z.D, d = idx % z.D, row = r0 + r;
    dst[r * z.ld + d] = row < T ? src[(int64_t)row * ld_src + d] : 0.0f;
  }
}

// dst[kTile] (shared) = src[r0 .. r0 + kTile) (global), zeros past T.
__device__ void load_vec(float* dst, const float* src, int r0, int T) {
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) dst[r] = r0 + r < T ? src[r0 + r] : 0.0f;
}

// Forward. Grid (ceil(Tq / 32), NH, B), 128 threads: the block takes query rows
// [q0, q0 + 32) of head h of batch b and walks the key tiles k0 = 0, 32, ... below
// min(Tk, q0 + 32 + off) (for the whole sequence up to the diagonal tile). Per tile: lane
// j computes the scores of key k0 + j with the warp's 8 rows; each row's running max m
// and sum l are updated (warp max / sum), and its running output O (lane: columns
// lane + 32 c) is rescaled and gets sum_j p_j V_j, j in order. Finally, for the rows
// < Tq: out = O / l and lse = m + log l, or merged into out / lse by their log-sum-exp
// (z.merge; finish_row in ops/attention_fused.cpp); a row that saw no key (l = 0) gets
// out 0 and lse -inf, or is left as it is when merging.
__global__ void attention_forward_kernel(float* __restrict__ out, float* __restrict__ lse,
                                         const float* __restrict__ qkv_q, const float* __restrict__ qkv_kv, Dims z) {
  extern __shared__ float smem[];
  float* Qs = smem;                  // [32, ld]
  float* Ks = Qs + kTile * z.ld;     // [32, ld]
  float* Vs = Ks + kTile * z.ld;     // [32, ld]
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* qbase = qkv_q + ((int64_t)b * z.Tbq + z.qf) * z.W;   // query row 0 of the part
  const float* kbase = qkv_kv + ((int64_t)b * z.Tbk + z.kf) * z.W;  // key row 0 of the part
  const float* Kg = kbase + (int64_t)(z.NH + kh) * z.D;
  const float* Vg = kbase + (int64_t)(z.NH + z.NKV + kh) * z.D;
  load_tile(Qs, qbase + (int64_t)h * z.D, z.W, q0, z.Tq, z);

  float O[kRows][kCols], m[kRows], l[kRows];
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) O[r][c] = 0.0f;
  }
  const int64_t key_end = min((int64_t)z.Tk, (int64_t)q0 + kTile + z.off);  // keys some row of the tile sees
  for (int k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();  // the previous tile's readers are done (and Qs is loaded)
    load_tile(Ks, Kg, z.W, k0, z.Tk, z);
    load_tile(Vs, Vg, z.W, k0, z.Tk, z);
    __syncthreads();
    // s[r] = scale q_r . k_j for key j = k0 + lane
    float s[kRows];
    #pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.0f;
    for (int d = 0; d < z.D; ++d) {
      const float kv = Ks[lane * z.ld + d];
      #pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] += Qs[(warp * kRows + r) * z.ld + d] * kv;
    }
    const int key = k0 + lane;
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int t = q0 + warp * kRows + r;
      const bool seen = key <= t + z.off && key < z.Tk;
      const float sv = seen ? s[r] * z.scale : -INFINITY;
      const float mn = fmaxf(m[r], warp_max(sv));
      const float a = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);  // rescales earlier tiles
      const float p = seen ? expf(sv - mn) : 0.0f;
      l[r] = a * l[r] + warp_sum(p);
      m[r] = mn;
      s[r] = p;
      #pragma unroll
      for (int c = 0; c < kCols; ++c) O[r][c] *= a;
    }
    // O[r] += sum_j p_rj V_j
    for (int j = 0; j < kTile; ++j) {
      float v[kCols];
      #pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int d = lane + 32 * c;
        v[c] = d < z.D ? Vs[j * z.ld + d] : 0.0f;
      }
      #pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float p = __shfl_sync(0xffffffffu, s[r], j);
        #pragma unroll
        for (int c = 0; c < kCols; ++c) O[r][c] += p * v[c];
      }
    }
  }
  // t, l and the lse read below are the same in every lane of the warp (the butterflies
  // leave every lane the same sum), so the warp takes each branch together.
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = q0 + warp * kRows + r;
    if (t >= z.Tq) continue;
    float* o = out + ((int64_t)b * z.Tbq + z.qf + t) * z.OW + (int64_t)h * z.D;
    float* ls = lse + ((int64_t)b * z.NH + h) * z.Tbq + z.qf + t;
    if (l[r] == 0.0f) {  // no key seen (never for the whole sequence): the empty part
      if (z.merge) continue;
      #pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int d = lane + 32 * c;
        if (d < z.D) o[d] = 0.0f;
      }
      if (lane == 0) *ls = -INFINITY;
      continue;
    }
    const float inv = 1.0f / l[r], lp = m[r] + logf(l[r]);
    const float prev = z.merge ? *ls : -INFINITY;  // the earlier parts' lse (-inf: none)
    __syncwarp();  // every lane has read *ls before lane 0 writes it
    if (prev == -INFINITY) {  // this part alone
      #pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int d = lane + 32 * c;
        if (d < z.D) o[d] = O[r][c] * inv;
      }
      if (lane == 0) *ls = lp;
      continue;
    }
    // lse' = log(e^prev + e^lp) = hi + log(1 + e^(lo - hi)); out' = out e^(prev - lse') + O / l e^(lp - lse')
    const float hi = fmaxf(prev, lp), lo = fminf(prev, lp);
    const float merged = hi + log1pf(expf(lo - hi));
    const float wa = expf(prev - merged), wb = expf(lp - merged) * inv;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < z.D) o[d] = o[d] * wa + O[r][c] * wb;
    }
    if (lane == 0) *ls = merged;
  }
}

// delta[b, h, t] = dout[b, qf + t, h] . out[b, qf + t, h] (D-vectors) for the part's rows
// t < Tq (delta [B, NH, Tq]). One warp per (b, h, t) row:
// lanes sum columns lane, lane + 32, ... in order, then a butterfly. Grid ceil(rows / 4),
// 128 threads.
__global__ void attention_delta_kernel(float* __restrict__ delta, const float* __restrict__ dout,
                                       const float* __restrict__ out, int64_t rows, Dims z) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  const int64_t t = row % z.Tq, bh = row / z.Tq, h = bh % z.NH, b = bh / z.NH;
  const int64_t at = (b * z.Tbq + z.qf + t) * z.OW + h * z.D;
  float s = 0.0f;
  for (int d = lane; d < z.D; d += 32) s += dout[at + d] * out[at + d];
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// The backward's per-pair values for one query i and one key j, both as tile rows:
// p = exp(scale q.k - lse_i), ds = scale p (dO_i . v_j - delta_i); 0 unless query i sees key j.
__device__ __forceinline__ void pair_grad(float qk, float dov, bool seen, float lse_i, float delta_i, float scale,
                                          float& p, float& ds) {
  p = seen ? expf(qk * scale - lse_i) : 0.0f;
  ds = seen ? p * (dov - delta_i) * scale : 0.0f;
}

// dK, dV. Grid (ceil(Tk / 32), NKV, B), 128 threads: the block owns keys [k0, k0 + 32) of
// kv head kh of batch b; warp w the keys k0 + 8 w + r (r < 8), lane the columns lane + 32 c.
// For each query head h of the group (in order), each query tile q0 < Tq from the one that
// holds the first query seeing key k0 (for the whole sequence q0 = k0, k0 + 32, ...): lane
// i computes, for query q0 + i and the warp's 8 keys, qk = q.k and dov = dO.v, then p and
// ds; then for i = 0 .. 31 in order: dV_r += p_ir dO_i, dK_r += ds_ir Q_i. Writes (z.acc:
// adds into) the block's dK and dV rows < Tk of dqkv_kv.
__global__ void attention_dkv_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv_q,
                                     const float* __restrict__ qkv_kv, const float* __restrict__ dout,
                                     const float* __restrict__ lse, const float* __restrict__ delta, Dims z) {
  extern __shared__ float smem[];
  float* Ks = smem;                  // [32, ld]
  float* Vs = Ks + kTile * z.ld;     // [32, ld]
  float* Qs = Vs + kTile * z.ld;     // [32, ld]
  float* dOs = Qs + kTile * z.ld;    // [32, ld]
  float* Ls = dOs + kTile * z.ld;    // [32] lse of the query tile
  float* Ds = Ls + kTile;            // [32] delta of the query tile
  const int k0 = blockIdx.x * kTile, kh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* qbase = qkv_q + ((int64_t)b * z.Tbq + z.qf) * z.W;   // query row 0 of the part
  const float* kbase = qkv_kv + ((int64_t)b * z.Tbk + z.kf) * z.W;  // key row 0 of the part
  const float* dobase = dout + ((int64_t)b * z.Tbq + z.qf) * z.OW;
  load_tile(Ks, kbase + (int64_t)(z.NH + kh) * z.D, z.W, k0, z.Tk, z);
  load_tile(Vs, kbase + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z.Tk, z);
  // Query i sees key k0 iff i >= k0 - off: earlier query tiles see none of the block's keys.
  const int q_first = (int)(max((int64_t)0, (int64_t)k0 - z.off) / kTile * kTile);

  float dK[kRows][kCols], dV[kRows][kCols];
  #pragma unroll
  for (int r = 0; r < kRows; ++r)
    #pragma unroll
    for (int c = 0; c < kCols; ++c) dK[r][c] = dV[r][c] = 0.0f;
  for (int g = 0; g < z.G; ++g) {
    const int h = kh * z.G + g;
    const int64_t bh = (int64_t)b * z.NH + h;
    for (int q0 = q_first; q0 < z.Tq; q0 += kTile) {
      __syncthreads();  // readers of the previous Q / dO tile are done
      load_tile(Qs, qbase + (int64_t)h * z.D, z.W, q0, z.Tq, z);
      load_tile(dOs, dobase + (int64_t)h * z.D, z.OW, q0, z.Tq, z);
      load_vec(Ls, lse + bh * z.Tbq + z.qf, q0, z.Tq);
      load_vec(Ds, delta + bh * z.Tq, q0, z.Tq);
      __syncthreads();
      // lane i: query q0 + i against the warp's keys
      float qk[kRows], dov[kRows];
      #pragma unroll
      for (int r = 0; r < kRows; ++r) qk[r] = dov[r] = 0.0f;
      for (int d = 0; d < z.D; ++d) {
        const float q = Qs[lane * z.ld + d], o = dOs[lane * z.ld + d];
        #pragma unroll
        for (int r = 0; r < kRows; ++r) {
          qk[r] += q * Ks[(warp * kRows + r) * z.ld + d];
          dov[r] += o * Vs[(warp * kRows + r) * z.ld + d];
        }
      }
      const int t = q0 + lane;
      #pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int key = k0 + warp * kRows + r;
        pair_grad(qk[r], dov[r], key <= t + z.off && t < z.Tq && key < z.Tk, Ls[lane], Ds[lane], z.scale, qk[r],
                  dov[r]);
      }
      // qk = p, dov = ds now; accumulate over the tile's queries in order
      for (int i = 0; i < kTile; ++i) {
        float q[kCols], o[kCols];
        #pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int d = lane + 32 * c;
          q[c] = d < z.D ? Qs[i * z.ld + d] : 0.0f;
          o[c] = d < z.D ? dOs[i * z.ld + d] : 0.0f;
        }
        #pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float p = __shfl_sync(0xffffffffu, qk[r], i), ds = __shfl_sync(0xffffffffu, dov[r], i);
          #pragma unroll
          for (int c = 0; c < kCols; ++c) {
            dV[r][c] += p * o[c];
            dK[r][c] += ds * q[c];
          }
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int key = k0 + warp * kRows + r;
    if (key >= z.Tk) continue;
    float* row = dqkv + ((int64_t)b * z.Tbk + z.kf + key) * z.W;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d >= z.D) continue;
      float& dk = row[(int64_t)(z.NH + kh) * z.D + d];
      float& dv = row[(int64_t)(z.NH + z.NKV + kh) * z.D + d];
      dk = z.acc ? dk + dK[r][c] : dK[r][c];
      dv = z.acc ? dv + dV[r][c] : dV[r][c];
    }
  }
}

// dQ. Grid (ceil(Tq / 32), NH, B), 128 threads: the block owns query rows [q0, q0 + 32) of
// head h of batch b; warp w the rows q0 + 8 w + r, lane the columns lane + 32 c. For each
// key tile k0 = 0, 32, ... below min(Tk, q0 + 32 + off) (for the whole sequence up to q0):
// lane j computes qk and dov of key k0 + j with the warp's 8 rows, then p and ds; then for
// j = 0 .. 31 in order dQ_r += ds_rj K_j. Writes (z.acc: adds into) the rows < Tq of the
// query columns of dqkv_q.
__global__ void attention_dq_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv_q,
                                    const float* __restrict__ qkv_kv, const float* __restrict__ dout,
                                    const float* __restrict__ lse, const float* __restrict__ delta, Dims z) {
  extern __shared__ float smem[];
  float* Qs = smem;                  // [32, ld]
  float* dOs = Qs + kTile * z.ld;    // [32, ld]
  float* Ks = dOs + kTile * z.ld;    // [32, ld]
  float* Vs = Ks + kTile * z.ld;     // [32, ld]
  float* Ls = Vs + kTile * z.ld;     // [32]
  float* Ds = Ls + kTile;            // [32]
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = (int64_t)b * z.NH + h;
  const float* qbase = qkv_q + ((int64_t)b * z.Tbq + z.qf) * z.W;   // query row 0 of the part
  const float* kbase = qkv_kv + ((int64_t)b * z.Tbk + z.kf) * z.W;  // key row 0 of the part
  load_tile(Qs, qbase + (int64_t)h * z.D, z.W, q0, z.Tq, z);
  load_tile(dOs, dout + ((int64_t)b * z.Tbq + z.qf) * z.OW + (int64_t)h * z.D, z.OW, q0, z.Tq, z);
  load_vec(Ls, lse + bh * z.Tbq + z.qf, q0, z.Tq);
  load_vec(Ds, delta + bh * z.Tq, q0, z.Tq);

  float dQ[kRows][kCols];
  #pragma unroll
  for (int r = 0; r < kRows; ++r)
    #pragma unroll
    for (int c = 0; c < kCols; ++c) dQ[r][c] = 0.0f;
  const int64_t key_end = min((int64_t)z.Tk, (int64_t)q0 + kTile + z.off);  // keys some row of the tile sees
  for (int k0 = 0; k0 < key_end; k0 += kTile) {
    __syncthreads();  // readers of the previous K / V tile are done (and Q, dO are loaded)
    load_tile(Ks, kbase + (int64_t)(z.NH + kh) * z.D, z.W, k0, z.Tk, z);
    load_tile(Vs, kbase + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z.Tk, z);
    __syncthreads();
    // lane j: key k0 + j against the warp's rows
    float qk[kRows], dov[kRows];
    #pragma unroll
    for (int r = 0; r < kRows; ++r) qk[r] = dov[r] = 0.0f;
    for (int d = 0; d < z.D; ++d) {
      const float k = Ks[lane * z.ld + d], v = Vs[lane * z.ld + d];
      #pragma unroll
      for (int r = 0; r < kRows; ++r) {
        qk[r] += Qs[(warp * kRows + r) * z.ld + d] * k;
        dov[r] += dOs[(warp * kRows + r) * z.ld + d] * v;
      }
    }
    const int key = k0 + lane;
    #pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = warp * kRows + r, t = q0 + i;
      pair_grad(qk[r], dov[r], key <= t + z.off && t < z.Tq && key < z.Tk, Ls[i], Ds[i], z.scale, qk[r], dov[r]);
    }
    // dov = ds now
    for (int j = 0; j < kTile; ++j) {
      float k[kCols];
      #pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int d = lane + 32 * c;
        k[c] = d < z.D ? Ks[j * z.ld + d] : 0.0f;
      }
      #pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float ds = __shfl_sync(0xffffffffu, dov[r], j);
        #pragma unroll
        for (int c = 0; c < kCols; ++c) dQ[r][c] += ds * k[c];
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = q0 + warp * kRows + r;
    if (t >= z.Tq) continue;
    float* row = dqkv + ((int64_t)b * z.Tbq + z.qf + t) * z.W + (int64_t)h * z.D;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < z.D) row[d] = z.acc ? row[d] + dQ[r][c] : dQ[r][c];
    }
  }
}

// The checked shape of q|k|v on the device, in f32 or (the fused ops) already rounded to 16
// bits: bf16 or f16, the dtype of a 16-bit Autocast scope if one is open (rounding a bf16
// value to f16 would round twice). attention_shape reads only qkv's shape; it also insists on
// an f32 tensor, so it is given an f32 handle of the same shape that is never read.
AttentionShape checked_shape(const Tensor& qkv, int n_head, int n_kv_head, const char* op) {
  MT_CHECK(qkv.device() == Device::cuda, op << ": qkv on " << device_name(qkv.device()) << ", expected cuda");
  MT_CHECK(qkv.dtype() == DType::f32 || qkv.dtype() == DType::bf16 || qkv.dtype() == DType::f16,
           op << ": qkv in " << dtype_name(qkv.dtype()) << ", expected f32, bf16 or f16");
  const AttentionShape s = attention_shape(Tensor::wrap(qkv.raw(), qkv.shape(), DType::f32), n_head, n_kv_head, op);
  MT_CHECK(s.D <= kMaxD, op << ": head dim D = " << s.D << " is above the CUDA kernels' limit of " << kMaxD);
  MT_CHECK(s.T <= (int64_t)1 << 30 && s.B <= 65535 && s.NH <= 65535,
           op << ": B = " << s.B << ", T = " << s.T << ", NH = " << s.NH
              << " outside the CUDA grid (B, NH <= 65535, T <= 2^30)");
  return s;
}

// A fused op's q|k|v or out: f32, or 16 bits as checked_shape says.
void check_operand(const Tensor& t, const char* op, const char* what) {
  MT_CHECK(t.device() == Device::cuda, op << ": " << what << " on " << device_name(t.device()) << ", expected cuda");
  const DType scope = autocast_dtype();
  MT_CHECK(t.dtype() == DType::f32 || ((t.dtype() == DType::bf16 || t.dtype() == DType::f16) &&
                                       (scope == DType::f32 || scope == t.dtype())),
           op << ": " << what << " in " << dtype_name(t.dtype()) << " under a " << dtype_name(scope)
              << " scope; expected f32, or the 16-bit dtype of the scope");
}

// The part q of qkv_q (s: its shape) against the part k of a [B, Tbk, W] qkv_kv; the
// whole sequence is q = k = {0, T, 0}, Tbk = T.
Dims make_dims(const AttentionShape& s, int64_t Tbk, AttentionRows q, AttentionRows k) {
  Dims z;
  z.D = (int)s.D;
  z.ld = (int)(s.D | 1);
  z.NH = (int)s.NH;
  z.NKV = (int)s.NKV;
  z.G = (int)s.G;
  z.W = s.W;
  z.OW = s.NH * s.D;
  z.scale = 1.0f / std::sqrt((float)s.D);
  const int64_t off = q.position - k.position;
  z.Tq = (int)q.count;
  z.Tk = (int)std::clamp<int64_t>(q.count + off, 0, k.count);  // keys some query sees
  z.Tbq = (int)s.T;
  z.Tbk = (int)Tbk;
  z.qf = (int)q.first;
  z.kf = (int)k.first;
  z.off = (int)off;
  z.merge = z.acc = false;
  return z;
}

// Dynamic shared memory of `tiles` [32, ld] tiles and `vecs` [32] vectors, the kernel's
// limit raised when it exceeds the default 48 KB.
template <class Kernel>
size_t shared_bytes(Kernel kernel, const Dims& z, int tiles, int vecs) {
  const size_t bytes = sizeof(float) * ((size_t)tiles * kTile * z.ld + (size_t)vecs * kTile);
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return bytes;
}

// The forward of part z (Tq > 0) of batch B: out [B, Tbq, NH D], lse [B, NH, Tbq].
void launch_forward(float* out, float* lse, const float* qkv_q, const float* qkv_kv, const Dims& z, int64_t B) {
  const size_t bytes = shared_bytes(attention_forward_kernel, z, 3, 0);
  const dim3 grid((unsigned)ceil_div(z.Tq, kTile), (unsigned)z.NH, (unsigned)B);
  attention_forward_kernel<<<grid, kThreads, bytes, stream()>>>(out, lse, qkv_q, qkv_kv, z);
  MT_CUDA_LAUNCHED("attention_forward_kernel");
}

// The backward of part z (Tq, Tk > 0) of batch B: the query columns of dqkv_q's rows and the
// key/value columns of dqkv_kv's rows (written, or added into when z.acc).
void launch_backward(float* dqkv_q, float* dqkv_kv, const float* dout, const float* qkv_q, const float* out,
                     const float* lse, const float* qkv_kv, const Dims& z, int64_t B) {
  const int64_t rows = B * z.NH * z.Tq;
  const Scratch delta_slot(sizeof(float) * rows, "attention's backward");
  float* delta = delta_slot.as<float>();  // [B, NH, Tq]
  attention_delta_kernel<<<(unsigned)ceil_div(rows, kWarps), kThreads, 0, stream()>>>(delta, dout, out, rows, z);
  MT_CUDA_LAUNCHED("attention_delta_kernel");

  const size_t dkv_bytes = shared_bytes(attention_dkv_kernel, z, 4, 2);
  const dim3 dkv_grid((unsigned)ceil_div(z.Tk, kTile), (unsigned)z.NKV, (unsigned)B);
  attention_dkv_kernel<<<dkv_grid, kThreads, dkv_bytes, stream()>>>(dqkv_kv, qkv_q, qkv_kv, dout, lse, delta, z);
  MT_CUDA_LAUNCHED("attention_dkv_kernel");

  const size_t dq_bytes = shared_bytes(attention_dq_kernel, z, 4, 2);
  const dim3 dq_grid((unsigned)ceil_div(z.Tq, kTile), (unsigned)z.NH, (unsigned)B);
  attention_dq_kernel<<<dq_grid, kThreads, dq_bytes, stream()>>>(dqkv_q, qkv_q, qkv_kv, dout, lse, delta, z);
  MT_CUDA_LAUNCHED("attention_dq_kernel");
}

// A part call's shape, checked as on the CPU (ops/attention_fused.cpp, part_args): qkv_kv
// [B, Tk, W] like qkv_q, the rows inside their buffers, positions >= 0, all within the
// kernels' int range. *Tbk: qkv_kv's rows.
AttentionShape part_shape(const Tensor& qkv_q, AttentionRows q, const Tensor& qkv_kv, AttentionRows k, int n_head,
                          int n_kv_head, const char* op, int64_t* Tbk) {
  check_device_f32(qkv_q, op);  // the parts read fp32 only
  const AttentionShape s = checked_shape(qkv_q, n_head, n_kv_head, op);
  check_device_f32(qkv_kv, op);
  MT_CHECK(qkv_kv.ndim() == 3 && qkv_kv.dim(0) == s.B && qkv_kv.dim(2) == s.W,
           op << ": qkv_kv has shape " << shape_str(qkv_kv.shape()) << ", expected [B, Tk, W] = [" << s.B
              << ", Tk, " << s.W << "] like qkv_q " << shape_str(qkv_q.shape()));
  *Tbk = qkv_kv.dim(1);
  constexpr int64_t kMax = (int64_t)1 << 30;
  MT_CHECK(*Tbk <= kMax, op << ": qkv_kv has " << *Tbk << " rows, above the CUDA kernels' limit of 2^30");
  for (auto [r, T, name] : {std::tuple{q, s.T, "q"}, {k, *Tbk, "k"}}) {
    MT_CHECK(r.first >= 0 && r.count >= 0 && r.first <= T - r.count,
             op << ": " << name << " rows [" << r.first << ", " << r.first + r.count << ") are not inside the "
                << T << " rows of qkv_" << (name[0] == 'q' ? "q" : "kv") << " (first >= 0, count >= 0)");
    MT_CHECK(r.position >= 0 && r.position <= kMax / 2,  // row + off stays within int
             op << ": " << name << " rows at position " << r.position << ", expected 0 to 2^29");
  }
  return s;
}

}  // namespace

void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head) {
  const char* op = "attention_fused_forward";
  const AttentionShape s = checked_shape(qkv, n_head, n_kv_head, op);
  check_operand(qkv, op, "qkv");
  check_operand(out, op, "out");
  check_device_f32(lse, "attention_fused_forward: lse");
  MT_CHECK(out.numel() == s.B * s.T * s.NH * s.D, op << ": out has shape " << shape_str(out.shape())
                                                     << ", expected [B, T, NH * D] = " << s.B * s.T * s.NH * s.D
                                                     << " elements");
  MT_CHECK(lse.numel() == s.B * s.NH * s.T,
           op << ": lse has shape " << shape_str(lse.shape()) << ", expected [B, NH, T] = " << s.B * s.NH * s.T
              << " elements");
  if (autocast_dtype() != DType::f32 && attention_tc_supported(s.D))
    return attention_tc_forward(out, lse, qkv, s, autocast_dtype());  // 16-bit tensor cores
  if (s.B == 0 || s.T == 0) return;
  Scratch q_slot, o_slot;  // a 16-bit qkv widened; a 16-bit out written in fp32 first
  const Tensor q32 = as_dtype(qkv, DType::f32, q_slot), o32 = fp32_output(out, o_slot);
  const AttentionRows all{0, s.T, 0};
  launch_forward(o32.f32(), lse.f32(), q32.f32(), q32.f32(), make_dims(s, s.T, all, all), s.B);
  store_output(out, o32);
}

bool attention_fused_reads_16bit(const Tensor& qkv, int n_head, int n_kv_head) {
  const DType dt = autocast_dtype();
  if (dt == DType::f32 || qkv.dtype() != dt) return false;
  const AttentionShape s = checked_shape(qkv, n_head, n_kv_head, "attention_fused_reads_16bit");
  return attention_tc_supported(s.D) && attention_tc_reads_16bit(qkv, s);
}

void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head) {
  const char* op = "attention_fused_backward";
  const AttentionShape s = checked_shape(qkv, n_head, n_kv_head, op);
  check_operand(qkv, op, "qkv");
  check_operand(out, op, "out");
  check_device_f32(dqkv, "attention_fused_backward: dqkv");
  check_device_f32(dout, "attention_fused_backward: dout");
  check_device_f32(lse, "attention_fused_backward: lse");
  const int64_t n_out = s.B * s.T * s.NH * s.D;
  MT_CHECK(dqkv.numel() == qkv.numel(), op << ": dqkv has shape " << shape_str(dqkv.shape())
                                           << ", expected the shape of qkv " << shape_str(qkv.shape()));
  MT_CHECK(dout.numel() == n_out, op << ": dout has shape " << shape_str(dout.shape()) << ", expected [B, T, NH * D] = "
                                     << n_out << " elements");
  MT_CHECK(out.numel() == n_out, op << ": out has shape " << shape_str(out.shape()) << ", expected [B, T, NH * D] = "
                                    << n_out << " elements");
  MT_CHECK(lse.numel() == s.B * s.NH * s.T,
           op << ": lse has shape " << shape_str(lse.shape()) << ", expected [B, NH, T] = " << s.B * s.NH * s.T
              << " elements");
  if (autocast_dtype() != DType::f32 && attention_tc_supported(s.D))
    return attention_tc_backward(dqkv, dout, qkv, out, lse, s, autocast_dtype());  // 16-bit tensor cores
  if (s.B == 0 || s.T == 0) return;
  Scratch q_slot, o_slot;  // 16-bit qkv, out widened
  const Tensor q32 = as_dtype(qkv, DType::f32, q_slot), o32 = as_dtype(out, DType::f32, o_slot);
  const AttentionRows all{0, s.T, 0};
  launch_backward(dqkv.f32(), dqkv.f32(), dout.f32(), q32.f32(), o32.f32(), lse.f32(), q32.f32(),
                  make_dims(s, s.T, all, all), s.B);
}

void attention_part_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                            const Tensor& qkv_kv, AttentionRows k, int n_head, int n_kv_head, bool merge) {
  const char* op = "attention_part_forward";
  int64_t Tbk = 0;
  const AttentionShape s = part_shape(qkv_q, q, qkv_kv, k, n_head, n_kv_head, op, &Tbk);
  check_device_f32(out, "attention_part_forward: out");
  check_device_f32(lse, "attention_part_forward: lse");
  MT_CHECK(out.numel() == s.B * s.T * s.NH * s.D,
           op << ": out has shape " << shape_str(out.shape()) << ", expected [B, Tq, NH * D] = "
              << s.B * s.T * s.NH * s.D << " elements (Tq = qkv_q's rows)");
  MT_CHECK(lse.numel() == s.B * s.NH * s.T, op << ": lse has shape " << shape_str(lse.shape())
                                               << ", expected [B, NH, Tq] = " << s.B * s.NH * s.T << " elements");
  Dims z = make_dims(s, Tbk, q, k);
  z.merge = merge;
  if (s.B == 0 || z.Tq == 0 || (z.Tk == 0 && merge)) return;  // no query, or none sees a key: nothing to merge
  launch_forward(out.f32(), lse.f32(), qkv_q.f32(), qkv_kv.f32(), z, s.B);
}

void attention_part_backward(const Tensor& dqkv_q, const Tensor& dqkv_kv, const Tensor& dout, const Tensor& qkv_q,
                             const Tensor& out, const Tensor& lse, AttentionRows q, const Tensor& qkv_kv,
                             AttentionRows k, int n_head, int n_kv_head) {
  const char* op = "attention_part_backward";
  int64_t Tbk = 0;
  const AttentionShape s = part_shape(qkv_q, q, qkv_kv, k, n_head, n_kv_head, op, &Tbk);
  check_device_f32(dqkv_q, "attention_part_backward: dqkv_q");
  check_device_f32(dqkv_kv, "attention_part_backward: dqkv_kv");
  check_device_f32(dout, "attention_part_backward: dout");
  check_device_f32(out, "attention_part_backward: out");
  check_device_f32(lse, "attention_part_backward: lse");
  const int64_t n_out = s.B * s.T * s.NH * s.D;
  MT_CHECK(dqkv_q.numel() == qkv_q.numel(), op << ": dqkv_q has shape " << shape_str(dqkv_q.shape())
                                               << ", expected the shape of qkv_q " << shape_str(qkv_q.shape()));
  MT_CHECK(dqkv_kv.numel() == qkv_kv.numel(), op << ": dqkv_kv has shape " << shape_str(dqkv_kv.shape())
                                                 << ", expected the shape of qkv_kv " << shape_str(qkv_kv.shape()));
  MT_CHECK(dout.numel() == n_out, op << ": dout has shape " << shape_str(dout.shape())
                                     << ", expected [B, Tq, NH * D] = " << n_out << " elements");
  MT_CHECK(out.numel() == n_out, op << ": out has shape " << shape_str(out.shape()) << ", expected [B, Tq, NH * D] = "
                                    << n_out << " elements");
  MT_CHECK(lse.numel() == s.B * s.NH * s.T, op << ": lse has shape " << shape_str(lse.shape())
                                               << ", expected [B, NH, Tq] = " << s.B * s.NH * s.T << " elements");
  Dims z = make_dims(s, Tbk, q, k);
  z.acc = true;
  if (s.B == 0 || z.Tq == 0 || z.Tk == 0) return;  // no query, or none sees a key: nothing to add
  launch_backward(dqkv_q.f32(), dqkv_kv.f32(), dout.f32(), qkv_q.f32(), out.f32(), lse.f32(), qkv_kv.f32(), z, s.B);
}

void copy_columns(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) {
  MT_CHECK(cols <= dst_ld && cols <= src_ld,
           "copy_columns: " << cols << " columns do not fit rows of " << dst_ld << " and " << src_ld << " floats");
  if (rows == 0 || cols == 0) return;
  MT_CUDA_CHECK(cudaMemcpy2DAsync(dst, sizeof(float) * dst_ld, src, sizeof(float) * src_ld, sizeof(float) * cols,
                                  rows, cudaMemcpyDeviceToDevice, stream()));
}

}  // namespace mt::cuda
