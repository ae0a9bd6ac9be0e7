// Token and position embeddings: a row gather forward, a deterministic scatter-add backward.
#include "ops/embedding.h"

#include <omp.h>

#include <algorithm>

#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/detail.h"

namespace mt {

using namespace detail;

namespace {
// tokens is [B, T] (leading dims fold into B). A 1-D tokens tensor takes T from `out`
// ([B, T, C]) when that is 3-D, so positions restart every T rows either way.
void check_tokens(const Tensor& tokens, const Tensor& out, int64_t V, int64_t& B, int64_t& T, const char* op) {
  check_i32(tokens, op);
  MT_CHECK(tokens.ndim() >= 1, op << ": tokens must be [B, T]");
  T = tokens.ndim() >= 2 ? tokens.dim(-1) : (out.ndim() >= 3 ? out.dim(-2) : tokens.numel());
  B = T ? tokens.numel() / T : 0;
  MT_CHECK(B * T == tokens.numel(), op << ": tokens " << shape_str(tokens.shape()) << " do not fold into [B, " << T
                                       << "] rows");
  // One pass over the ids is cheap next to the B*T*C gather and keeps a bad id from
  // reading or writing outside wte.
  const int32_t* tp = tokens.i32();
  const int64_t n = tokens.numel();
  int64_t bad = -1;
  for (int64_t i = 0; i < n; ++i)
    if (tp[i] < 0 || tp[i] >= V) {
      bad = i;
      break;
    }
  MT_CHECK(bad < 0, op << ": token id " << tp[bad] << " at position " << bad << " is outside the vocabulary [0, "
                       << V << "); check the tokenizer / model.vocab_size");
}
// dwte[id - begin] += g[bt] for the rows bt whose id is in [begin, begin + valid). Each
// thread owns a contiguous range of columns (whole cache lines) of every dwte row and adds
// the (b, t) rows in order: two equal tokens never race, and each element's sum order is
// the row order whatever the thread count or the split.
void scatter_rows(float* dwte, const float* g, const int32_t* ids, int64_t BT, int64_t C, int64_t begin,
                  int64_t valid) {
  constexpr int64_t CB = 16;
  const int64_t ncb = (C + CB - 1) / CB;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t c0 = std::min(C, (ncb * tid / nt) * CB), c1 = std::min(C, (ncb * (tid + 1) / nt) * CB);
    for (int64_t bt = 0; bt < BT && c1 > c0; ++bt) {
      const int64_t row = ids[bt] - begin;
      if (row < 0 || row >= valid) continue;
      float* d = dwte + row * C;
      const float* gr = g + bt * C;
      for (int64_t c = c0; c < c1; ++c) d[c] += gr[c];
    }
  }
}

// dwpe[t] += sum over b of g[b, t], in b order; rows t are independent.
void add_positions(float* dwpe, const float* g, int64_t B, int64_t T, int64_t C, const int32_t* pos = nullptr) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* d = dwpe + (pos ? pos[t] : t) * C;  // distinct rows: positions do not repeat
    for (int64_t b = 0; b < B; ++b) {
      const float* gr = g + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) d[c] += gr[c];
    }
  }
}

}  // namespace

// out[B, T, C] = wte[tokens[b, t]] (+ wpe[t])
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe) {
  ProfileScope profile_scope("embedding");
  MT_ON_CUDA(out, embedding_forward(out, tokens, wte, wpe));
  check_f32(out, "embedding_forward: out");
  check_f32(wte, "embedding_forward: wte");
  MT_CHECK(wte.ndim() == 2, "embedding_forward: wte must be [V, C], got " << shape_str(wte.shape()));
  const int64_t V = wte.dim(0), C = wte.dim(1);
  int64_t B, T;
  check_tokens(tokens, out, V, B, T, "embedding_forward: tokens");
  check_numel(out, B * T * C, "embedding_forward: out ([B, T, C])");
  MT_CHECK(out.dim(-1) == C, "embedding_forward: out's last dim " << out.dim(-1) << " != C = " << C);
  const float* wpep = nullptr;
  if (wpe) {
    check_f32(*wpe, "embedding_forward: wpe");
    MT_CHECK(wpe->ndim() == 2 && wpe->dim(1) == C && wpe->dim(0) >= T,
             "embedding_forward: wpe must be [maxT >= " << T << ", " << C << "], got " << shape_str(wpe->shape()));
    wpep = wpe->f32();
  }
  const int32_t* tp = tokens.i32();
  const float* wtep = wte.f32();
  float* op = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* e = wtep + (int64_t)tp[bt] * C;
    float* o = op + bt * C;
    if (wpep) {
      const float* p = wpep + (bt % T) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
    } else {
      std::copy(e, e + C, o);
    }
  }
}

// dwte[V, C] += scatter of dout[B, T, C] by token ; dwpe[maxT, C] += sum over b of dout
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens) {
  ProfileScope profile_scope("embedding_backward");
  MT_ON_CUDA(dwte, embedding_backward(dwte, dwpe, dout, tokens));
  check_f32(dwte, "embedding_backward: dwte");
  check_f32(dout, "embedding_backward: dout");
  MT_CHECK(dwte.ndim() == 2, "embedding_backward: dwte must be [V, C], got " << shape_str(dwte.shape()));
  const int64_t V = dwte.dim(0), C = dwte.dim(1);
  int64_t B, T;
  check_tokens(tokens, dout, V, B, T, "embedding_backward: tokens");
  check_numel(dout, B * T * C, "embedding_backward: dout ([B, T, C])");
  MT_CHECK(dout.dim(-1) == C, "embedding_backward: dout's last dim " << dout.dim(-1) << " != C = " << C);
  if (dwpe) {
    check_f32(*dwpe, "embedding_backward: dwpe");
    MT_CHECK(dwpe->ndim() == 2 && dwpe->dim(1) == C && dwpe->dim(0) >= T,
             "embedding_backward: dwpe must be [maxT >= " << T << ", " << C << "], got " << shape_str(dwpe->shape()));
  }
  scatter_rows(dwte.f32(), dout.f32(), tokens.i32(), B * T, C, 0, V);
  if (dwpe) add_positions(dwpe->f32(), dout.f32(), B, T, C);
}

