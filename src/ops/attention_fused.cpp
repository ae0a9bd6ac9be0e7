// Fused causal grouped-query attention: an online softmax over key blocks in forward, only
// the row log-sum-exp kept, the probabilities recomputed block by block in backward. One
// kernel serves the whole sequence (attention_fused_*) and parts of it (attention_part_*).
//
// Layout as in attention.cpp: for batch b, query head h is the strided matrix Q[T, D] at
// qkv + b T W + h D (row stride W); its kv head k = h / G has K at column (NH + k) D and V
// at column (NH + NKV + k) D.
//
// A part: Tq query rows against Tk key rows, in their buffers from rows q.first and
// k.first. Query row i (i = 0 .. Tq-1 of the part) sees key row j when j <= i + off, off =
// q.position - k.position: each row sees a prefix of the keys, off = 0 is the diagonal
// (the whole sequence: q = k = all rows), off >= Tk sees all keys, off <= -Tq none. Keys
// that no query sees (j >= Tq + off) are left out from the start (Tk counts only the rest).
//
// Blocks: query rows in blocks of kQ, keys in blocks of kK from key 0. A query block
// [r0, r1) visits the key blocks that start before key_end = min(Tk, r1 + off); a row that
// sees no key of a block it visits (possible only where off is not 0) sees none of the
// later ones either, and is left out of the running softmax there. On the diagonal (off =
// 0) kK is a multiple of kQ, so a key block that starts before a query block's end also
// starts at or before its first row: every row sees a key of every block it visits.
//
// Forward, one task per (b, h); for each query block i (rows [r0, r1)):
//   for each key block j (keys [c0, c1), c0 < key_end):
//     S = scale Q_i K_j^T  (keys s > t set to -inf)                        [kQ, kK]
//     m' = max(m, rowmax S); a = exp(m - m'); P = exp(S - m'); l = a l + rowsum P
//     O_i = a O_i + P V_j
//   O_i /= l; lse_i = m + log l  (out 0, lse -inf where l = 0: no key seen), then, for a part
//   merged into earlier parts: lse' = log(e^lse + e^lse_i), out' = out e^(lse - lse') + ...
// Backward, one task per (b, kv head); for each of its G query heads in order, each
// query block i, each key block j:
//   P = exp(scale Q_i K_j^T - lse_i); dP = dO_i V_j^T; dS = scale P (dP - delta_i)
//   dV_j += P^T dO_i; dQ_i += dS K_j; dK_j += dS^T Q_i
// where delta_i = rowsum(dO_i * O_i). The softmax backward needs rowsum(P * dP) per row,
// and sum_s P_ts dP_ts = dO_t . sum_s P_ts V_s = dO_t . O_t, so no row has to be complete
// before its dS can be formed; with the final (merged) O and lse the same holds across
// parts, so each part's backward runs alone. The whole sequence overwrites dQ, dK, dV; a
// part adds into them.
//
// Matrix products: the block products are small (64 x 256 x 64), where a library GEMM
// spends much of its time packing its operands. Here one register-tiled kernel
// (gemm_rows) computes them all: it reads its right operand as contiguous rows of whole
// vectors and its left operand element by element at any strides, so a transposed left
// operand (P^T, dS^T) costs nothing. Each task lays out K^T (pre-scaled by 1/sqrt(D)) and
// V^T once per head, key columns padded to whole vectors. The [T, D] operands (Q, K, V,
// dO) and results (dQ, dK, dV) are used in place when D is a whole number of vectors,
// else through workspace rows padded to one. Tiles the causal mask zeroes are skipped
// (Causal). Workspaces are per thread, about 2 Tk D + 2 kQ kK floats (5 Tk D when copies
// are needed), kept between calls.
//
// Determinism: block sizes are constants, so the sequence of float operations depends
// only on the shapes. Each task is serial and writes disjoint outputs; a kv head's dK/dV
// accumulate over its query heads, query blocks and key blocks in that fixed order.
// Nothing depends on the thread count.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "core/profile.h"
#include "ops/cuda/attention_part.h"
#include "ops/cuda/ops.h"
#include "ops/attention.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {

// Block sizes, measured with bench/bench_attention at GPT-2 head shapes (D = 64, T = 256
// and 1024): kQ from 32 to 256 and kK from 128 to 1024 are within a few percent of each
// other once the products skip the masked tiles; 64 x 256 keeps the two [kQ, kK]
// workspace blocks (128 KiB) in the L2 cache.
constexpr int64_t kQ = 64;   // query rows per block
constexpr int64_t kK = 256;  // keys per block
static_assert(kK % kQ == 0, "key blocks must start at query block boundaries");

