#include "parallel/tensor.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

namespace {

// gathered[size, n] from every rank's x[n] (a workspace kept between calls).
Tensor gather_all(Communicator& tp, const Tensor& x, Tensor& workspace) {
  const int64_t n = x.numel(), total = n * tp.size();
  if (!workspace.defined() || workspace.numel() < total) {
    static CpuAllocator alloc;  // small: [B, T] statistics or one key/value head's weights
    workspace = Tensor::empty({total}, DType::f32, alloc, MemTag::comm);
  }
  Tensor all = workspace.view(0, {total});
  tp.allgather(x.reshape({n}), all);
  return all;
}

}  // namespace

void TensorParallel::max(const Tensor& x) {
  MT_CHECK(x.dtype() == DType::f32, "internal: tp max of " << dtype_name(x.dtype()));
  const Tensor all = gather_all(tp_, x, gathered_);
  const int64_t n = x.numel();
  float* out = x.f32();
  const float* a = all.f32();
  for (int64_t i = 0; i < n; ++i) {
    float m = a[i];
    for (int r = 1; r < tp_.size(); ++r) m = std::max(m, a[r * n + i]);
    out[i] = m;
  }
}

void TensorParallel::sum_over_kv_sharers(const Tensor& g, int sharers) {
  MT_CHECK(sharers >= 1 && tp_.size() % sharers == 0, "internal: " << sharers << " sharers in tp " << tp_.size());
  if (sharers == 1) return;
  const Tensor all = gather_all(tp_, g, gathered_);
  const int64_t n = g.numel();
  const int first = tp_.rank() / sharers * sharers;  // the sharers are consecutive ranks
  float* out = g.f32();
  const float* a = all.f32();
  for (int64_t i = 0; i < n; ++i) {
    float s = a[first * n + i];
    for (int r = first + 1; r < first + sharers; ++r) s += a[r * n + i];
    out[i] = s;
  }
}

double tp_bytes_per_micro_batch(const ModelConfig& cfg, const LocalDims& d, int tp, int64_t B, int64_t T,
                                bool recompute) {
  if (tp == 1) return 0;
  const double N = tp;
  auto allreduce = [&](double floats) { return 2 * (N - 1) / N * 4 * floats; };
  auto allgather = [&](double floats) { return (N - 1) * 4 * floats; };  // floats: each rank's piece
  const double act = double(B) * T * d.C, rows = double(B) * T;
  const int L = cfg.n_layer;
  double bytes = allreduce(act) * (1 + 2 * L * (recompute ? 2 : 1));  // embedding, row-parallel outputs
  bytes += allreduce(act) * (1 + 2 * L);                               // head and column-parallel inputs (backward)
  bytes += allgather(rows) + 2 * allreduce(rows);                      // loss: max, sum of exponentials, target
  if (d.kv_sharers > 1) bytes += L * allgather(2.0 * d.NKV * d.D * d.C);
  return bytes;
}

}  // namespace mt
