// Tensor-core causal grouped-query attention FORWARD on mma.sync.m16n8k16 (FlashAttention-2
// style) for D = 64 and 128, 16-bit operands (bf16 or f16), fp32 accumulation. Same
// semantics, bit for bit in every rounding step but the fp32 summation order, as the WMMA
// forward in attention_tc.cu (see attention_tc.h):
//   - q, k, v read from qkv[B, T, W] in T16 (the caller rounds fp32 values to T16, round to
//     nearest, where it holds them in fp32: attention_tc_forward);
//   - x = s * scale in fp32 (s the fp32-accumulated Q K^T, scale = 1/sqrt(D));
//   - a lazily updated reference max m per row: per 64-key tile, mt = max x over the row's
//     unmasked keys; if mt > m + kSlack (8): O, l *= expf(m - mt) (when m was finite), m = mt;
//   - p = expf(x - m) in fp32; l += sum of the fp32 p (unrounded); P rounded to T16 as the
//     A operand of P V;
//   - out = O * (1 / l), lse = m + logf(l) (natural log); rows >= T are not written.
//
// Kernel attention_mma_forward_kernel<T16, D>. NW = 8 warps at D = 64, 4 at D = 128
// (mma_warps), M = 16 NW query rows per block. Grid (ceil(T / M), NH, B), 32 NW threads.
// Block x takes the query tile qt = gridDim.x - 1 - x (the longest tiles start first):
// rows q0 = M qt + [0, M) of head h = y, batch b = z; warp w owns the 16 rows
// q0 + 16 w + [0, 16). The block walks the 64-key tiles k0 = 0, 64, ... holding a key <= its
// last row and < T. A warp skips (after helping load) a tile whose keys all follow its rows;
// it masks (key > row: x = -inf, p = 0) only in a tile where some key follows its first row.
// Keys >= T (zeros in shared memory) only occur in the last tile: masked for every row < T;
// the rows >= T (zero queries) are computed but never written. The lazy max sees the same
// 64-key tiles as the WMMA kernel's (a tile wholly after a row leaves its m, l, O alone).
//
// Registers per lane (g = lane / 4, t = lane % 4; see attention_mma_layout.h):
//   qf[D / 16][4]  Q as A operands, one k-step of 16 dims each, loaded once from global
//                  memory: register j holds (row g + 8 (j % 2), dims 2 t + 8 (j / 2) + {0, 1}).
//   s[8][4]        S = Q K^T of the tile, 8 accumulators of 8 keys: s[n][i] at row
//                  g + 8 (i / 2), key 8 n + 2 t + (i % 2); then x, then p in place.
//   o[D / 8][4]    O, 8 dims per accumulator: o[n][i] at row g + 8 (i / 2), dim 8 n + 2 t + i % 2.
//   m[2], l[2]     the statistics of rows g and g + 8 (the same in the 4 lanes of a quad;
//                  row reductions are quad butterflies: shfl_xor 1 then 2).
// P as the A operand of the k-step over keys [16 s, 16 s + 16) packs, without any data
// movement, register j = (s[2 s + j / 2][2 (j % 2)], s[2 s + j / 2][2 (j % 2) + 1]).
//
// Shared memory (dynamic): two buffers of K and V tiles [64 keys][D + 8] of T16 (row stride
// D + 8 elements = 16 bytes past a multiple of 128: the 8 row addresses of an ldmatrix hit
// distinct bank quads), 36,864 bytes at D = 64, 69,632 at D = 128 (the limit raised with
// cudaFuncSetAttribute). K feeds the B operand of S = Q K^T by ldmatrix.x4 (8 keys x 32
// dims), V the B operand of O += P V by ldmatrix.x4.trans (16 keys x 16 dims). Tiles are
// loaded by 16-byte cp.async (.cg) copies straight into buffer kt % 2 (zero-filled rows >= T),
// one tile ahead. Per key tile kt:
//   cp.async.wait_group 0 (this thread's copies of tile kt landed); __syncthreads (all landed;
//   every warp done reading buffer (kt + 1) % 2, tile kt - 1's); cp.async of tile kt + 1 into
//   buffer (kt + 1) % 2, commit; then the tile's products, overlapping the copies.
//
// Work skipped where masked (warp-uniform): S blocks of 8 keys wholly after the warp's last
// row and P V k-steps of 16 keys wholly after it.
//
// Expected occupancy (H100: 64K registers, 228 KB shared memory per SM): D = 64: 128
// registers x 256 threads, 36 KB: 2 blocks (16 warps) per SM; D = 128: 255 registers x 128
// threads, 68 KB: 2 blocks (8 warps) per SM.
// Register-bound (__launch_bounds__(32 NW, 2)); the shared memory fits 2 blocks either way.
//
// Determinism: no atomics; every accumulator sums its k-steps in a fixed order; the grid
// depends only on the shapes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/attention_mma_layout.h"
#include "ops/cuda/attention_tc.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/mma_sync.cuh"