// The product kernel's vector (floats) and register tile: kMR rows x 2 vectors of C.
// With AVX-512, 8 x 2 x 16 lanes = 16 accumulators of the 32 registers; with 8 lanes
// (AVX2: 16 registers), 6 x 2 = 12 accumulators.
#ifdef __AVX512F__
constexpr int kVL = 16;
constexpr int kMR = 8;
constexpr int kNV = 2;
#else
constexpr int kVL = 8;
constexpr int kMR = 6;
constexpr int kNV = 2;
#endif
typedef float vecf __attribute__((vector_size(kVL * sizeof(float)), aligned(4), may_alias));

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Row stride of a workspace matrix with n columns: whole vectors, an odd number of them,
// so that the rows a product walks down spread over the cache sets (a stride of a power
// of two bytes would map them all to a few sets and evict each other).
inline int64_t row_stride(int64_t n) {
  const int64_t v = round_up(n, kVL) / kVL;
  return (v | 1) * kVL;
}

// C[MR, NV kVL] (=, or += when acc) sum_k A(r, k) B[k, :], A(r, k) = A[r ars + k aks].
template <int MR, int NV>
void tile(int64_t K, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb, float* C, int64_t ldc,
          bool acc) {
  vecf c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = vecf{};
  for (int64_t k = 0; k < K; ++k) {
    vecf b[NV];
    for (int v = 0; v < NV; ++v) b[v] = *(const vecf*)(B + k * ldb + v * kVL);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * ars + k * aks];
      for (int v = 0; v < NV; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      vecf* p = (vecf*)(C + r * ldc + v * kVL);
      *p = acc ? *p + c[r][v] : c[r][v];
    }
}

using TileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, bool);

// kTiles[r - 1][v - 1] = tile<r, v>: every row count up to kMR, every vector count up to kNV.
template <int R, int... V>
constexpr std::array<TileFn, kNV> tiles_of_rows(std::integer_sequence<int, V...>) {
  return {&tile<R, V + 1>...};
}
template <int... R>
constexpr std::array<std::array<TileFn, kNV>, kMR> make_tiles(std::integer_sequence<int, R...>) {
  return {tiles_of_rows<R + 1>(std::make_integer_sequence<int, kNV>{})...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMR>{});

// Which terms of a product inside a (query block, key block) pair are known to be zero
// or unused, from the causal mask: query row i sees key column k when k <= i + off,
// off = (first query row) - (first key) + (the part's off).
struct Causal {
  enum Kind {
    c_scores,   // C is [query, key]: tiles wholly above the diagonal are not computed
    a_scores,   // A is [query, key], K runs over keys: a row tile sums only keys its rows see
    at_scores,  // A is [key, query] (transposed), K runs over queries: a row tile sums only
                // the queries that see its keys
  } kind;
  int64_t off;
};

// C[M, N] (=, or += when acc) A B with A(i, k) = A[i ars + k aks] and B row-major [K, N]
// (row stride ldb). N must be a multiple of kVL; C's rows (stride ldc) hold N floats.
// Each element of C sums its K products in order k = 0, 1, ..., leaving out only terms
// that `causal` says are zero, and tiles whose results it says are unused.
void gemm_rows(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb,
               float* C, int64_t ldc, bool acc, Causal causal) {
  for (int64_t i = 0; i < M; i += kMR) {
    const int64_t mr = std::min<int64_t>(kMR, M - i);
    for (int64_t j = 0; j < N; j += kNV * kVL) {
      const int64_t nv = std::min<int64_t>(kNV, (N - j) / kVL);
      int64_t k0 = 0, k1 = K;
      if (causal.kind == Causal::c_scores && j > i + mr - 1 + causal.off) break;  // and all tiles to the right
      if (causal.kind == Causal::a_scores) k1 = std::clamp<int64_t>(i + mr + causal.off, 0, K);
      if (causal.kind == Causal::at_scores) k0 = std::min(K, std::max<int64_t>(0, i - causal.off));
      kTiles[mr - 1][nv - 1](k1 - k0, A + i * ars + k0 * aks, ars, aks, B + k0 * ldb + j, ldb, C + i * ldc + j, ldc,
                             acc);
    }
  }
}

// dst[D, Tp] = alpha src^T for src [T, D] with row stride lds; columns T..Tp zero.
void pack_transposed(float* dst, const float* src, int64_t T, int64_t Tp, int64_t D, int64_t lds, float alpha) {
  for (int64_t t0 = 0; t0 < T; t0 += kVL) {  // kVL source rows at a time: their lines stay cached across d
    const int64_t t1 = std::min(t0 + kVL, T);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = t0; t < t1; ++t) dst[d * Tp + t] = alpha * src[t * lds + d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(dst + d * Tp + T, dst + (d + 1) * Tp, 0.0f);
}

// dst[T, Dp] = src [T, D] (row stride lds); columns D..Dp zero.
void pack_rows(float* dst, const float* src, int64_t T, int64_t D, int64_t Dp, int64_t lds) {
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(dst + t * Dp, src + t * lds, D * sizeof(float));
    std::fill(dst + t * Dp + D, dst + (t + 1) * Dp, 0.0f);
  }
}

// A [rows, D] operand or result of the products: rows of Dp floats at stride ld.
struct In {
  const float* p;
  int64_t ld;
};
struct Out {
  float* p;
  int64_t ld;
};

// row[k] = exp(row[k] - m) for k < n; returns the sum, in kLanes partial sums.
inline float exp_shift_sum(float* row, int64_t n, float m) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float e = exp_f32(row[k + j] - m);
      row[k + j] = e;
      acc[j] += e;
    }
  for (int j = 0; k < n; ++k, ++j) {
    const float e = exp_f32(row[k] - m);
    row[k] = e;
    acc[j] += e;
  }
  return reduce_lanes(acc);
}

