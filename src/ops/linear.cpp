// Linear layer through gemm (ops/gemm.h): matrix products in a fixed tile grid, so the
// results are the same for any thread count; under a bf16 Autocast scope through gemm_bf16
// (ops/gemm_bf16.h) where the CPU has bf16 instructions, the same for any thread count too.
#include "ops/linear.h"

#include <algorithm>
#include <vector>

#include "core/profile.h"
#include "ops/cuda/ops.h"
#include "ops/autocast.h"
#include "ops/detail.h"
#include "ops/gemm.h"
#include "ops/gemm_bf16.h"

namespace mt {

using namespace detail;

namespace {

// An activation operand of a product. Under a bf16 scope where gemm_bf16 runs: the tensor
// itself, fp32 or bf16 (gemm_bf16 rounds and widens as it packs). Otherwise its fp32 data,
// or under an Autocast scope a copy rounded to the scope's dtype in this thread's scratch
// `slot` (0 or 1; kept between calls); a 16-bit operand (an activation kept in the working
// precision) is widened there: the values the rounded fp32 copy would have.
Bf16Src operand(const Tensor& t, int slot) {
  const DType d = autocast_dtype();
  if (d == DType::bf16 && bf16_gemm_available())
    return t.dtype() == DType::bf16 ? Bf16Src(static_cast<const uint16_t*>(t.raw())) : Bf16Src(t.f32());
  if (d == DType::f32 && t.dtype() == DType::f32) return t.f32();
  thread_local std::vector<float> scratch[2];
  std::vector<float>& s = scratch[slot];
  if (s.size() < static_cast<size_t>(t.numel())) s.resize(t.numel());
  if (t.dtype() != DType::f32) convert(DType::f32, s.data(), t.dtype(), t.raw(), t.numel());
  else round_to(d, t.f32(), s.data(), t.numel());
  return s.data();
}

// A product of a linear layer: on the bf16 instructions under a bf16 scope where the CPU
// has them, else gemm (its operands are fp32 then: operand()).
void product(bool ta, bool tb, int64_t M, int64_t N, int64_t K, Bf16Src A, int64_t lda, Bf16Src B, int64_t ldb,
             float beta, float* C, int64_t ldc) {
  if (autocast_dtype() == DType::bf16 && bf16_gemm_available())
    return gemm_bf16(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  MT_CHECK(!A.bf16 && !B.bf16, "internal: 16-bit operands reach gemm");
  gemm(ta, tb, M, N, K, static_cast<const float*>(A.data), lda, static_cast<const float*>(B.data), ldb, beta, C,
       ldc);
}

// An activation operand's dtype check: fp32, or 16-bit (kept activations).
void check_operand(const Tensor& t, const char* what) {
  if (t.defined() && (t.dtype() == DType::bf16 || t.dtype() == DType::f16) && t.device() == Device::cpu) return;
  check_f32(t, what);
}

// A weight's in and out dims: stored [out, in], or [in, out] (io). The weight is fp32, or a
// 16-bit working copy (mixed precision: Unit::w16) under a scope of its dtype or none.
void weight_dims(const Tensor& w, bool io, int64_t& O, int64_t& I, const char* op) {
  check_operand(w, op);
  const DType d = autocast_dtype();
  MT_CHECK(w.dtype() == DType::f32 || d == DType::f32 || w.dtype() == d,
           op << ": a " << dtype_name(w.dtype()) << " weight under a " << dtype_name(d) << " Autocast scope");
  MT_CHECK(w.ndim() == 2, op << ": w must be 2-D " << (io ? "[in, out]" : "[out, in]") << ", got " << shape_str(w.shape()));
  O = io ? w.dim(1) : w.dim(0);
  I = io ? w.dim(0) : w.dim(1);
}

// A weight operand: fp32 read as it is (a model's weights hold 16-bit values under a scope:
// see linear.h), or the 16-bit working copy through operand() in slot 1.
Bf16Src weight_operand(const Tensor& w) { return w.dtype() == DType::f32 ? Bf16Src(w.f32()) : operand(w, 1); }

void forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b, bool io) {
  ProfileScope profile_scope("linear");
  int64_t O, I;
  weight_dims(w, io, O, I, "linear_forward: w");
  check_f32(y, "linear_forward: y");
  check_operand(x, "linear_forward: x");
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
    // Pre-fill y with the bias and let the product accumulate (beta = 1): saves the separate
    // pass OpenBLAS makes over C to apply beta = 0, and the bias pass after.
    const float* bp = b->f32();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::copy(bp, bp + O, yp + n * O);
    beta = 1.0f;
  }
  const Bf16Src xp = operand(x, 0), wp = weight_operand(w);
  if (io) product(false, false, N, O, I, xp, I, wp, O, beta, yp, O);
  else product(false, true, N, O, I, xp, I, wp, I, beta, yp, O);
}

void backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate, bool io) {
  ProfileScope profile_scope("linear_backward_input");
  int64_t O, I;
  weight_dims(w, io, O, I, "linear_backward_input: w");
  check_f32(dx, "linear_backward_input: dx");
  check_f32(dy, "linear_backward_input: dy");
  const int64_t N = rows_of(dy, O, "linear_backward_input: dy (last dim must equal w's out-dim)");
  MT_CHECK(rows_of(dx, I, "linear_backward_input: dx (last dim must equal w's in-dim)") == N,
           "linear_backward_input: dx has " << dx.numel() / I << " rows but dy has " << N);
  if (N == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  const Bf16Src dyp = operand(dy, 0), wp = weight_operand(w);
  if (io) product(false, true, N, I, O, dyp, O, wp, O, beta, dx.f32(), I);
  else product(false, false, N, I, O, dyp, O, wp, I, beta, dx.f32(), I);
}

void backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x, bool io);

}  // namespace

