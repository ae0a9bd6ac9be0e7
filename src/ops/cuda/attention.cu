// Fused causal grouped-query attention on the GPU (flash-style, fp32 SIMT): the forward's
// online softmax over key tiles keeps only each row's log-sum-exp; the backward recomputes
// the probabilities tile by tile. Nothing T x T is ever stored. Semantics as in
// ops/attention.h (attention_fused_forward / attention_fused_backward).
// Under a bf16 / f16 Autocast scope with D % 16 == 0 (D <= 128) the tensor-core kernels of
// attention_tc.cu run instead (16-bit operands, fp32 accumulation and statistics).
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
// queries in a tile). The grid depends only on the shapes.
#include <cmath>
#include <cstdint>

#include "ops/attention.h"
#include "ops/autocast.h"
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

// Sizes and strides shared by the kernels.
struct Dims {
  int T, D, ld;  // ld = D | 1: odd row stride of the shared tiles
  int NH, NKV, G;
  int64_t W, OW;  // qkv and out row widths
  float scale;
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
__device__ void load_tile(float* dst, const float* src, int64_t ld_src, int r0, const Dims& z) {
  for (int idx = threadIdx.x; idx < kTile * z.D; idx += blockDim.x) {
    const int r = idx / z.D, d = idx % z.D, row = r0 + r;
    dst[r * z.ld + d] = row < z.T ? src[(int64_t)row * ld_src + d] : 0.0f;
  }
}

// dst[kTile] (shared) = src[r0 .. r0 + kTile) (global), zeros past T.
__device__ void load_vec(float* dst, const float* src, int r0, int T) {
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) dst[r] = r0 + r < T ? src[r0 + r] : 0.0f;
}

// Forward. Grid (ceil(T / 32), NH, B), 128 threads: the block takes query rows
// [q0, q0 + 32) of head h of batch b and walks the key tiles k0 = 0, 32, ..., q0 (the last
// is the diagonal tile). Per tile: lane j computes the scores of key k0 + j with the warp's
// 8 rows; each row's running max m and sum l are updated (warp max / sum), and its running
// output O (lane: columns lane + 32 c) is rescaled and gets sum_j p_j V_j, j in order.
// Finally out = O / l and lse = m + log l for the rows < T.
__global__ void attention_forward_kernel(float* __restrict__ out, float* __restrict__ lse,
                                         const float* __restrict__ qkv, Dims z) {
  extern __shared__ float smem[];
  float* Qs = smem;                  // [32, ld]
  float* Ks = Qs + kTile * z.ld;     // [32, ld]
  float* Vs = Ks + kTile * z.ld;     // [32, ld]
  const int q0 = blockIdx.x * kTile, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  const float* Kg = base + (int64_t)(z.NH + kh) * z.D;
  const float* Vg = base + (int64_t)(z.NH + z.NKV + kh) * z.D;
  load_tile(Qs, base + (int64_t)h * z.D, z.W, q0, z);

  float O[kRows][kCols], m[kRows], l[kRows];
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) O[r][c] = 0.0f;
  }
  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // the previous tile's readers are done (and Qs is loaded)
    load_tile(Ks, Kg, z.W, k0, z);
    load_tile(Vs, Vg, z.W, k0, z);
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
      const bool seen = key <= t && key < z.T;
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
  #pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = q0 + warp * kRows + r;
    if (t >= z.T) continue;
    // every row < T sees key 0, so l > 0
    const float inv = 1.0f / l[r];
    float* o = out + ((int64_t)b * z.T + t) * z.OW + (int64_t)h * z.D;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < z.D) o[d] = O[r][c] * inv;
    }
    if (lane == 0) lse[((int64_t)b * z.NH + h) * z.T + t] = m[r] + logf(l[r]);
  }
}

// delta[b, h, t] = dout[b, t, h] . out[b, t, h] (D-vectors). One warp per (b, h, t) row:
// lanes sum columns lane, lane + 32, ... in order, then a butterfly. Grid ceil(rows / 4),
// 128 threads.
__global__ void attention_delta_kernel(float* __restrict__ delta, const float* __restrict__ dout,
                                       const float* __restrict__ out, int64_t rows, Dims z) {
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together
  const int64_t t = row % z.T, bh = row / z.T, h = bh % z.NH, b = bh / z.NH;
  const int64_t at = (b * z.T + t) * z.OW + h * z.D;
  float s = 0.0f;
  for (int d = lane; d < z.D; d += 32) s += dout[at + d] * out[at + d];
  s = warp_sum(s);
  if (lane == 0) delta[row] = s;
}

