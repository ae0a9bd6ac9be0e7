// LayerNorm (GPT-2) and RMSNorm (Llama) over the last dim C; leading dims fold into N rows.
// Backward adds into dx (the residual stream's gradient already holds the other branch)
// and into dw/db, with a reduction order that does not depend on the thread count.
// dx must not alias dout or x. The forwards fuse the residual add before them: given r,
// x += r first, in place and in the same pass, the bits add_inplace(x, r) then the norm give.
// A forward's out may hold 16 bits (bf16 / fp16: an activation kept in the working
// precision): each value is computed in fp32 and rounded to the nearest (ties to even), the
// bits an fp32 out then convert_from give, in one pass.
#pragma once
#include "core/tensor.h"

namespace mt {

// out[N, C] = (x - mean) * rstd * w + b ; saves mean[N], rstd[N]   (x += r[N, C] first)
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps, const Tensor* r = nullptr);
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd);

// out[N, C] = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) ; saves rstd[N]   (x += r first)
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                     const Tensor* r = nullptr);
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                      const Tensor& w, const Tensor& rstd);

}  // namespace mt