// Sizes shared by forward and backward: Tq query rows, Tk key rows, query row i sees key
// row j when j <= i + off.
struct Dims {
  int64_t Tq, Tk, off, D, W;
  int64_t Tp, Sp;  // row strides (row_stride) of workspace rows of Tk and of kK columns
  int64_t Dp;      // D rounded up to whole vectors: the row stride of [*, D] workspaces
  // [*, D] operands are used in place when their rows are whole vectors, else copied
  // into workspace rows padded to Dp.
  bool in_place() const { return D == Dp; }
  In rows_in(const float* src, int64_t ld, int64_t n, std::vector<float>& buf) const {
    if (in_place()) return {src, ld};
    pack_rows(buf.data(), src, n, D, Dp, ld);
    return {buf.data(), Dp};
  }
  // The products' output rows at dst [n, D]: dst itself, or workspace rows (copied back
  // with rows_copy_out) that hold dst's values when `load` (to add to them).
  Out rows_out(float* dst, int64_t ld, int64_t n, bool load, std::vector<float>& buf) const {
    if (in_place()) return {dst, ld};
    if (load) pack_rows(buf.data(), dst, n, D, Dp, ld);
    return {buf.data(), Dp};
  }
  // Keys [0, key_end) are seen by some row of a query block that ends at r1 (none if <= 0).
  int64_t key_end(int64_t r1) const { return std::min(Tk, r1 + off); }
};

Dims make_dims(const AttentionShape& s, int64_t Tq, int64_t Tk, int64_t off) {
  return {Tq, Tk, off, s.D, s.W, row_stride(Tk), row_stride(kK), round_up(s.D, kVL)};
}

// dst[n, D] (row stride ld) = o's rows, unless o is dst itself.
void rows_copy_out(const Dims& z, const Out& o, float* dst, int64_t ld, int64_t n) {
  if (o.p == dst) return;
  for (int64_t t = 0; t < n; ++t) std::memcpy(dst + t * ld, o.p + t * o.ld, z.D * sizeof(float));
}

// One (query block, key block) pair: rows [r0, r1), keys [c0, c0 + wp) (whole vectors;
// c1 - c0 of them real), the part's off. Row i sees keys k < visible(i) (possibly none),
// the rest of its wp are masked.
struct Pair {
  int64_t r0, r1, c0, c1, wp, off;
  int64_t visible(int64_t i) const { return std::clamp<int64_t>(r0 + i + 1 + off - c0, 0, c1 - c0); }
  Causal causal(Causal::Kind kind) const { return {kind, r0 + off - c0}; }
};