// The vocabulary-parallel lookup: out[b, t] = wte[id - begin] for ids in [begin, begin + valid), else 0.
void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t begin, int64_t valid,
                             int64_t vocab) {
  ProfileScope profile_scope("embedding");
  MT_ON_CUDA(out, embedding_shard_forward(out, tokens, wte, begin, valid, vocab));
  check_f32(out, "embedding_shard_forward: out");
  check_f32(wte, "embedding_shard_forward: wte");
  MT_CHECK(wte.ndim() == 2 && valid <= wte.dim(0), "embedding_shard_forward: wte must be [>= " << valid << ", C], got "
                                                                                            << shape_str(wte.shape()));
  const int64_t C = wte.dim(1);
  int64_t B, T;
  check_tokens(tokens, out, vocab, B, T, "embedding_shard_forward: tokens");
  check_numel(out, B * T * C, "embedding_shard_forward: out ([B, T, C])");
  const int32_t* tp = tokens.i32();
  const float* wtep = wte.f32();
  float* op = out.f32();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t row = tp[bt] - begin;
    float* o = op + bt * C;
    if (row >= 0 && row < valid) std::copy(wtep + row * C, wtep + (row + 1) * C, o);
    else std::fill(o, o + C, 0.0f);
  }
}

// dwte[id - begin] += dout[b, t] for the ids held, in (b, t) order per element.
void embedding_shard_backward(const Tensor& dwte, const Tensor& dout, const Tensor& tokens, int64_t begin,
                              int64_t valid, int64_t vocab) {
  ProfileScope profile_scope("embedding_backward");
  MT_ON_CUDA(dwte, embedding_shard_backward(dwte, dout, tokens, begin, valid, vocab));
  check_f32(dwte, "embedding_shard_backward: dwte");
  check_f32(dout, "embedding_shard_backward: dout");
  MT_CHECK(dwte.ndim() == 2 && valid <= dwte.dim(0), "embedding_shard_backward: dwte must be [>= " << valid
                                                                                                  << ", C]");
  const int64_t C = dwte.dim(1);
  int64_t B, T;
  check_tokens(tokens, dout, vocab, B, T, "embedding_shard_backward: tokens");
  check_numel(dout, B * T * C, "embedding_shard_backward: dout ([B, T, C])");
  scatter_rows(dwte.f32(), dout.f32(), tokens.i32(), B * T, C, begin, valid);
}

// out[b, t] += wpe[t]
// Positions pos[0..T) (null: 0..T) must lie in [0, maxT) and not repeat.
static void check_positions(const int32_t* pos, int64_t T, int64_t maxT, const char* op) {
  for (int64_t t = 0; pos && t < T; ++t)
    MT_CHECK(pos[t] >= 0 && pos[t] < maxT, op << ": position " << pos[t] << " outside [0, " << maxT << ")");
}

void position_forward(const Tensor& out, const Tensor& wpe, const int32_t* pos) {
  ProfileScope profile_scope("position");
  MT_ON_CUDA(out, position_forward(out, wpe, pos));
  check_f32(out, "position_forward: out");
  check_f32(wpe, "position_forward: wpe");
  MT_CHECK(out.ndim() == 3 && wpe.ndim() == 2 && wpe.dim(1) == out.dim(2) && wpe.dim(0) >= out.dim(1),
           "position_forward: out [B, T, C] and wpe [maxT >= T, C], got " << shape_str(out.shape()) << " and "
                                                                          << shape_str(wpe.shape()));
  const int64_t B = out.dim(0), T = out.dim(1), C = out.dim(2);
  check_positions(pos, T, wpe.dim(0), "position_forward");
  float* op = out.f32();
  const float* pp = wpe.f32();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* p = pp + (pos ? pos[bt % T] : bt % T) * C;
    float* o = op + bt * C;
    for (int64_t c = 0; c < C; ++c) o[c] += p[c];
  }
}

// dwpe[t] += sum over b of dout[b, t], in b order
void position_backward(const Tensor& dwpe, const Tensor& dout, const int32_t* pos) {
  ProfileScope profile_scope("position_backward");
  MT_ON_CUDA(dwpe, position_backward(dwpe, dout, pos));
  check_f32(dwpe, "position_backward: dwpe");
  check_f32(dout, "position_backward: dout");
  MT_CHECK(dout.ndim() == 3 && dwpe.ndim() == 2 && dwpe.dim(1) == dout.dim(2) && dwpe.dim(0) >= dout.dim(1),
           "position_backward: dout [B, T, C] and dwpe [maxT >= T, C]");
  const int64_t B = dout.dim(0), T = dout.dim(1), C = dout.dim(2);
  check_positions(pos, T, dwpe.dim(0), "position_backward");
  add_positions(dwpe.f32(), dout.f32(), B, T, C, pos);
}

}  // namespace mt