// The backward's per-pair values for one query i and one key j, both as tile rows:
// p = exp(scale q.k - lse_i), ds = scale p (dO_i . v_j - delta_i); 0 unless key <= query < T.
__device__ __forceinline__ void pair_grad(float qk, float dov, bool seen, float lse_i, float delta_i, float scale,
                                          float& p, float& ds) {
  p = seen ? expf(qk * scale - lse_i) : 0.0f;
  ds = seen ? p * (dov - delta_i) * scale : 0.0f;
}

// dK, dV. Grid (ceil(T / 32), NKV, B), 128 threads: the block owns keys [k0, k0 + 32) of kv
// head kh of batch b; warp w the keys k0 + 8 w + r (r < 8), lane the columns lane + 32 c.
// For each query head h of the group (in order), each query tile q0 = k0, k0 + 32, ... < T:
// lane i computes, for query q0 + i and the warp's 8 keys, qk = q.k and dov = dO.v, then
// p and ds; then for i = 0 .. 31 in order: dV_r += p_ir dO_i, dK_r += ds_ir Q_i. Writes
// the block's dK and dV rows < T of dqkv (overwriting).
__global__ void attention_dkv_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv,
                                     const float* __restrict__ dout, const float* __restrict__ lse,
                                     const float* __restrict__ delta, Dims z) {
  extern __shared__ float smem[];
  float* Ks = smem;                  // [32, ld]
  float* Vs = Ks + kTile * z.ld;     // [32, ld]
  float* Qs = Vs + kTile * z.ld;     // [32, ld]
  float* dOs = Qs + kTile * z.ld;    // [32, ld]
  float* Ls = dOs + kTile * z.ld;    // [32] lse of the query tile
  float* Ds = Ls + kTile;            // [32] delta of the query tile
  const int k0 = blockIdx.x * kTile, kh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_tile(Ks, base + (int64_t)(z.NH + kh) * z.D, z.W, k0, z);
  load_tile(Vs, base + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z);

  float dK[kRows][kCols], dV[kRows][kCols];
  #pragma unroll
  for (int r = 0; r < kRows; ++r)
    #pragma unroll
    for (int c = 0; c < kCols; ++c) dK[r][c] = dV[r][c] = 0.0f;
  for (int g = 0; g < z.G; ++g) {
    const int h = kh * z.G + g;
    const int64_t bh = (int64_t)b * z.NH + h;
    for (int q0 = k0; q0 < z.T; q0 += kTile) {
      __syncthreads();  // readers of the previous Q / dO tile are done
      load_tile(Qs, base + (int64_t)h * z.D, z.W, q0, z);
      load_tile(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * z.D, z.OW, q0, z);
      load_vec(Ls, lse + bh * z.T, q0, z.T);
      load_vec(Ds, delta + bh * z.T, q0, z.T);
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
        pair_grad(qk[r], dov[r], key <= t && t < z.T, Ls[lane], Ds[lane], z.scale, qk[r], dov[r]);
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
    if (key >= z.T) continue;
    float* row = dqkv + ((int64_t)b * z.T + key) * z.W;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d >= z.D) continue;
      row[(int64_t)(z.NH + kh) * z.D + d] = dK[r][c];
      row[(int64_t)(z.NH + z.NKV + kh) * z.D + d] = dV[r][c];
    }
  }
}

// dQ. Grid (ceil(T / 32), NH, B), 128 threads: the block owns query rows [q0, q0 + 32) of
// head h of batch b; warp w the rows q0 + 8 w + r, lane the columns lane + 32 c. For each
// key tile k0 = 0, 32, ..., q0: lane j computes qk and dov of key k0 + j with the warp's 8
// rows, then p and ds; then for j = 0 .. 31 in order dQ_r += ds_rj K_j. Writes the rows < T
// of the query columns of dqkv (overwriting).
__global__ void attention_dq_kernel(float* __restrict__ dqkv, const float* __restrict__ qkv,
                                    const float* __restrict__ dout, const float* __restrict__ lse,
                                    const float* __restrict__ delta, Dims z) {
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
  const float* base = qkv + (int64_t)b * z.T * z.W;
  load_tile(Qs, base + (int64_t)h * z.D, z.W, q0, z);
  load_tile(dOs, dout + (int64_t)b * z.T * z.OW + (int64_t)h * z.D, z.OW, q0, z);
  load_vec(Ls, lse + bh * z.T, q0, z.T);
  load_vec(Ds, delta + bh * z.T, q0, z.T);

  float dQ[kRows][kCols];
  #pragma unroll
  for (int r = 0; r < kRows; ++r)
    #pragma unroll
    for (int c = 0; c < kCols; ++c) dQ[r][c] = 0.0f;
  for (int k0 = 0; k0 <= q0; k0 += kTile) {
    __syncthreads();  // readers of the previous K / V tile are done (and Q, dO are loaded)
    load_tile(Ks, base + (int64_t)(z.NH + kh) * z.D, z.W, k0, z);
    load_tile(Vs, base + (int64_t)(z.NH + z.NKV + kh) * z.D, z.W, k0, z);
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
      pair_grad(qk[r], dov[r], key <= t && t < z.T, Ls[i], Ds[i], z.scale, qk[r], dov[r]);
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
    if (t >= z.T) continue;
    float* row = dqkv + ((int64_t)b * z.T + t) * z.W + (int64_t)h * z.D;
    #pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < z.D) row[d] = dQ[r][c];
    }
  }
}