// S[n, wp] (row stride Sp) = Q[r0:r1] Kt[:, c0:c0+wp] (Kt pre-scaled). Tiles wholly past
// the diagonal are left undefined: callers overwrite every masked entry.
void scores(const Dims& z, const float* Q, const float* Kt, const Pair& pr, float* S) {
  gemm_rows(pr.r1 - pr.r0, pr.wp, z.D, Q + pr.r0 * z.W, z.W, 1, Kt + pr.c0, z.Tp, S, z.Sp, false,
            pr.causal(Causal::c_scores));
}

// Row i of a score block: exp(row - m) on the visible keys (whole kLanes groups, the masked
// ones in them set to -inf so they give exactly 0), 0 on the rest; returns the sum.
inline float exp_row(float* row, int64_t v, int64_t wp, float m) {
  const int64_t vp = std::min(wp, round_up(v, kLanes));
  std::fill(row + v, row + vp, -INFINITY);
  const float sum = exp_shift_sum(row, vp, m);
  std::fill(row + vp, row + wp, 0.0f);
  return sum;
}

// Workspaces are per thread and kept between calls, grown when a call needs more: fresh
// pages on every call (and the faults that map them) cost more than the work at small
// shapes. Nothing is read from them before the call has written it.
inline void grow(std::vector<float>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
}

// The forward's: Kt [D, Tp] (scaled), S [kQ, Sp], O [kQ, Dp], m, l [kQ]; V [Tk, Dp] when
// not in place.
struct ForwardWork {
  std::vector<float> Kt, V, S, O, m, l;
  void fit(const Dims& z) {
    grow(Kt, z.D * z.Tp), grow(S, kQ * z.Sp), grow(O, kQ * z.Dp), grow(m, kQ), grow(l, kQ);
    if (!z.in_place()) grow(V, z.Tk * z.Dp);
  }
};

// A query row's result from its running O [Dp], max m and sum l: out [D] and *lse, this
// part alone (merge = false) or merged into what they hold. l = 0: the row saw no key.
void finish_row(const float* O, float m, float l, int64_t D, float* out, float* lse, bool merge) {
  if (l == 0.0f) {  // no key seen: the empty part (out 0, lse -inf), which merges as nothing
    if (!merge) std::fill_n(out, D, 0.0f), *lse = -INFINITY;
    return;
  }
  const float inv = 1.0f / l, lp = m + std::log(l);
  if (!merge || *lse == -INFINITY) {  // the part alone
    for (int64_t d = 0; d < D; ++d) out[d] = O[d] * inv;
    *lse = lp;
    return;
  }
  // lse' = log(e^lse + e^lp) = hi + log(1 + e^(lo - hi)): no overflow, exact when one side
  // dominates.
  const float hi = std::max(*lse, lp), lo = std::min(*lse, lp);
  const float merged = hi + std::log1p(std::exp(lo - hi));
  const float a = std::exp(*lse - merged), b = std::exp(lp - merged) * inv;
  for (int64_t d = 0; d < D; ++d) out[d] = out[d] * a + O[d] * b;
  *lse = merged;
}

// One head: out[Tq, D] (row stride ldo), lse[Tq], from Q [Tq, D] (row stride W), V [Tk, D]
// and the packed Kt (scaled) in w; alone or merged (finish_row).
void forward_head(const Dims& z, const float* Q, const In& V, ForwardWork& w, float* out, int64_t ldo, float* lse,
                  bool merge) {
  const int64_t Dp = z.Dp;
  for (int64_t r0 = 0; r0 < z.Tq; r0 += kQ) {
    const int64_t r1 = std::min(r0 + kQ, z.Tq), n = r1 - r0, key_end = z.key_end(r1);
    std::fill(w.m.begin(), w.m.begin() + n, -INFINITY);
    std::fill(w.l.begin(), w.l.begin() + n, 0.0f);
    for (int64_t c0 = 0; c0 < key_end; c0 += kK) {
      const int64_t c1 = std::min(c0 + kK, key_end);
      const Pair pr{r0, r1, c0, c1, round_up(c1 - c0, kVL), z.off};
      scores(z, Q, w.Kt.data(), pr, w.S.data());
      for (int64_t i = 0; i < n; ++i) {
        float* row = w.S.data() + i * z.Sp;
        const int64_t v = pr.visible(i);
        if (v == 0) {  // sees no key here (nor in later blocks): m, l, O stay
          std::fill(row, row + pr.wp, 0.0f);
          continue;
        }
        const float mi = std::max(w.m[i], max_f32(row, v));
        const float a = exp_f32(w.m[i] - mi);  // rescales what earlier blocks summed (0 on the first)
        w.l[i] = a * w.l[i] + exp_row(row, v, pr.wp, mi);
        w.m[i] = mi;
        if (c0 > 0 && a != 1.0f)
          for (int64_t d = 0; d < Dp; ++d) w.O[i * Dp + d] *= a;
      }
      gemm_rows(n, Dp, c1 - c0, w.S.data(), z.Sp, 1, V.p + c0 * V.ld, V.ld, w.O.data(), Dp, c0 > 0,
                pr.causal(Causal::a_scores));
    }
    for (int64_t i = 0; i < n; ++i)
      finish_row(w.O.data() + i * Dp, w.m[i], w.l[i], z.D, out + (r0 + i) * ldo, lse + r0 + i, merge);
  }
}