namespace mt::cuda {

namespace {

namespace ml = mma_layout;
using namespace mma_sync;

constexpr int kN = kTileRows;          // keys per key tile (64)
constexpr float kMmaSlack = 8.0f;      // the WMMA forward's kSlack (same lazy max)
// Warps per block (warp w owns the block's query rows [16 w, 16 w + 16); 16 NW rows per
// block): 8 at D = 64 (2 blocks of 128 rows per SM by registers; each K / V tile loaded once
// for 128 query rows), 4 at D = 128 (2 blocks of 64 rows per SM: 255 registers per thread).
template <int D> constexpr int mma_warps() { return D <= 64 ? 8 : 4; }

struct MmaDims {
  int T, NH, NKV, G;
  int64_t W, OW;
  float scale;
};

// Dynamic shared memory: two buffers of (K, V) tiles.
template <int D> constexpr int mma_smem_bytes() { return 4 * tile_bytes<D>(); }

// O: the output's type, float or T16 (then each value rounded to nearest even, the bits of
// the fp32 output converted).
template <class T16, class O, int D>
__global__ void __launch_bounds__(32 * mma_warps<D>(), 2)
    attention_mma_forward_kernel(O* __restrict__ out, float* __restrict__ lse, const T16* __restrict__ qkv,
                                 MmaDims z) {
  static_assert(D % 32 == 0 && D <= 128, "D = 64 or 128");
  constexpr int LD = tile_ld<D>();
  constexpr int NQ = D / 16;  // k-steps of S = Q K^T (Q fragments)
  constexpr int NO = D / 8;   // O accumulators of 8 dims
  constexpr int NS = kN / 8;  // S accumulators of 8 keys
  constexpr int kM = 16 * mma_warps<D>();  // query rows per block
  constexpr uint32_t kTileB = tile_bytes<D>();
  extern __shared__ __align__(128) unsigned char smem[];  // buffer f: K at 2 f kTileB, V at (2 f + 1) kTileB

  const int qt = gridDim.x - 1 - blockIdx.x, q0 = qt * kM, h = blockIdx.y, b = blockIdx.z, kh = h / z.G;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, w0 = 16 * warp;  // w0: warp's first row in the tile
  const int g = lane / 4, tq = lane % 4;
  const T16* base = qkv + (int64_t)b * z.T * z.W;
  const T16* Kg = base + (int64_t)(z.NH + kh) * D;
  const T16* Vg = base + (int64_t)(z.NH + z.NKV + kh) * D;

  // Q fragments, straight from global memory: register j = the pair of 16-bit columns (col,
  // col + 1), lower column in the low half as stored (rows >= T: zeros).
  uint32_t qf[NQ][4];
  #pragma unroll
  for (int kk = 0; kk < NQ; ++kk)
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = q0 + w0 + ml::q_reg_row(lane, j), col = 16 * kk + ml::q_reg_col(lane, j);
      qf[kk][j] = row < z.T ? *reinterpret_cast<const uint32_t*>(base + (int64_t)row * z.W + (int64_t)h * D + col) : 0u;
    }

  float o[NO][4];
  #pragma unroll
  for (int n = 0; n < NO; ++n)
    #pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows w0 + g, w0 + g + 8

  const uint32_t tiles = (uint32_t)__cvta_generic_to_shared(smem);
  // this lane's ldmatrix row addresses (bytes) in buffer 0's K and V tiles, before the tile offsets
  const uint32_t k_lane = tiles + 2u * (uint32_t)(ml::k_ldm_key(lane) * LD + ml::k_ldm_dim(lane));
  const uint32_t v_lane = tiles + kTileB + 2u * (uint32_t)(ml::v_ldm_key(lane) * LD + ml::v_ldm_dim(lane));

