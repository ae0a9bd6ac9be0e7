// Linear layer on CPU through BLAS (on the GPU through cuBLASLt). Weights are stored
// [out, in] (PyTorch nn.Linear); leading dims of x and y fold into N rows. Backward is two
// functions so that a zero-bubble pipeline can run the weight gradient later than the
// input gradient. The activation operand x (forward and weight gradient) may hold 16 bits
// (an activation kept in the working precision, ops/autocast.h): read as the fp32 values
// it holds; everything else is fp32.
#pragma once
#include "core/tensor.h"

namespace mt {

// y[N, O] = x[N, I] @ w[O, I]^T (+ b[O])
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
// dx[N, I] = dy[N, O] @ w[O, I]        (accumulate: dx += instead of =)
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
// dw[O, I] += dy^T @ x ; db[O] += sum over rows of dy   (always accumulates)
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);

// GPT-2's up projection and GELU as one product, where a device fuses them: act[N, O] =
// gelu(x @ w[O, I]^T + b) and pre[N, O] = x @ w^T + b, GELU reading the product's fp32
// result, both rounded to the scope's dtype. On the GPU under a 16-bit Autocast scope one
// cuBLASLt product writes both (GELU in its epilogue: cuBLASLt's tanh form, within a 16-bit
// rounding of gelu_forward's); act and pre hold the scope's dtype or fp32. Returns false,
// doing nothing, everywhere else (the host, fp32, a shape without an algorithm): the caller
// then runs linear_forward and gelu_forward on the product's fp32 result.
bool linear_gelu_fused(const Tensor& act, const Tensor& pre, const Tensor& x, const Tensor& w, const Tensor* b);

// The same three for a weight stored [in, out] (the row-parallel layers, so that tensor
// parallelism splits them by rows): y[N, O] = x[N, I] @ w[I, O] (+ b[O]),
// dx = dy @ w^T, dw[I, O] += x^T @ dy, db as above.
void linear_io_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
void linear_io_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
void linear_io_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);
// db[O] += sum over rows of dy[N, O] (a bias's gradient alone).
void bias_backward(const Tensor& db, const Tensor& dy);

}  // namespace mt