// The backward's: Kt (scaled), Vt [D, Tp]; P, dS [kQ, Sp]; delta [kQ]; when not in
// place K, dK, dV [T, Dp] and Q, dO, dQ [kQ, Dp].
struct BackwardWork {
  std::vector<float> Kt, Vt, K, dK, dV, P, dS, Q, dO, dQ, delta;
  void fit(const Dims& z) {
    for (auto* v : {&Kt, &Vt}) grow(*v, z.D * z.Tp);
    for (auto* v : {&P, &dS}) grow(*v, kQ * z.Sp);
    grow(delta, kQ);
    if (z.in_place()) return;
    for (auto* v : {&K, &dK, &dV}) grow(*v, z.Tk * z.Dp);
    for (auto* v : {&Q, &dO, &dQ}) grow(*v, kQ * z.Dp);
  }
};

// One query head's contribution: writes (acc: adds into) dQ [Tq, D] (row stride W), adds
// into dK and dV [Tk, D]. Q [Tq, D] (row stride W); dO, O [Tq, D] (row stride ldo); lse [Tq].
void backward_head(const Dims& z, float scale, const float* Q, const float* dO, const float* O, int64_t ldo,
                   const float* lse, const In& K, float* dQ, bool acc, const Out& dK, const Out& dV,
                   BackwardWork& w) {
  const int64_t Tp = z.Tp, Sp = z.Sp;
  float* P = w.P.data();
  float* dS = w.dS.data();
  for (int64_t r0 = 0; r0 < z.Tq; r0 += kQ) {
    const int64_t r1 = std::min(r0 + kQ, z.Tq), n = r1 - r0, key_end = z.key_end(r1);
    if (key_end <= 0) {  // these rows see no key: their dQ gets nothing
      for (int64_t i = 0; i < n && !acc; ++i) std::fill_n(dQ + (r0 + i) * z.W, z.D, 0.0f);
      continue;
    }
    const In Qi = z.rows_in(Q + r0 * z.W, z.W, n, w.Q), dOi = z.rows_in(dO + r0 * ldo, ldo, n, w.dO);
    const Out dQi = z.rows_out(dQ + r0 * z.W, z.W, n, acc, w.dQ);
    for (int64_t i = 0; i < n; ++i) w.delta[i] = dot_f32(dOi.p + i * dOi.ld, O + (r0 + i) * ldo, z.D);
    for (int64_t c0 = 0; c0 < key_end; c0 += kK) {
      const int64_t c1 = std::min(c0 + kK, key_end);
      const Pair pr{r0, r1, c0, c1, round_up(c1 - c0, kVL), z.off};
      scores(z, Q, w.Kt.data(), pr, P);
      for (int64_t i = 0; i < n; ++i) exp_row(P + i * Sp, pr.visible(i), pr.wp, lse[r0 + i]);  // P
      gemm_rows(n, pr.wp, z.D, dOi.p, dOi.ld, 1, w.Vt.data() + c0, Tp, dS, Sp, false,
                pr.causal(Causal::c_scores));  // dP = dO V^T
      gemm_rows(c1 - c0, z.Dp, n, P, 1, Sp, dOi.p, dOi.ld, dV.p + c0 * dV.ld, dV.ld, true,
                pr.causal(Causal::at_scores));  // dV += P^T dO
      for (int64_t i = 0; i < n; ++i) {  // dS = scale P (dP - delta), 0 where masked
        const float* p = P + i * Sp;
        float* d = dS + i * Sp;
        const float di = w.delta[i];
        const int64_t v = pr.visible(i);
        for (int64_t k = 0; k < v; ++k) d[k] = p[k] * (d[k] - di) * scale;
        std::fill(d + v, d + pr.wp, 0.0f);
      }
      gemm_rows(n, z.Dp, c1 - c0, dS, Sp, 1, K.p + c0 * K.ld, K.ld, dQi.p, dQi.ld, acc || c0 > 0,
                pr.causal(Causal::a_scores));  // dQ (+)= dS K
      gemm_rows(c1 - c0, z.Dp, n, dS, 1, Sp, Qi.p, Qi.ld, dK.p + c0 * dK.ld, dK.ld, true,
                pr.causal(Causal::at_scores));  // dK += dS^T Q
    }
    rows_copy_out(z, dQi, dQ + r0 * z.W, z.W, n);
  }
}

