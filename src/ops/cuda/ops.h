// The CUDA implementations of the ops, behind the same functions as the CPU ones: each op
// in ops/*.cpp starts with MT_ON_CUDA(output, call), which runs the call here when the
// output tensor lives on the GPU. The signatures and semantics are those of the CPU ops
// (ops/*.h), with every tensor on the device; these notes say only what differs.
//
// - Every kernel runs on the compute stream (core/cuda.h) and returns without waiting,
//   except the functions that return a value to the host (the loss sum, sums of squares).
// - Reductions are deterministic: a fixed grid for a shape and a fixed summation order, no
//   atomics on floating point, so the same configuration run twice gives the same bits.
// - The linear layers follow the thread's Autocast scope (ops/autocast.h): under bf16 or
//   f16 their activation operands are rounded to 16 bits and multiplied on the tensor
//   cores with fp32 accumulation and an fp32 result, as on the CPU. Outside a scope they
//   multiply in full fp32 (no TF32). The fused attention follows the scope too: under bf16
//   or f16 its products take 16-bit operands on the tensor cores (attention_tc.h), as
//   PyTorch's autocast runs attention, where the CPU keeps them fp32.
// - Host pointers (rope's and position's `pos`) are copied to the device by the op.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace mt::cuda {

// ops/linear.h
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
void linear_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);
void linear_io_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor* b);
void linear_io_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, bool accumulate);
void linear_io_backward_weight(const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x);
void linear_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                     const Tensor& w);
void linear_io_backward(const Tensor& dx, const Tensor& dw, const Tensor* db, const Tensor& dy, const Tensor& x,
                        const Tensor& w);
void bias_backward(const Tensor& db, const Tensor& dy);
bool linear_gelu_forward(const Tensor& act, const Tensor& pre, const Tensor& x, const Tensor& w, const Tensor* b);
bool linear_io_dgelu_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Tensor& pre);
// ops/cross_entropy.h (in linear.cu: the loss's gradient goes straight to the products)
bool cross_entropy_head_backward(const Tensor& dx, const Tensor& dw, const Tensor& logits, const Tensor& lse,
                                 const Tensor& targets, float scale, int64_t begin, int64_t valid, const Tensor& x,
                                 const Tensor& w);

// ops/activation.h
void gelu_forward(const Tensor& out, const Tensor& x);
void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout);
void swiglu_forward(const Tensor& out, const Tensor& gu);
void swiglu_backward(const Tensor& dgu, const Tensor& gu, const Tensor& dout);
void add_inplace(const Tensor& a, const Tensor& b);
void add_bias(const Tensor& y, const Tensor& b);

// ops/norm.h
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps, const Tensor* r = nullptr);
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd);
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                     const Tensor* r = nullptr);
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                      const Tensor& w, const Tensor& rstd);

// ops/embedding.h
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor* wpe);
void embedding_backward(const Tensor& dwte, const Tensor* dwpe, const Tensor& dout, const Tensor& tokens);
void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t begin, int64_t valid,
                             int64_t vocab);
void embedding_shard_backward(const Tensor& dwte, const Tensor& dout, const Tensor& tokens, int64_t begin,
                              int64_t valid, int64_t vocab);
void position_forward(const Tensor& out, const Tensor& wpe, const int32_t* pos);
void position_backward(const Tensor& dwpe, const Tensor& dout, const int32_t* pos);

// ops/rope.h
void rope_forward(const Tensor& x, int n_rot, float theta, const int32_t* pos);
void rope_backward(const Tensor& dx, int n_rot, float theta, const int32_t* pos);

// ops/attention.h (the fused, flash-style attention: no [T, T] buffer)
void attention_fused_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int n_head, int n_kv_head);
bool attention_fused_reads_16bit(const Tensor& qkv, int n_head, int n_kv_head);
void attention_fused_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, int n_head, int n_kv_head);

// ops/cross_entropy.h (fused: the probabilities are never stored)
double cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets);
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            float scale);
// The same loss over a vocabulary shard (tensor parallelism): the steps between the tp
// reductions, and the first column holding the row maximum (the predictions).
void cross_entropy_row_max(const Tensor& row_max, const Tensor& logits, int64_t valid);
void cross_entropy_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, int64_t begin, int64_t valid, const Tensor& row_max);
double cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sum_exp,
                            const Tensor& target_logit, const Tensor& targets);