// The checked shape (attention_shape reads only qkv's shape and dtype; it also insists on a
// host tensor, so it is given a host-side handle of the same shape that is never read).
AttentionShape checked_shape(const Tensor& qkv, int n_head, int n_kv_head, const char* op) {
  check_device_f32(qkv, op);
  const AttentionShape s = attention_shape(Tensor::wrap(qkv.raw(), qkv.shape(), DType::f32), n_head, n_kv_head, op);
  MT_CHECK(s.D <= kMaxD, op << ": head dim D = " << s.D << " is above the CUDA kernels' limit of " << kMaxD);
  MT_CHECK(s.T <= (int64_t)1 << 30 && s.B <= 65535 && s.NH <= 65535,
           op << ": B = " << s.B << ", T = " << s.T << ", NH = " << s.NH
              << " outside the CUDA grid (B, NH <= 65535, T <= 2^30)");
  return s;
}

Dims make_dims(const AttentionShape& s) {
  Dims z;
  z.T = (int)s.T;
  z.D = (int)s.D;
  z.ld = (int)(s.D | 1);
  z.NH = (int)s.NH;
  z.NKV = (int)s.NKV;
  z.G = (int)s.G;
  z.W = s.W;
  z.OW = s.NH * s.D;
  z.scale = 1.0f / std::sqrt((float)s.D);
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

}  // namespace

void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head) {
  const char* op = "attention_fused_forward";
  const AttentionShape s = checked_shape(qkv, n_head, n_kv_head, op);
  check_device_f32(out, "attention_fused_forward: out");
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
  const Dims z = make_dims(s);
  const size_t bytes = shared_bytes(attention_forward_kernel, z, 3, 0);
  const dim3 grid((unsigned)ceil_div(s.T, kTile), (unsigned)s.NH, (unsigned)s.B);
  attention_forward_kernel<<<grid, kThreads, bytes, stream()>>>(out.f32(), lse.f32(), qkv.f32(), z);
  MT_CUDA_LAUNCHED("attention_forward_kernel");
}

void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head) {
  const char* op = "attention_fused_backward";
  const AttentionShape s = checked_shape(qkv, n_head, n_kv_head, op);
  check_device_f32(dqkv, "attention_fused_backward: dqkv");
  check_device_f32(dout, "attention_fused_backward: dout");
  check_device_f32(out, "attention_fused_backward: out");
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
  const Dims z = make_dims(s);
  const int64_t rows = s.B * s.NH * s.T;

  // delta[B, NH, T] scratch, stream-ordered
  float* delta = nullptr;
  MT_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&delta), sizeof(float) * rows, stream()));
  attention_delta_kernel<<<(unsigned)ceil_div(rows, kWarps), kThreads, 0, stream()>>>(delta, dout.f32(), out.f32(),
                                                                                       rows, z);
  MT_CUDA_LAUNCHED("attention_delta_kernel");

  const unsigned tiles = (unsigned)ceil_div(s.T, kTile);
  const size_t dkv_bytes = shared_bytes(attention_dkv_kernel, z, 4, 2);
  attention_dkv_kernel<<<dim3(tiles, (unsigned)s.NKV, (unsigned)s.B), kThreads, dkv_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z);
  MT_CUDA_LAUNCHED("attention_dkv_kernel");

  const size_t dq_bytes = shared_bytes(attention_dq_kernel, z, 4, 2);
  attention_dq_kernel<<<dim3(tiles, (unsigned)s.NH, (unsigned)s.B), kThreads, dq_bytes, stream()>>>(
      dqkv.f32(), qkv.f32(), dout.f32(), lse.f32(), delta, z);
  MT_CUDA_LAUNCHED("attention_dq_kernel");

  MT_CUDA_CHECK(cudaFreeAsync(delta, stream()));
}

}  // namespace mt::cuda
