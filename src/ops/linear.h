// Linear layer on CPU through BLAS (on the GPU through cuBLASLt). Weights are stored
// [out, in] (PyTorch nn.Linear); leading dims of x and y fold into N rows. Backward is two
// functions so that a zero-bubble pipeline can run the weight gradient later than the
// input gradient. The activation operand x (forward and weight gradient) may hold 16 bits
// (an activation kept in the working precision, ops/autocast.h): read as the fp32 values
// it holds. So may the weight w (the model's 16-bit working copy, Unit::w16), in the
// scope's dtype or outside a scope; the products read it as they read its fp32 widening,
// the same bits. Everything else is fp32.
#pragma once
#include "core/tensor.h"

namespace mt {

// Whether the products read a 16-bit weight of dtype t on device d as it is, without a
// widened copy: on the GPU (cuBLASLt takes it), and on a CPU whose bf16 products run on its
// bf16 instructions (gemm_bf16). Elsewhere a 16-bit weight is widened at every product, and
// a model hands the products its fp32 widening instead.
bool linear_reads_16bit_weights(Device d, DType t);

// y[N, O] = x[N, I] @ w[O, I]^T (+ b[O])
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
// dx[N, I] = dy[N, O] @ w[O, I]        (accumulate: dx += instead of =)
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
// dw[O, I] += dy^T @ x ; db[O] += sum over rows of dy   (always accumulates)
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);
// Both halves at once, where the weight gradient is not deferred: dx = (not +=) dy @ w, then
// dw, db as linear_backward_weight. The same bits as the two calls; on the GPU under a
// 16-bit scope dy is rounded to 16 bits once for the two products instead of once each.
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                     const Tensor& w);

// GPT-2's up projection and GELU as one product, where a device fuses them: act[N, O] =
// gelu(x @ w[O, I]^T + b) and pre[N, O] = x @ w^T + b, GELU reading the product's fp32
// result, both rounded to the scope's dtype. On the GPU under a 16-bit Autocast scope one
// cuBLASLt product writes both (GELU in its epilogue: cuBLASLt's tanh form, whose tanh may
// be the GPU's approximate one, relative error up to 2^-11: then act differs from
// gelu_forward's by up to 0.5 |pre tanh| 2^-11 before rounding); act and pre hold the
// scope's dtype or fp32 (whole
// allocations or 256-byte aligned views: cuBLASLt's choice of algorithm reads alignments).
// The bias is rounded to the scope's dtype (cuBLASLt's bias type for a 16-bit output): exact
// when b holds its values, as the model's working copies do.
// Returns false, doing nothing, everywhere else (the host, fp32, a shape without an
// algorithm, MESHTRAIN_FUSED_GELU=off): the caller then runs linear_forward and
// gelu_forward on the fp32 result.
bool linear_gelu_fused(const Tensor& act, const Tensor& pre, const Tensor& x, const Tensor& w, const Tensor* b);
// Its counterpart in backward, for the down projection (w stored [in, out]) whose input is
// gelu(pre): dx[N, I] = (dy[N, O] @ w[I, O]^T) * gelu'(pre[N, I]), GELU's derivative of the
// kept pre-activation (the scope's dtype or fp32) times the product's fp32 result. On the GPU
// under a 16-bit scope one cuBLASLt product (the DGELU epilogue, cuBLASLt's tanh form);
// returns false, doing nothing, everywhere else: the caller then runs the product and
// gelu_backward.
bool linear_dgelu_fused(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& pre);

// The same three for a weight stored [in, out] (the row-parallel layers, so that tensor
// parallelism splits them by rows): y[N, O] = x[N, I] @ w[I, O] (+ b[O]),
// dx = dy @ w^T, dw[I, O] += x^T @ dy, db as above.
void linear_io_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
void linear_io_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
void linear_io_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);
void linear_io_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                        const Tensor& w);
// db[O] += sum over rows of dy[N, O] (a bias's gradient alone).
void bias_backward(const Tensor& db, const Tensor& dy);

}  // namespace mt
