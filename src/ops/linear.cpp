// Linear layer through gemm (ops/gemm.h): matrix products in a fixed tile grid, so the
// results are the same for any thread count.
#include "ops/linear.h"

#include <algorithm>

#include "ops/detail.h"
#include "ops/gemm.h"

namespace mt {

using namespace detail;

// y[N, O] = x[N, I] @ w[O, I]^T (+ b[O])
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) {
  check_f32(y, "linear_forward: y");
  check_f32(x, "linear_forward: x");
  check_f32(w, "linear_forward: w");
  MT_CHECK(w.ndim() == 2, "linear_forward: w must be 2-D [out, in], got " << shape_str(w.shape()));
  const int64_t O = w.dim(0), I = w.dim(1);
  const int64_t N = rows_of(x, I, "linear_forward: x (last dim must equal w's in-dim)");
  MT_CHECK(rows_of(y, O, "linear_forward: y (last dim must equal w's out-dim)") == N,
           "linear_forward: y has " << y.numel() / O << " rows but x has " << N);
  if (b) {
    check_f32(*b, "linear_forward: b");
    check_numel(*b, O, "linear_forward: b");
  }
  if (N == 0) return;
  float* yp = y.f32();
  float beta = 0.0f;
  if (b) {
    // Pre-fill y with the bias and let sgemm accumulate (beta = 1): saves the separate
    // pass OpenBLAS makes over C to apply beta = 0, and the bias pass after.
    const float* bp = b->f32();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::copy(bp, bp + O, yp + n * O);
    beta = 1.0f;
  }
  gemm(false, true, N, O, I, x.f32(), I, w.f32(), I, beta, yp, O);
}

// dx[N, I] (=, or += when accumulate) dy[N, O] @ w[O, I]
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate) {
  check_f32(dx, "linear_backward_input: dx");
  check_f32(dy, "linear_backward_input: dy");
  check_f32(w, "linear_backward_input: w");
  MT_CHECK(w.ndim() == 2, "linear_backward_input: w must be 2-D [out, in], got " << shape_str(w.shape()));
  const int64_t O = w.dim(0), I = w.dim(1);
  const int64_t N = rows_of(dy, O, "linear_backward_input: dy (last dim must equal w's out-dim)");
  MT_CHECK(rows_of(dx, I, "linear_backward_input: dx (last dim must equal w's in-dim)") == N,
           "linear_backward_input: dx has " << dx.numel() / I << " rows but dy has " << N);
  if (N == 0) return;
  gemm(false, false, N, I, O, dy.f32(), O, w.f32(), I, accumulate ? 1.0f : 0.0f, dx.f32(), I);
}

// dw[O, I] += dy[N, O]^T @ x[N, I] ; db[O] += sum over rows of dy
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x) {
  check_f32(dw, "linear_backward_weight: dw");
  check_f32(dy, "linear_backward_weight: dy");
  check_f32(x, "linear_backward_weight: x");
  MT_CHECK(dw.ndim() == 2, "linear_backward_weight: dw must be 2-D [out, in], got " << shape_str(dw.shape()));
  const int64_t O = dw.dim(0), I = dw.dim(1);
  const int64_t N = rows_of(dy, O, "linear_backward_weight: dy (last dim must equal dw's out-dim)");
  MT_CHECK(rows_of(x, I, "linear_backward_weight: x (last dim must equal dw's in-dim)") == N,
           "linear_backward_weight: x has " << x.numel() / I << " rows but dy has " << N);
  if (db) {
    check_f32(*db, "linear_backward_weight: db");
    check_numel(*db, O, "linear_backward_weight: db");
  }
  if (N == 0) return;
  gemm(true, false, O, I, N, dy.f32(), O, x.f32(), I, 1.0f, dw.f32(), I);
  if (db) {
    // Column sums, parallel over blocks of columns: each db element is summed by one
    // thread over the rows in order, so the result does not depend on the thread count.
    const float* dyp = dy.f32();
    float* dbp = db->f32();
    constexpr int64_t CB = 64;
    const int64_t nblk = (O + CB - 1) / CB;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * CB, nc = std::min(CB, O - c0);
      float acc[CB] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* row = dyp + n * O + c0;
        for (int64_t c = 0; c < nc; ++c) acc[c] += row[c];
      }
      for (int64_t c = 0; c < nc; ++c) dbp[c0 + c] += acc[c];
    }
  }
}

}  // namespace mt
