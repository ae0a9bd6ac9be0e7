// bf16 matrix products on AVX512_BF16 (see gemm_bf16.h).
//
// Blocking: k in blocks of kKC (even); for each, op(B)'s columns, kNC at a time, are packed
// into panels of kNR columns and then op(A)'s rows, kMB at a time, into panels of kMR rows,
// both in bf16 pairs along k (the layout vdpbf16ps reads). A micro-kernel computes a kMR x
// kNR tile over the block in 28 fp32 registers and adds it into C: each element's sum runs
// over the k blocks in order, whatever thread computes its tile. Packing reads fp32 or bf16
// operands, rounds and pairs 16 values per instruction (a scalar packing cost as much as
// the products at K = 2048). Measured with 2 threads on an AMD EPYC (AVX-512, AVX512_BF16)
// on the benchmark GPT-2's 15 products (2048 tokens; forward, input and weight gradients)
// against gemm on the same operands: 1.10x to 1.95x OpenBLAS's AVX-512 kernels (1.47x over
// all; ~350 GFLOP/s against ~520), 2.68x its AVX2 ones; a whole bf16 step: bench/bf16.sh.
#include "ops/gemm_bf16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/machine.h"  // env_switch_on

namespace mt {

namespace {

constexpr int64_t kMR = 14, kNR = 32, kKC = 512, kNC = 4096, kMB = 292 * kMR;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A kMR x kNR tile over kp pairs of k: a [kp][kMR] pairs (low half: the even k), b
// [kp][kNR][2]; C[mr rows, the columns in masks lo / hi] = (add ? C : 0) + the sums.
__attribute__((target("avx512f,avx512bf16"))) void tile(int64_t kp, const uint32_t* a, const uint16_t* b, float* c,
                                                         int64_t ldc, int64_t mr, __mmask16 lo, __mmask16 hi,
                                                         bool add) {
  __m512 acc[kMR][2];
  for (int i = 0; i < kMR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + k * 2 * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + k * 2 * kNR + kNR);
#pragma GCC unroll 14
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[k * kMR + i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  for (int64_t i = 0; i < mr; ++i) {
    float* row = c + i * ldc;
    __m512 v0 = acc[i][0], v1 = acc[i][1];
    if (add) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(lo, row), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(hi, row + 16), v1);
    }
    _mm512_mask_storeu_ps(row, lo, v0);
    _mm512_mask_storeu_ps(row + 16, hi, v1);
  }
}

__mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

// (The shifts and narrowing below use the zero-masked intrinsics: GCC 12 warns about the
// plain ones' undefined pass-through.)
// x's lanes rounded to the nearest bf16 (ties to even; NaN stays NaN), each in the high 16
// bits of its 32 (the low 16 are junk).
__attribute__((target("avx512f"))) __m512i round_high(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(0xffff, u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
}

// 16 elements of src from element i (those in m; others 0) as bf16, each in the high 16
// bits of its 32: fp32 values rounded (round_high), bf16 bits widened.
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m512i load_high(Bf16Src src, int64_t i, __mmask16 m) {
  if (!src.bf16) return round_high(_mm512_maskz_loadu_ps(m, static_cast<const float*>(src.data) + i));
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src.data) + i);
  return _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16);
}

// Pairs from two rows at elements i0 and i1 of src: out[j] = (bf16 of row 1's j) << 16 |
// bf16 of row 0's j, for the lanes in m (others 0); i1 < 0: row 1's half is 0.
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m512i pair_rows(Bf16Src src, int64_t i0, int64_t i1,
                                                                        __mmask16 m) {
  const __m512i lo = _mm512_maskz_srli_epi32(0xffff, load_high(src, i0, m), 16);
  if (i1 < 0) return lo;
  const __m512i hi = _mm512_and_si512(load_high(src, i1, m), _mm512_set1_epi32(int(0xffff0000)));
  return _mm512_or_si512(lo, hi);
}

// Pairs of neighbours from element i of src: out[j] = (bf16 of s[2j + 1]) << 16 | bf16 of
// s[2j], j < 8, with s = src from i and only its elements in m (others 0).
__attribute__((target("avx512f,avx512bw,avx512vl"))) __m256i pair_neighbours(Bf16Src src, int64_t i, __mmask16 m) {
  const __m512i r = load_high(src, i, m);  // 64-bit lanes: s[2j] high in the low half, s[2j + 1] high in the high
  const __m512i lo = _mm512_and_si512(_mm512_maskz_srli_epi64(0xff, r, 16), _mm512_set1_epi64(0xffff));
  const __m512i hi = _mm512_and_si512(_mm512_maskz_srli_epi64(0xff, r, 32), _mm512_set1_epi64(0xffff0000));
  return _mm512_maskz_cvtepi64_epi32(0xff, _mm512_or_si512(lo, hi));
}