void cross_entropy_first_max(const Tensor& first, const Tensor& logits, const Tensor& row_max, int64_t begin,
                             int64_t valid);
void cross_entropy_backward_shard(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                                  const Tensor& targets, float scale, int64_t begin, int64_t valid);
// The same into logits.numel() elements of dtype dt (f32, or bf16 / f16: each value rounded
// to nearest) at device memory dlogits.
void cross_entropy_backward_shard_to(void* dlogits, DType dt, const Tensor& logits, const Tensor& lse,
                                     const Tensor& targets, float scale, int64_t begin, int64_t valid);

// parallel/tensor.cpp: element-wise work on every tp rank's gathered [size, n] buffer
// (out[n]: the maximum over all ranks; the sum over ranks first .. first + count - 1 in rank
// order), and sequence parallelism's reordering of full [B, T, C] to or from the rank-by-rank
// pieces ranked [size, B, T / size, C] (tensor_parallel.cu).
void max_over_ranks(const Tensor& out, const Tensor& all, int size);
void sum_over_ranks(const Tensor& out, const Tensor& all, int first, int count);
void reorder_sequence(const Tensor& full, const Tensor& ranked, int size, bool to_ranked);

// optim/optimizer.h: one AdamW update of a flat segment, PyTorch's formula (bias-corrected
// moments, decoupled weight decay lr * wd * w on the element ranges in `decay`), in one launch.
void adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                const std::vector<std::pair<int64_t, int64_t>>& decay, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t t);
// SGD with momentum over a flat range, the CPU's sgd_range (optim/optimizer.cpp), each
// operation rounded on its own: d = scale (g + wd w); buf = d on the first step, else
// momentum buf + d; w -= lr (nesterov ? d + momentum buf : buf). LARS passes its local
// learning rate as `scale` (1 for SGD).
void sgd_step(const Tensor& w, const Tensor& g, const Tensor& buf, float wd, float lr, float momentum, bool first,
              bool nesterov, float scale);
// LAMB on one tensor's elements (optim/optimizer.cpp's step_lamb), its constants rounded to
// float as the CPU optimizer rounds them: the moments m = b1 m + (1 - b1) g and
// v = b2 v + (1 - b2) g g; the direction u = (m inv_bc1) / (sqrt(v) / bc2_sqrt + eps) + wd w;
// the update w -= step u (step = lr times the tensor's trust ratio).
struct LambConsts {
  float b1, b2, one_minus_b1, one_minus_b2, inv_bc1, bc2_sqrt, eps;
};
void lamb_moments(const Tensor& g, const Tensor& m, const Tensor& v, const LambConsts& c);
void lamb_apply(const Tensor& w, const Tensor& m, const Tensor& v, const LambConsts& c, float wd, float step);
// Sums of squares in double, each in sumsq's order, taken together and fetched with one
// wait: of x (f32, or bf16 / f16 widened), or, where m is defined, of LAMB's direction u over
// (w = x, m, v; all f32) with wd. An undefined or empty x sums to 0.
struct SumsqTerm {
  Tensor x, m, v;
  float wd = 0.0f;
};
std::vector<double> sumsq_each(const std::vector<SumsqTerm>& terms, const LambConsts& c = {});
// Sum of squares of a flat f32 tensor, in double, in a fixed order.
double sumsq(const Tensor& x);
// x *= s (f32).
void scale_inplace(const Tensor& x, float s);

}  // namespace mt::cuda

// Runs `call` (a function of mt::cuda, with its arguments) and returns when tensor t is on
// the GPU; in builds without CUDA such a tensor cannot exist. MT_TRY_ON_CUDA: the same for
// an op a device may decline (a bool function), returning what `call` returns.
#if MESHTRAIN_CUDA
#define MT_ON_CUDA(t, call)                     \
  do {                                          \
    if ((t).device() == ::mt::Device::cuda) {   \
      ::mt::cuda::call;                         \
      return;                                   \
    }                                           \
  } while (0)
#define MT_TRY_ON_CUDA(t, call)                                                \
  do {                                                                         \
    if ((t).device() == ::mt::Device::cuda) return ::mt::cuda::call;           \
  } while (0)
#else
#define MT_ON_CUDA(t, call) \
  do {                      \
  } while (0)
#define MT_TRY_ON_CUDA(t, call) \
  do {                          \
  } while (0)
#endif
