#include "parallel/tensor.h"

#include <algorithm>

#include "core/error.h"
#include "ops/cuda/ops.h"

namespace mt {

namespace {

void check_sequence_shapes(const Tensor& full, const Tensor& local, int size) {
  MT_CHECK(full.ndim() == 3 && local.ndim() == 3 && full.dim(0) == local.dim(0) && full.dim(2) == local.dim(2) &&
               full.dim(1) == local.dim(1) * size,
           "internal: sequence-parallel shapes " << shape_str(full.shape()) << " and " << shape_str(local.shape())
                                                 << " at tp " << size);
}

}  // namespace

void reorder_sequence(const Tensor& full, const Tensor& ranked, int size, bool to_ranked) {
  MT_CHECK(full.ndim() == 3 && size >= 1 && full.dim(1) % size == 0 && ranked.numel() >= full.numel(),
           "internal: sequence-parallel reorder of " << shape_str(full.shape()) << " into " << ranked.numel()
                                                     << " elements at tp " << size);
  MT_ON_CUDA(full, reorder_sequence(full, ranked, size, to_ranked));
  const int64_t B = full.dim(0), T = full.dim(1), C = full.dim(2), Tl = T / size;
  float* f = full.f32();
  float* rk = ranked.f32();
  for (int r = 0; r < size; ++r)
    for (int64_t b = 0; b < B; ++b) {
      float* piece = f + (b * T + r * Tl) * C;  // [Tl, C]
      float* kept = rk + ((r * B + b) * Tl) * C;  // [Tl, C]
      if (to_ranked) std::copy_n(piece, Tl * C, kept);
      else std::copy_n(kept, Tl * C, piece);
    }
}

void max_over_ranks(const Tensor& out, const Tensor& all, int size) {
  MT_CHECK(size >= 1 && all.numel() >= out.numel() * size,
           "internal: tp max of " << out.numel() << " elements from " << all.numel() << " gathered at tp " << size);
  MT_ON_CUDA(out, max_over_ranks(out, all, size));
  const int64_t n = out.numel();
  float* o = out.f32();
  const float* a = all.f32();
  for (int64_t i = 0; i < n; ++i) {
    float m = a[i];
    for (int r = 1; r < size; ++r) m = std::max(m, a[r * n + i]);
    o[i] = m;
  }
}

void sum_over_ranks(const Tensor& out, const Tensor& all, int first, int count) {
  MT_CHECK(first >= 0 && count >= 1 && all.numel() >= out.numel() * (first + count),
           "internal: tp sum of " << out.numel() << " elements over ranks " << first << " to " << first + count - 1
                                  << " from " << all.numel() << " gathered");
  MT_ON_CUDA(out, sum_over_ranks(out, all, first, count));
  const int64_t n = out.numel();
  float* o = out.f32();
  const float* a = all.f32();
  for (int64_t i = 0; i < n; ++i) {
    float s = a[first * n + i];
    for (int r = first + 1; r < first + count; ++r) s += a[r * n + i];
    o[i] = s;
  }
}

Tensor TensorParallel::workspace(Tensor& w, int64_t n) {
  if (!w.defined() || w.numel() < n) {
    w = Tensor();  // free the old one first
    w = Tensor::empty({n}, DType::f32, alloc_, MemTag::comm);
  }
  return w.view(0, {n});
}

Tensor TensorParallel::gather_all(const Tensor& x) {
  const int64_t n = x.numel();
  const Tensor all = workspace(gathered_, n * tp_.size());
  tp_.allgather(x.reshape({n}), all);
  return all;
}

void TensorParallel::gather_sequence(const Tensor& full, const Tensor& local) {
  const int n = tp_.size();
  check_sequence_shapes(full, local, n);
  const int64_t B = full.dim(0);
  if (B == 1) return tp_.allgather(local, full.reshape({full.numel()}));  // already rank by rank
  const Tensor ranked = workspace(ranked_, full.numel());
  tp_.allgather(local.reshape({local.numel()}), ranked);
  reorder_sequence(full, ranked, n, /*to_ranked=*/false);
}

void TensorParallel::reduce_scatter_sequence(const Tensor& local, const Tensor& full) {
  const int n = tp_.size();
  check_sequence_shapes(full, local, n);
  const int64_t B = full.dim(0);
  if (B == 1) return tp_.reduce_scatter(full.reshape({full.numel()}), local.reshape({local.numel()}));
  const Tensor ranked = workspace(ranked_, full.numel());
  reorder_sequence(full, ranked, n, /*to_ranked=*/true);
  tp_.reduce_scatter(ranked, local.reshape({local.numel()}));
}

void TensorParallel::max(const Tensor& x) {
  MT_CHECK(x.dtype() == DType::f32, "internal: tp max of " << dtype_name(x.dtype()));
  if (tp_.size() == 1) return;  // without a gather workspace, which would count as communication memory
  max_over_ranks(x, gather_all(x), tp_.size());
}

void TensorParallel::sum_over_kv_sharers(const Tensor& g, int sharers) {
  MT_CHECK(sharers >= 1 && tp_.size() % sharers == 0, "internal: " << sharers << " sharers in tp " << tp_.size());
  if (sharers == 1) return;
  const int first = tp_.rank() / sharers * sharers;  // the sharers are consecutive ranks
  sum_over_ranks(g, gather_all(g), first, sharers);
}

double tp_bytes_per_micro_batch(const ModelConfig& cfg, const LocalDims& d, int tp, int64_t B, int64_t T,
                                Recompute recompute, bool sequence_parallel, const ModelShare& share) {
  if (tp == 1) return 0;
  const double N = tp;
  auto allreduce = [&](double floats) { return 2 * (N - 1) / N * 4 * floats; };
  auto allgather = [&](double floats) { return (N - 1) * 4 * floats; };  // floats: each rank's piece
  const double act = double(B) * T * d.C, rows = double(B) * T;
  int L = share.chunks.empty() ? cfg.n_layer : 0;  // this rank's blocks, Lr of them recomputed
  int Lr = share.chunks.empty() ? recompute.of(cfg.n_layer) : 0;
  bool embed = share.chunks.empty(), head = share.chunks.empty();
  for (const ChunkSpec& ch : share.chunks) {
    L += ch.end_layer - ch.first_layer, embed |= ch.embed, head |= ch.head;
    Lr += recompute.of(ch.end_layer - ch.first_layer);
  }
  double bytes = allreduce(act) * (embed + 2 * (L + Lr));                // embedding, row-parallel outputs
  bytes += allreduce(act) * (head + 2 * L);                              // head and column-parallel inputs (backward)
  if (head) bytes += allgather(rows) + 2 * allreduce(rows);              // loss: max, sum of exponentials, target
  if (d.kv_sharers > 1) bytes += L * allgather(2.0 * d.NKV * d.D * d.C);
  if (sequence_parallel) {
    const double C = d.C;
    const double block_reps = cfg.is_llama() ? 2 : 6, final_reps = cfg.is_llama() ? 1 : 2;  // weights (and biases)
    bytes += L * allreduce(block_reps * C) + head * allreduce(final_reps * C);  // norms' and row-parallel biases' gradients
    bytes += 2 * L * allgather(act / N);                          // norm outputs gathered again in backward
    if (!cfg.is_llama() && embed) bytes += allgather(T / N * C);  // the position embedding's gradient rows
  }
  return bytes;
}

}  // namespace mt