  // key tiles: those holding a key <= the block's last row, and < T
  const int nkt = (int)min((int64_t)(q0 + kM + kN - 1) / kN, (int64_t)(z.T + kN - 1) / kN);
  const int wr = q0 + w0;  // the warp's first row
  issue_tile<T16, D, 32 * mma_warps<D>()>(tiles, Kg, z.W, 0, z.T);  // tile 0 in flight, into buffer 0
  issue_tile<T16, D, 32 * mma_warps<D>()>(tiles + kTileB, Vg, z.W, 0, z.T);
  cp_async_commit();
  for (int kt = 0; kt < nkt; ++kt) {
    const int k0 = kt * kN;
    cp_async_wait_all();  // this thread's copies of tile kt have landed
    __syncthreads();      // every thread's have; every warp is done reading tile kt - 1's buffer
    if (kt + 1 < nkt) {   // tile kt + 1 in flight into the other buffer during this tile's products
      const uint32_t next = tiles + 2u * kTileB * (uint32_t)((kt + 1) % 2);
      issue_tile<T16, D, 32 * mma_warps<D>()>(next, Kg, z.W, k0 + kN, z.T);
      issue_tile<T16, D, 32 * mma_warps<D>()>(next + kTileB, Vg, z.W, k0 + kN, z.T);
      cp_async_commit();
    }
    const uint32_t kb = k_lane + 2u * kTileB * (uint32_t)(kt % 2), vb = v_lane + 2u * kTileB * (uint32_t)(kt % 2);
    if (k0 > wr + 15) continue;  // every key after every row of the warp (warp-uniform): P = 0
    const bool diag = k0 + kN - 1 > wr;  // some key after some row of the warp: mask key > row

    // S = Q K^T: s[n] over keys [8 n, 8 n + 8), k-steps over dims in order.
    float s[NS][4];
    #pragma unroll
    for (int n = 0; n < NS; ++n) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
      if (k0 + 8 * n > wr + 15) continue;  // all masked for the warp's rows (warp-uniform)
      #pragma unroll
      for (int c = 0; c < D / 32; ++c) {
        uint32_t bk[4];
        ldsm_x4(bk, kb + 2u * (uint32_t)(8 * n * LD + 32 * c));
        mma16816<T16>(s[n], qf[2 * c], bk[0], bk[1]);
        mma16816<T16>(s[n], qf[2 * c + 1], bk[2], bk[3]);
      }
    }

    // x = s * scale, masked -inf; the tile's row max over unmasked keys (-inf for a row before
    // every key of the tile: then m, finite since tile 0 (key 0 precedes every row), stays, a = 1
    // and p = 0, as the WMMA kernel, whose 64-row blocks never visit that tile, has it).
    float mx[2] = {-INFINITY, -INFINITY};
    #pragma unroll
    for (int n = 0; n < NS; ++n)
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = k0 + 8 * n + ml::c_col(lane, i), row = wr + ml::c_row(lane, i);
        const float x = s[n][i] * z.scale;
        const bool ok = !diag || key <= row;
        s[n][i] = ok ? x : -INFINITY;
        if (ok) mx[i / 2] = fmaxf(mx[i / 2], x);
      }
    float a[2];  // the rows' rescale factors
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      a[r] = 1.0f;
      if (mx[r] > m[r] + kMmaSlack) {  // the same in the 4 lanes of the quad
        if (m[r] != -INFINITY) a[r] = expf(m[r] - mx[r]);
        m[r] = mx[r];
      }
    }
    float rs[2] = {0.0f, 0.0f};
    #pragma unroll
    for (int n = 0; n < NS; ++n)
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = expf(s[n][i] - m[i / 2]);  // expf(-inf) = 0 for the masked
        s[n][i] = p;
        rs[i / 2] += p;
      }
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);  // butterfly: the same bits in the quad
      rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
      l[r] = a[r] * l[r] + rs[r];
    }
    #pragma unroll
    for (int n = 0; n < NO; ++n)
      #pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] *= a[i / 2];

    // O += P V: k-steps over the tile's keys [16 st, 16 st + 16) in order; P = 0 past the
    // warp's last row (a warp-uniform skip).
    pv_product<T16, D, kN>(o, s, vb, [&](int st) { return k0 + 16 * st > wr + 15; });
  }

  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + w0 + g + 8 * r;
    if (row >= z.T) continue;
    const float inv = 1.0f / l[r];  // every row < T sees key 0: l > 0
    if (tq == 0) lse[((int64_t)b * z.NH + h) * z.T + row] = m[r] + logf(l[r]);
    O* orow = out + ((int64_t)b * z.T + row) * z.OW + (int64_t)h * D;
    #pragma unroll
    for (int n = 0; n < NO; ++n) {
      const float lo = o[n][2 * r] * inv, hi = o[n][2 * r + 1] * inv;
      if constexpr (std::is_same_v<O, float>)
        *reinterpret_cast<float2*>(orow + 8 * n + 2 * tq) = make_float2(lo, hi);
      else
        *reinterpret_cast<uint32_t*>(orow + 8 * n + 2 * tq) = pack2<T16>(lo, hi);
    }
  }
}