// One part (rows q of qkv_q against rows k of qkv_kv, both [B, T*, W]; checked) into
// out [B, Tq, NH D] and lse [B, NH, Tq]; the whole sequence is q = k = all rows at 0.
struct PartArgs {
  AttentionShape s;  // qkv_q's (T: its rows)
  int64_t Tk;        // qkv_kv's rows
  AttentionRows q, k;
  int64_t kv_w = s.W, kv_col = s.NH * s.D;  // qkv_kv's row width, its first key column
  Dims dims() const {
    const int64_t off = q.position - k.position;
    return make_dims(s, q.count, std::clamp<int64_t>(q.count + off, 0, k.count), off);
  }
  // The first query / key row of batch b in a buffer whose rows are `width` wide.
  int64_t q_at(int64_t b, int64_t width) const { return (b * s.T + q.first) * width; }
  int64_t k_at(int64_t b, int64_t width) const { return (b * Tk + k.first) * width; }
};

void part_forward(const PartArgs& a, float* out, float* lse, const float* qkv_q, const float* qkv_kv, bool merge) {
  const Dims z = a.dims();
  if (z.Tq == 0 || (z.Tk == 0 && merge)) return;  // no query, or none sees a key: nothing to merge
  const AttentionShape& s = a.s;
  const int64_t D = s.D, W = s.W, NH = s.NH, OW = s.NH * s.D, KW = a.kv_w;
  const float scale = 1.0f / std::sqrt((float)D);
#pragma omp parallel
  {
    static thread_local ForwardWork w;
    w.fit(z);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < s.B * NH; ++bh) {
      const int64_t b = bh / NH, h = bh % NH, kh = h / s.G;
      const float* kv = qkv_kv + a.k_at(b, KW) + a.kv_col;  // key head 0 of the part's first row
      pack_transposed(w.Kt.data(), kv + kh * D, z.Tk, z.Tp, D, KW, scale);
      const In V = z.rows_in(kv + (s.NKV + kh) * D, KW, z.Tk, w.V);
      forward_head(z, qkv_q + a.q_at(b, W) + h * D, V, w, out + a.q_at(b, OW) + h * D, OW,
                   lse + bh * s.T + a.q.first, merge);
    }
  }
}

// acc = false: dqkv_q's query columns and dqkv_kv's key and value columns of the rows are
// overwritten (only for a part whose rows all see a key and all keys, the whole sequence).
void part_backward(const PartArgs& a, float* dqkv_q, float* dqkv_kv, const float* dout, const float* qkv_q,
                   const float* out, const float* lse, const float* qkv_kv, bool acc) {
  const Dims z = a.dims();
  if (z.Tq == 0 || (z.Tk == 0 && acc)) return;  // no query, or none sees a key: nothing to add
  const AttentionShape& s = a.s;
  const int64_t D = s.D, W = s.W, NH = s.NH, NKV = s.NKV, OW = s.NH * s.D;
  const float scale = 1.0f / std::sqrt((float)D);
#pragma omp parallel
  {
    static thread_local BackwardWork w;
    w.fit(z);
#pragma omp for schedule(static)
    for (int64_t bk = 0; bk < s.B * NKV; ++bk) {
      const int64_t b = bk / NKV, kh = bk % NKV;
      const float* kv = qkv_kv + a.k_at(b, W);
      pack_transposed(w.Kt.data(), kv + (NH + kh) * D, z.Tk, z.Tp, D, W, scale);
      pack_transposed(w.Vt.data(), kv + (NH + NKV + kh) * D, z.Tk, z.Tp, D, W, 1.0f);
      const In K = z.rows_in(kv + (NH + kh) * D, W, z.Tk, w.K);
      float* dKp = dqkv_kv + a.k_at(b, W) + (NH + kh) * D;
      float* dVp = dqkv_kv + a.k_at(b, W) + (NH + NKV + kh) * D;
      const Out dK = z.rows_out(dKp, W, z.Tk, acc, w.dK), dV = z.rows_out(dVp, W, z.Tk, acc, w.dV);
      for (int64_t t = 0; t < z.Tk && !acc; ++t) {  // dK and dV sum over the group's query heads
        std::fill_n(dK.p + t * dK.ld, z.Dp, 0.0f);
        std::fill_n(dV.p + t * dV.ld, z.Dp, 0.0f);
      }
      for (int64_t g = 0; g < s.G; ++g) {
        const int64_t h = kh * s.G + g;
        backward_head(z, scale, qkv_q + a.q_at(b, W) + h * D, dout + a.q_at(b, OW) + h * D,
                      out + a.q_at(b, OW) + h * D, OW, lse + (b * NH + h) * s.T + a.q.first, K,
                      dqkv_q + a.q_at(b, W) + h * D, acc, dK, dV, w);
      }
      rows_copy_out(z, dK, dKp, W, z.Tk);
      rows_copy_out(z, dV, dVp, W, z.Tk);
    }
  }
}