bool linear_reads_16bit_weights(Device d, DType t) {
  return d == Device::cuda || (t == DType::bf16 && bf16_gemm_available());
}

// y[N, O] = x[N, I] @ w[O, I]^T (+ b[O])
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) {
  if (y.device() == Device::cuda) {
    ProfileScope profile_scope("linear");
    MT_ON_CUDA(y, linear_forward(y, x, w, b));
  }
  forward(y, x, w, b, false);
}

// act = gelu(x @ w^T + b) and pre = x @ w^T + b in one product where the device fuses them
bool linear_gelu_fused(const Tensor& act, const Tensor& pre, const Tensor& x, const Tensor& w, const Tensor* b) {
  if (act.device() == Device::cuda) {
    ProfileScope profile_scope("linear_gelu");
    MT_TRY_ON_CUDA(act, linear_gelu_forward(act, pre, x, w, b));
  }
  return false;
}

// dx = (dy @ w^T) * gelu'(pre) in one product where the device fuses them
bool linear_dgelu_fused(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& pre) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("linear_dgelu");
    MT_TRY_ON_CUDA(dx, linear_io_dgelu_backward_input(dx, dy, w, pre));
  }
  return false;
}

// y[N, O] = x[N, I] @ w[I, O] (+ b[O])
void linear_io_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b) {
  if (y.device() == Device::cuda) {
    ProfileScope profile_scope("linear");
    MT_ON_CUDA(y, linear_io_forward(y, x, w, b));
  }
  forward(y, x, w, b, true);
}

// dx[N, I] (=, or += when accumulate) dy[N, O] @ w[O, I]
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward_input");
    MT_ON_CUDA(dx, linear_backward_input(dx, dy, w, accumulate));
  }
  backward_input(dx, dy, w, accumulate, false);
}
// dx[N, I] (=, or +=) dy[N, O] @ w[I, O]^T
void linear_io_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward_input");
    MT_ON_CUDA(dx, linear_io_backward_input(dx, dy, w, accumulate));
  }
  backward_input(dx, dy, w, accumulate, true);
}

// dw[O, I] += dy[N, O]^T @ x[N, I] ; db[O] += sum over rows of dy
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x) {
  if (dw.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward_weight");
    MT_ON_CUDA(dw, linear_backward_weight(dw, db, dy, x));
  }
  backward_weight(dw, db, dy, x, false);
}
// dw[I, O] += x[N, I]^T @ dy[N, O] ; db[O] += sum over rows of dy
void linear_io_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x) {
  if (dw.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward_weight");
    MT_ON_CUDA(dw, linear_io_backward_weight(dw, db, dy, x));
  }
  backward_weight(dw, db, dy, x, true);
}

// dx[N, I] = dy[N, O] @ w[O, I] ; dw[O, I] += dy^T @ x[N, I] ; db[O] += sum over rows of dy
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                     const Tensor& w) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward");
    MT_ON_CUDA(dx, linear_backward(dx, dw, db, dy, x, w));
  }
  backward_input(dx, dy, w, false, false);
  backward_weight(dw, db, dy, x, false);
}
// dx[N, I] = dy[N, O] @ w[I, O]^T ; dw[I, O] += x^T @ dy ; db[O] += sum over rows of dy
void linear_io_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                        const Tensor& w) {
  if (dx.device() == Device::cuda) {
    ProfileScope profile_scope("linear_backward");
    MT_ON_CUDA(dx, linear_io_backward(dx, dw, db, dy, x, w));
  }
  backward_input(dx, dy, w, false, true);
  backward_weight(dw, db, dy, x, true);
}

namespace {

void backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x, bool io) {
  ProfileScope profile_scope("linear_backward_weight");
  int64_t O, I;
  check_f32(dw, "linear_backward_weight: dw");
  weight_dims(dw, io, O, I, "linear_backward_weight: dw");
  check_f32(dy, "linear_backward_weight: dy");
  check_operand(x, "linear_backward_weight: x");
  const int64_t N = rows_of(dy, O, "linear_backward_weight: dy (last dim must equal dw's out-dim)");
  MT_CHECK(rows_of(x, I, "linear_backward_weight: x (last dim must equal dw's in-dim)") == N,
           "linear_backward_weight: x has " << x.numel() / I << " rows but dy has " << N);
  if (db) {
    check_f32(*db, "linear_backward_weight: db");
    check_numel(*db, O, "linear_backward_weight: db");
  }
  if (N == 0) return;
  const Bf16Src dyp = operand(dy, 0), xp = operand(x, 1);
  if (io) product(true, false, I, O, N, xp, I, dyp, O, 1.0f, dw.f32(), O);
  else product(true, false, O, I, N, dyp, O, xp, I, 1.0f, dw.f32(), I);
  if (db) bias_backward(*db, dy);  // from dy as it is: a bias's gradient is a sum, not a product
}

}  // namespace

// db[O] += sum over rows of dy[N, O]: parallel over blocks of columns, each db element
// summed by one thread over the rows in order, so the result does not depend on the thread count.
void bias_backward(const Tensor& db, const Tensor& dy) {
  ProfileScope profile_scope("bias_backward");
  MT_ON_CUDA(db, bias_backward(db, dy));
  check_f32(db, "bias_backward: db");
  check_f32(dy, "bias_backward: dy");
  const int64_t O = db.numel();
  const int64_t N = rows_of(dy, O, "bias_backward: dy (last dim must equal db's size)");
  const float* dyp = dy.f32();
  float* dbp = db.f32();
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

}  // namespace mt
