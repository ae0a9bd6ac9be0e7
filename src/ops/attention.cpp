// Causal grouped-query self-attention on a fused qkv buffer, materialized variant: the
// softmax probabilities are kept for backward. Per-head sgemm calls.
//
// Layout: qkv[B, T, W], W = (NH + 2 NKV) D. For batch b, query head h is the strided
// matrix Q_h[T, D] at qkv + b T W + h D (row stride W); key head k at column (NH + k) D,
// value head k at column (NH + NKV + k) D. Query head h reads kv head h / G, G = NH / NKV.
//
// The causal mask makes the score matrix lower triangular. Rows are cut into blocks of
// kBlock: row block i only needs key columns [0, end of block i), so each GEMM below is
// issued per block and the fully masked upper triangle (about half the work) is skipped.
// The entries above the diagonal inside a diagonal block are computed and then zeroed.
//
// Parallelism and determinism: forward runs one task per (b, h), backward one task per
// (b, kv head) that walks its G query heads in order and accumulates their dK/dV in that
// order. Each task is serial (OpenBLAS runs single-threaded inside an OpenMP region), so
// nothing depends on the thread count.
#include "ops/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "core/profile.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {

constexpr int kBlock = 64;

static_assert(kBlock % kLanes == 0, "row padding must stay inside the GEMM's block");

// Row length n rounded up to whole kLanes groups, capped at T. Never past the end of the
// row's kBlock block, so every entry below np was written by the block GEMM.
inline int64_t padded_len(int64_t n, int64_t T) { return std::min(T, (n + kLanes - 1) / kLanes * kLanes); }

// C[r0:r1, 0:r1] = alpha * A[r0:r1] @ B[0:r1]^T for each row block (A, B: T x D, strided).
// Block-lower part of a T x T matrix with leading dim T.
void gemm_lower_nt(int64_t T, int64_t D, float alpha, const float* A, int64_t lda, const float* Bm, int64_t ldb,
                   float* C) {
  for (int64_t r0 = 0; r0 < T; r0 += kBlock) {
    const int64_t r1 = std::min(T, r0 + kBlock);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(r1 - r0), (int)r1, (int)D, alpha, A + r0 * lda,
                (int)lda, Bm, (int)ldb, 0.0f, C + r0 * T, (int)T);
  }
}

// Out[r0:r1] = P[r0:r1, 0:r1] @ X[0:r1] for each row block (P: T x T block-lower, X: T x D).
void gemm_lower_nn(int64_t T, int64_t D, const float* P, const float* X, int64_t ldx, float* Out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < T; r0 += kBlock) {
    const int64_t r1 = std::min(T, r0 + kBlock);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(r1 - r0), (int)D, (int)r1, 1.0f, P + r0 * T,
                (int)T, X, (int)ldx, 0.0f, Out + r0 * ldo, (int)ldo);
  }
}

// Out[c0:c1] (= or +=) P[c0:T, c0:c1]^T @ X[c0:T] for each column block: P^T X with P
// block-lower (rows above c0 are zero in columns c0..c1).
void gemm_lower_tn(int64_t T, int64_t D, const float* P, const float* X, int64_t ldx, float* Out, int64_t ldo,
                   float beta) {
  for (int64_t c0 = 0; c0 < T; c0 += kBlock) {
    const int64_t c1 = std::min(T, c0 + kBlock);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(c1 - c0), (int)D, (int)(T - c0), 1.0f,
                P + c0 * T + c0, (int)T, X + c0 * ldx, (int)ldx, beta, Out + c0 * ldo, (int)ldo);
  }
}

}  // namespace

AttentionShape attention_shape(const Tensor& qkv, int n_head, int n_kv_head, const char* op) {
  // Shapes only: the GPU's callers (context parallelism's ring) use it too.
  MT_CHECK(qkv.defined() && qkv.dtype() == DType::f32, op << ": qkv must be a defined f32 tensor");
  MT_CHECK(qkv.ndim() == 3, op << ": qkv must be 3-D [B, T, (NH + 2 NKV) D], got " << shape_str(qkv.shape()));
  MT_CHECK(n_head > 0 && n_kv_head > 0 && n_head % n_kv_head == 0,
           op << ": n_head = " << n_head << " must be a positive multiple of n_kv_head = " << n_kv_head);
  AttentionShape s;
  s.B = qkv.dim(0);
  s.T = qkv.dim(1);
  s.W = qkv.dim(2);
  s.NH = n_head;
  s.NKV = n_kv_head;
  s.G = n_head / n_kv_head;
  const int64_t heads = s.NH + 2 * s.NKV;
  MT_CHECK(s.W % heads == 0 && s.W > 0, op << ": qkv's last dim " << s.W << " is not a multiple of NH + 2 NKV = "
                                           << heads);
  s.D = s.W / heads;
  return s;
}