// A part call's arguments, checked: rows inside their buffers, qkv_kv [B, Tk, W] like qkv_q
// (kv_only: [B, Tk, 2 NKV D], the key and value columns of such rows).
PartArgs part_args(const Tensor& qkv_q, AttentionRows q, const Tensor& qkv_kv, AttentionRows k, int n_head,
                   int n_kv_head, const char* op, bool kv_only = false) {
  PartArgs a{attention_shape(qkv_q, n_head, n_kv_head, op), 0, q, k};
  if (kv_only) a.kv_w = 2 * a.s.NKV * a.s.D, a.kv_col = 0;
  check_f32(qkv_kv, op);
  MT_CHECK(qkv_kv.ndim() == 3 && qkv_kv.dim(0) == a.s.B && qkv_kv.dim(2) == a.kv_w,
           op << ": qkv_kv has shape " << shape_str(qkv_kv.shape()) << ", expected [B, Tk, " << (kv_only ? "2 NKV D" : "W")
              << "] = [" << a.s.B << ", Tk, " << a.kv_w << "] like qkv_q " << shape_str(qkv_q.shape()));
  a.Tk = qkv_kv.dim(1);
  for (auto [r, T, name] : {std::tuple{q, a.s.T, "q"}, {k, a.Tk, "k"}}) {
    MT_CHECK(r.first >= 0 && r.count >= 0 && r.first <= T - r.count,
             op << ": " << name << " rows [" << r.first << ", " << r.first + r.count << ") are not inside the "
                << T << " rows of qkv_" << (name[0] == 'q' ? "q" : "kv") << " (first >= 0, count >= 0)");
    MT_CHECK(r.position >= 0, op << ": " << name << " rows at position " << r.position << ", expected >= 0");
  }
  return a;
}

}  // namespace

// out[B, T, NH D]; lse[B, NH, T]: the part of all rows against all rows.
void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention");
  MT_ON_CUDA(out, attention_fused_forward(out, lse, qkv, n_head, n_kv_head));
  const AttentionShape s = attention_shape(qkv, n_head, n_kv_head, "attention_fused_forward");
  check_f32(out, "attention_fused_forward: out");
  check_f32(lse, "attention_fused_forward: lse");
  check_numel(out, s.B * s.T * s.NH * s.D, "attention_fused_forward: out ([B, T, NH * D])");
  check_numel(lse, s.B * s.NH * s.T, "attention_fused_forward: lse ([B, NH, T])");
  const AttentionRows all{0, s.T, 0};
  part_forward({s, s.T, all, all}, out.f32(), lse.f32(), qkv.f32(), qkv.f32(), false);
}

bool attention_fused_reads_16bit(const Tensor& qkv, int n_head, int n_kv_head) {
  MT_TRY_ON_CUDA(qkv, attention_fused_reads_16bit(qkv, n_head, n_kv_head));
  return false;
}