template <class T16, class O, int D>
void launch(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  constexpr int bytes = mma_smem_bytes<D>();
  static_assert(bytes <= 227 * 1024, "shared memory above the H100's 227 KiB per block");
  auto kernel = attention_mma_forward_kernel<T16, O, D>;
  // every launch, as attention_tc.cu does (the attribute is per device)
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
  MmaDims z;
  z.T = (int)s.T;
  z.NH = (int)s.NH;
  z.NKV = (int)s.NKV;
  z.G = (int)s.G;
  z.W = s.W;
  z.OW = s.NH * s.D;
  z.scale = 1.0f / std::sqrt((float)s.D);  // as the WMMA forward
  constexpr int kM = 16 * mma_warps<D>();
  const dim3 grid((unsigned)ceil_div(s.T, kM), (unsigned)s.NH, (unsigned)s.B);
  kernel<<<grid, 32 * mma_warps<D>(), bytes, stream()>>>(static_cast<O*>(out.raw()), lse.f32(),
                                                         static_cast<const T16*>(qkv.raw()), z);
  MT_CUDA_LAUNCHED("attention_mma_forward_kernel");
}

template <class T16, class O>
void launch_out(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  if (s.D == 64)
    launch<T16, O, 64>(out, lse, qkv, s);
  else
    launch<T16, O, 128>(out, lse, qkv, s);
}

template <class T16>
void launch_typed(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s) {
  if (out.dtype() == DType::f32)
    launch_out<T16, float>(out, lse, qkv, s);
  else
    launch_out<T16, T16>(out, lse, qkv, s);
}

template <class T16, int D>
int occupancy_d() {
  constexpr int bytes = mma_smem_bytes<D>();
  auto kernel = attention_mma_forward_kernel<T16, float, D>;
  if (bytes > 48 * 1024)
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     (int)cudaSharedmemCarveoutMaxShared));
  int n = 0;
  MT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 32 * mma_warps<D>(), bytes));
  return n;
}

}  // namespace

bool attention_mma_supported(int64_t D) { return D == 64 || D == 128; }

bool attention_mma_aligned(const Tensor& out, const Tensor& qkv) {
  // an fp32 qkv is converted into (256-byte aligned) scratch first; out is written in pairs
  return (qkv.dtype() == DType::f32 || reinterpret_cast<uintptr_t>(qkv.raw()) % 16 == 0) &&
         reinterpret_cast<uintptr_t>(out.raw()) % (2 * dtype_size(out.dtype())) == 0;
}

void attention_mma_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& s,
                           DType dt) {
  MT_CHECK(attention_mma_supported(s.D), "attention_mma_forward: head dim D = " << s.D << " not supported (64, 128)");
  MT_CHECK(dt == DType::bf16 || dt == DType::f16,
           "attention_mma_forward: 16-bit dtype expected, got " << dtype_name(dt));
  MT_CHECK(qkv.dtype() == dt, "attention_mma_forward: qkv in " << dtype_name(qkv.dtype()) << ", expected " << dtype_name(dt));
  MT_CHECK(out.dtype() == DType::f32 || out.dtype() == dt,
           "attention_mma_forward: out in " << dtype_name(out.dtype()) << ", expected f32 or " << dtype_name(dt));
  MT_CHECK(attention_mma_aligned(out, qkv),
           "attention_mma_forward: qkv must be 16-byte and out 2-element (8 or 4 bytes) aligned");
  MT_CHECK(s.T <= (int64_t)1 << 30 && s.B <= 65535 && s.NH <= 65535,
           "attention_mma_forward: B = " << s.B << ", T = " << s.T << ", NH = " << s.NH << " outside the CUDA grid");
  if (s.B == 0 || s.T == 0) return;
  if (dt == DType::bf16)
    launch_typed<__nv_bfloat16>(out, lse, qkv, s);
  else
    launch_typed<half>(out, lse, qkv, s);
}

int attention_mma_occupancy(int64_t D, DType dt, int64_t* smem_bytes) {
  MT_CHECK(attention_mma_supported(D), "attention_mma_occupancy: head dim D = " << D << " not supported (64, 128)");
  if (smem_bytes) *smem_bytes = D == 64 ? mma_smem_bytes<64>() : mma_smem_bytes<128>();
  if (D == 64) return dt == DType::f16 ? occupancy_d<half, 64>() : occupancy_d<__nv_bfloat16, 64>();
  return dt == DType::f16 ? occupancy_d<half, 128>() : occupancy_d<__nv_bfloat16, 128>();
}

}  // namespace mt::cuda
