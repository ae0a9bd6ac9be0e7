// The warp-level tensor-core and asynchronous-copy primitives the mma.sync attention
// kernels (attention_mma.cu, attention_mma_backward.cu) share, as PTX: 16-bit packing,
// mma.m16n8k16 with fp32 accumulators, ldmatrix.x4, cp.async, the copy of a 64-row tile
// into shared memory and the product of fp32 accumulators (as 16-bit A) with a tile.
// Fragment layouts: attention_mma_layout.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "ops/cuda/attention_mma_layout.h"

namespace mt::cuda::mma_sync {

// The kernels' shared-memory tiles: kTileRows rows of D 16-bit elements at row stride D + 8
// (16 bytes past a multiple of 128 at D = 64 and 128: the 8 row addresses of an ldmatrix hit
// distinct bank quads).
constexpr int kTileRows = 64;
template <int D> constexpr int tile_ld() { return D + 8; }
template <int D> constexpr int tile_bytes() { return kTileRows * tile_ld<D>() * 2; }

// Two floats rounded to T16 and packed: lo in bits 0..15 (the lower column index).
template <class T16> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}
template <> __device__ __forceinline__ uint32_t pack2<half>(float lo, float hi) {
  half2 v = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

// d += A B (m16n8k16, fp32 accumulators), A in a[4], B in (b0, b1).
template <class T16> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                                    uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.x4 (optionally .trans) from the shared-memory address `addr` this lane supplies.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// cp.async global -> shared of 16 bytes (.cg: through L2 only) or 4 bytes (.ca); src_size 0
// writes zeros (src is then a valid address that is not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"((unsigned long long)__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
               "l"((unsigned long long)__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// cp.async of rows [r0, r0 + 64) of a [T, D] T16 matrix at src (row stride ld elements, rows
// 16-byte aligned) into the [64][tile_ld] tile at shared address dst, zeros past T, by the
// block's kThreads threads: chunk c = threadIdx.x + i kThreads of 8 elements is row
// c / (D / 8), dims 8 (c % (D / 8)) .. + 8.
template <class T16, int D, int kThreads>
__device__ __forceinline__ void issue_tile(uint32_t dst, const T16* __restrict__ src, int64_t ld, int r0, int T) {
  constexpr int C8 = D / 8;
  static_assert(kTileRows * C8 % kThreads == 0, "whole chunks per thread");
  #pragma unroll
  for (int i = 0; i < kTileRows * C8 / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c / C8, d = 8 * (c % C8), row = r0 + r;
    cp_async16(dst + 2u * (uint32_t)(r * tile_ld<D>() + d), row < T ? src + (int64_t)row * ld + d : src, row < T);
  }
}

// out[D / 8] += P (16 rows x kCols, from the fp32 accumulators p, rounded to T16) times B
// (kCols rows x D, stored row-major in a shared tile, ldmatrix.trans at bt_lane + 2 (16 st
// LD + 16 n2) bytes): k-steps st in order, those with skip(st) true left out (P = 0 there).
// The forward's O += P V; the backward's dV += P^T dO, dK += dS^T Q and dQ += dS K.
template <class T16, int D, int kCols, class Skip>
__device__ __forceinline__ void pv_product(float (&out)[D / 8][4], const float (&p)[kCols / 8][4], uint32_t bt_lane,
                                           Skip skip) {
  namespace ml = mma_layout;
  constexpr int LD = tile_ld<D>();
  #pragma unroll
  for (int st = 0; st < kCols / 16; ++st) {
    if (skip(st)) continue;
    uint32_t pa[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j)
      pa[j] = pack2<T16>(p[ml::p_tile(st, j)][ml::p_elem(j, 0)], p[ml::p_tile(st, j)][ml::p_elem(j, 1)]);
    #pragma unroll
    for (int n2 = 0; n2 < D / 16; ++n2) {
      uint32_t bv[4];
      ldsm_x4_trans(bv, bt_lane + 2u * (uint32_t)(16 * st * LD + 16 * n2));
      mma16816<T16>(out[2 * n2], pa, bv[0], bv[1]);
      mma16816<T16>(out[2 * n2 + 1], pa, bv[2], bv[3]);
    }
  }
}

}  // namespace mt::cuda::mma_sync