void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention_backward");
  MT_ON_CUDA(dqkv, attention_fused_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head));
  const AttentionShape s = attention_shape(qkv, n_head, n_kv_head, "attention_fused_backward");
  check_f32(dqkv, "attention_fused_backward: dqkv");
  check_f32(dout, "attention_fused_backward: dout");
  check_f32(out, "attention_fused_backward: out");
  check_f32(lse, "attention_fused_backward: lse");
  check_numel(dqkv, qkv.numel(), "attention_fused_backward: dqkv (must match qkv)");
  check_numel(dout, s.B * s.T * s.NH * s.D, "attention_fused_backward: dout ([B, T, NH * D])");
  check_numel(out, s.B * s.T * s.NH * s.D, "attention_fused_backward: out ([B, T, NH * D])");
  check_numel(lse, s.B * s.NH * s.T, "attention_fused_backward: lse ([B, NH, T])");
  const AttentionRows all{0, s.T, 0};
  part_backward({s, s.T, all, all}, dqkv.f32(), dqkv.f32(), dout.f32(), qkv.f32(), out.f32(), lse.f32(), qkv.f32(),
                false);
}

namespace {

// A part forward's arguments checked (op names the caller), then the part: qkv_kv holds fused
// rows, or (kv_only) their key and value columns.
void checked_part_forward(const char* op, const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                          const Tensor& qkv_kv, AttentionRows k, int n_head, int n_kv_head, bool merge, bool kv_only) {
  const PartArgs a = part_args(qkv_q, q, qkv_kv, k, n_head, n_kv_head, op, kv_only);
  const AttentionShape& s = a.s;
  const std::string name = op;
  check_f32(out, (name + ": out").c_str());
  check_f32(lse, (name + ": lse").c_str());
  check_numel(out, s.B * s.T * s.NH * s.D, (name + ": out ([B, Tq, NH * D], Tq = qkv_q's rows)").c_str());
  check_numel(lse, s.B * s.NH * s.T, (name + ": lse ([B, NH, Tq])").c_str());
  part_forward(a, out.f32(), lse.f32(), qkv_q.f32(), qkv_kv.f32(), merge);
}

}  // namespace

void attention_part_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                            const Tensor& qkv_kv, AttentionRows k, int n_head, int n_kv_head, bool merge) {
  ProfileScope profile_scope("attention");
  MT_ON_CUDA(out, attention_part_forward(out, lse, qkv_q, q, qkv_kv, k, n_head, n_kv_head, merge));
  checked_part_forward("attention_part_forward", out, lse, qkv_q, q, qkv_kv, k, n_head, n_kv_head, merge, false);
}

void attention_kv_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv_q, AttentionRows q,
                          const Tensor& kv, AttentionRows k, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention");
  checked_part_forward("attention_kv_forward", out, lse, qkv_q, q, kv, k, n_head, n_kv_head, false, true);
}

void attention_part_backward(const Tensor& dqkv_q, const Tensor& dqkv_kv, const Tensor& dout, const Tensor& qkv_q,
                             const Tensor& out, const Tensor& lse, AttentionRows q, const Tensor& qkv_kv,
                             AttentionRows k, int n_head, int n_kv_head) {
  ProfileScope profile_scope("attention_backward");
  MT_ON_CUDA(dqkv_q, attention_part_backward(dqkv_q, dqkv_kv, dout, qkv_q, out, lse, q, qkv_kv, k, n_head, n_kv_head));
  const PartArgs a = part_args(qkv_q, q, qkv_kv, k, n_head, n_kv_head, "attention_part_backward");
  const AttentionShape& s = a.s;
  check_f32(dqkv_q, "attention_part_backward: dqkv_q");
  check_f32(dqkv_kv, "attention_part_backward: dqkv_kv");
  check_f32(dout, "attention_part_backward: dout");
  check_f32(out, "attention_part_backward: out");
  check_f32(lse, "attention_part_backward: lse");
  check_numel(dqkv_q, qkv_q.numel(), "attention_part_backward: dqkv_q (must match qkv_q)");
  check_numel(dqkv_kv, qkv_kv.numel(), "attention_part_backward: dqkv_kv (must match qkv_kv)");
  check_numel(dout, s.B * s.T * s.NH * s.D, "attention_part_backward: dout ([B, Tq, NH * D])");
  check_numel(out, s.B * s.T * s.NH * s.D, "attention_part_backward: out ([B, Tq, NH * D])");
  check_numel(lse, s.B * s.NH * s.T, "attention_part_backward: lse ([B, NH, Tq])");
  part_backward(a, dqkv_q.f32(), dqkv_kv.f32(), dout.f32(), qkv_q.f32(), out.f32(), lse.f32(), qkv_kv.f32(), true);
}

}  // namespace mt