// out[B, T, NH D]; att[B, NH, T, T] = softmax probabilities (zero above the diagonal)
void attention_forward(const Tensor& out, const Tensor& att, const Tensor& qkv, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention");
  const AttentionShape s = attention_shape(qkv, n_head, n_kv_head, "attention_forward");
  check_f32(out, "attention_forward: out");
  check_f32(att, "attention_forward: att");
  check_numel(out, s.B * s.T * s.NH * s.D, "attention_forward: out ([B, T, NH * D])");
  check_numel(att, s.B * s.NH * s.T * s.T, "attention_forward: att ([B, NH, T, T])");
  const int64_t T = s.T, D = s.D, W = s.W, NH = s.NH, OW = s.NH * s.D;
  const float scale = 1.0f / std::sqrt((float)D);
  const float* qkvp = qkv.f32();
  float* op = out.f32();
  float* attp = att.f32();
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < s.B * NH; ++bh) {
    const int64_t b = bh / NH, h = bh % NH, kh = h / s.G;
    const float* base = qkvp + b * T * W;
    const float* Q = base + h * D;
    const float* K = base + (NH + kh) * D;
    const float* V = base + (NH + s.NKV + kh) * D;
    float* P = attp + bh * T * T;
    gemm_lower_nt(T, D, scale, Q, W, K, W, P);
    for (int64_t t = 0; t < T; ++t) {
      float* row = P + t * T;
      // Softmax over keys 0..t. The row is processed up to np (t + 1 rounded up to whole
      // kLanes groups, still inside the block the GEMM computed) with the masked entries set
      // to -inf: exp gives exactly 0 there, so the sums are unchanged and no loop has a tail.
      const int64_t n = t + 1, np = padded_len(n, T);
      for (int64_t k = n; k < np; ++k) row[k] = -INFINITY;
      const float m = max_f32(row, np);
      float acc[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= np; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const float e = exp_f32(row[i + j] - m);
          row[i + j] = e;
          acc[j] += e;
        }
      for (int j = 0; j < kLanes && i < np; ++i, ++j) {
        const float e = exp_f32(row[i] - m);
        row[i] = e;
        acc[j] += e;
      }
      const float inv = 1.0f / reduce_lanes(acc);
      for (int64_t k = 0; k < np; ++k) row[k] *= inv;
      for (int64_t k = np; k < T; ++k) row[k] = 0.0f;
    }
    gemm_lower_nn(T, D, P, V, W, op + b * T * OW + h * D, OW);
  }
}

// With S = scale Q K^T, P = softmax(S), O = P V:
//   dP = dO V^T ; dS = P (dP - rowsum(P dP)) ; dQ = scale dS K ; dK = scale dS^T Q ; dV = P^T dO
void attention_backward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout, const Tensor& qkv,
                        const Tensor& att, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention_backward");
  const AttentionShape s = attention_shape(qkv, n_head, n_kv_head, "attention_backward");
  check_f32(dqkv, "attention_backward: dqkv");
  check_f32(scratch, "attention_backward: scratch");
  check_f32(dout, "attention_backward: dout");
  check_f32(att, "attention_backward: att");
  check_numel(dqkv, qkv.numel(), "attention_backward: dqkv (must match qkv)");
  check_numel(dout, s.B * s.T * s.NH * s.D, "attention_backward: dout ([B, T, NH * D])");
  check_numel(att, s.B * s.NH * s.T * s.T, "attention_backward: att ([B, NH, T, T])");
  MT_CHECK(scratch.numel() >= s.B * s.NH * s.T * s.T,
           "attention_backward: scratch has " << scratch.numel() << " floats, needs B*NH*T*T = "
                                              << s.B * s.NH * s.T * s.T);
  const int64_t T = s.T, D = s.D, W = s.W, NH = s.NH, NKV = s.NKV, OW = s.NH * s.D;
  const float scale = 1.0f / std::sqrt((float)D);
  const float* qkvp = qkv.f32();
  const float* dop = dout.f32();
  const float* attp = att.f32();
  float* dqkvp = dqkv.f32();
  float* scrp = scratch.f32();
#pragma omp parallel for schedule(static)
  for (int64_t bk = 0; bk < s.B * NKV; ++bk) {
    const int64_t b = bk / NKV, kh = bk % NKV;
    const float* base = qkvp + b * T * W;
    float* dbase = dqkvp + b * T * W;
    const float* K = base + (NH + kh) * D;
    const float* V = base + (NH + NKV + kh) * D;
    float* dK = dbase + (NH + kh) * D;
    float* dV = dbase + (NH + NKV + kh) * D;
    for (int64_t g = 0; g < s.G; ++g) {
      const int64_t h = kh * s.G + g;
      const float* Q = base + h * D;
      float* dQ = dbase + h * D;
      const float* dO = dop + b * T * OW + h * D;
      const float* P = attp + (b * NH + h) * T * T;
      float* dS = scrp + (b * NH + h) * T * T;
      const float beta = g == 0 ? 0.0f : 1.0f;  // first query head of the group overwrites
      gemm_lower_tn(T, D, P, dO, OW, dV, W, beta);
      gemm_lower_nt(T, D, 1.0f, dO, OW, V, W, dS);  // dP
      for (int64_t t = 0; t < T; ++t) {
        const float* p = P + t * T;
        float* d = dS + t * T;
        // Up to np (as in forward) p is 0 past the diagonal and dP is finite (computed by
        // the block GEMM), so those entries add 0 to the dot and get dS = 0.
        const int64_t np = padded_len(t + 1, T);
        const float dot = dot_f32(p, d, np);
        for (int64_t k = 0; k < np; ++k) d[k] = p[k] * (d[k] - dot) * scale;
        // Zero the rest of the block: the diagonal block's GEMMs read it.
        const int64_t blk_end = std::min(T, (t / kBlock + 1) * kBlock);
        for (int64_t k = np; k < blk_end; ++k) d[k] = 0.0f;
      }
      gemm_lower_nn(T, D, dS, K, W, dQ, W);
      gemm_lower_tn(T, D, dS, Q, W, dK, W, beta);
    }
  }
}

}  // namespace mt