// One panel of `width` lanes (kMR rows of op(A), or kNR columns of op(B)) over kp pairs of
// k from k0 (kc values of k): out[k][lane] = the pair at (first + lane, k0 + 2k). along_k:
// the panel's lanes are rows of src (element (lane, k) at src[lane * ld + k]), else columns
// (at src[k * ld + lane]); `count` lanes exist (the rest are 0).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void pack_panel(uint32_t* out, int64_t width, Bf16Src src,
                                                                      int64_t ld, bool along_k, int64_t first,
                                                                      int64_t count, int64_t k0, int64_t kc) {
  const int64_t kp = cdiv(kc, 2);
  if (!along_k) {  // rows k and k + 1 of src hold the pair's halves for every lane
    for (int64_t k = 0; k < kp; ++k) {
      const int64_t r0 = (k0 + 2 * k) * ld + first, r1 = 2 * k + 1 < kc ? r0 + ld : -1;
      for (int64_t l = 0; l < width; l += 16)
        _mm512_mask_storeu_epi32(out + k * width + l, lanes(width - l),
                                 pair_rows(src, r0 + l, r1 < 0 ? -1 : r1 + l, lanes(count - l)));
    }
    return;
  }
  alignas(32) uint32_t p[8];
  for (int64_t lane = 0; lane < width; ++lane)
    for (int64_t k = 0; k < kp; k += 8) {  // 8 pairs of one lane at a time
      if (lane < count)
        _mm256_store_si256(reinterpret_cast<__m256i*>(p),
                           pair_neighbours(src, (first + lane) * ld + k0 + 2 * k, lanes(kc - 2 * k)));
      for (int64_t j = 0; j < 8 && k + j < kp; ++j) out[(k + j) * width + lane] = lane < count ? p[j] : 0;
    }
}

}  // namespace

bool bf16_gemm_available() {
  static const bool available = [] {
    if (!env_switch_on("MESHTRAIN_CPU_BF16")) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return available;
}

std::string bf16_gemm_description() {
  if (bf16_gemm_available()) return "AVX512_BF16 kernel";
  if (!env_switch_on("MESHTRAIN_CPU_BF16")) return "fp32 products of rounded operands (MESHTRAIN_CPU_BF16=off)";
  return "fp32 products of rounded operands (this CPU has no AVX512_BF16)";
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, Bf16Src A, int64_t lda, Bf16Src B, int64_t ldb,
               float beta, float* C, int64_t ldc) {
  MT_CHECK(bf16_gemm_available(), "internal: gemm_bf16 called where the CPU has no AVX512_BF16 kernel");
  MT_CHECK(beta == 0.0f || beta == 1.0f, "internal: gemm_bf16 takes beta 0 or 1, got " << beta);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (beta == 0.0f)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  const int64_t nc_max = std::min(N, kNC);
  thread_local std::vector<uint32_t> a_pack;  // [panels of the row block][kp][kMR]
  thread_local std::vector<uint16_t> b_pack;  // [panels of the column block][kp][kNR][2]
  a_pack.resize(static_cast<size_t>(cdiv(std::min(M, kMB), kMR) * kMR * (kKC / 2)));
  b_pack.resize(static_cast<size_t>(cdiv(nc_max, kNR) * kNR * kKC));
  uint32_t* ap = a_pack.data();  // the calling thread's buffers (inside the parallel regions
  uint16_t* bp = b_pack.data();  // a thread_local name would be each thread's own)
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0), kp = cdiv(kc, 2);
    const bool add = k0 > 0 || beta == 1.0f;
    for (int64_t n0 = 0; n0 < N; n0 += kNC) {
      const int64_t nc = std::min(kNC, N - n0), pn = cdiv(nc, kNR);
      // op(B)[k0 : k0 + kc, n0 : n0 + nc] in column panels (columns past N and the odd k
      // past kc are zero)
#pragma omp parallel for schedule(static)
      for (int64_t q = 0; q < pn; ++q) {
        const int64_t n = n0 + q * kNR;
        pack_panel(reinterpret_cast<uint32_t*>(bp) + q * kp * kNR, kNR, B, ldb, tb, n, std::min(kNR, N - n), k0, kc);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMB) {
        const int64_t pm = cdiv(std::min(kMB, M - m0), kMR);
        // op(A)[m0 : m0 + kMB, k0 : k0 + kc] in row panels (rows past M are zero); a single
        // row block stays packed across the column blocks
        if (M > kMB || n0 == 0) {
#pragma omp parallel for schedule(static)
          for (int64_t p = 0; p < pm; ++p) {
            const int64_t m = m0 + p * kMR;
            pack_panel(ap + p * kp * kMR, kMR, A, lda, !ta, m, std::min(kMR, M - m), k0, kc);
          }
        }
#pragma omp parallel for schedule(static) collapse(2)
        for (int64_t p = 0; p < pm; ++p)
          for (int64_t q = 0; q < pn; ++q) {
            const int64_t m = m0 + p * kMR, n = n0 + q * kNR, cols = std::min(kNR, N - n);
            tile(kp, &ap[p * kp * kMR], &bp[q * kp * kNR * 2], C + m * ldc + n, ldc, std::min(kMR, M - m),
                 lanes(cols), lanes(cols - 16), add);
          }
      }
    }
  }
}

}  // namespace mt
