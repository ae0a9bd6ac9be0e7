// Mixed precision inside a unit's hook brackets (nn/model.h): the fp32 staging of the 16-bit
// working parameters a unit reads, and of the gradients it writes when they are kept in 16 bits.
#include "core/error.h"
#include "nn/model.h"
#include "ops/linear.h"

namespace mt {

DType working_dtype(const ModelConfig& cfg) {
  return cfg.precision == "bf16" ? DType::bf16 : cfg.precision == "fp16" ? DType::f16 : DType::f32;
}

DType grad_dtype(const ModelConfig& cfg) { return cfg.grad_working() ? working_dtype(cfg) : DType::f32; }

void Model::widen(int unit) {
  if (!wide_.defined()) return;
  int64_t off = 0;
  for (int v : units_used(unit)) {
    Unit& u = units_[v];
    if (u.numel == 0) continue;
    MT_CHECK(u.w.dtype() == working_dtype(cfg_), "internal: unit " << u.name << " holds " << dtype_name(u.w.dtype())
                                                                   << " parameters under " << cfg_.precision);
    const bool direct = linear_reads_16bit_weights(u.w.device(), u.w.dtype());
    narrow_w_[v] = u.w;
    if (direct) u.w16 = u.w;
    if (v != unit && direct) continue;  // a tied head's embedding: read only as the head's matrix
    const Tensor wide = wide_.view(off, {u.numel});
    wide.convert_from(u.w);
    u.w = wide;
    off += u.numel;
  }
}

void Model::narrow(int unit) {
  if (!wide_.defined()) return;
  for (int v : units_used(unit)) {
    if (!narrow_w_[v].defined()) continue;
    units_[v].w = std::move(narrow_w_[v]);  // moved-from: empty again
    units_[v].w16 = Tensor();
  }
}

void Model::stage_grads(int unit) {
  if (!wide_g_.defined()) return;
  int64_t off = 0;
  for (int v : units_used(unit)) {
    Unit& u = units_[v];
    if (u.numel == 0 || !u.g.defined()) continue;
    const Tensor staged = wide_g_.view(off, {u.numel});
    staged.zero_();
    narrow_g_[v] = u.g;
    u.g = staged;
    off += u.numel;
  }
}

void Model::unstage_grads(int unit) {
  if (!wide_g_.defined()) return;
  for (int v : units_used(unit)) {
    if (!narrow_g_[v].defined()) continue;
    Unit& u = units_[v];
    accumulate(narrow_g_[v], u.g);  // g = round(g + staged) on their device: one rounding per unit and micro-batch
    u.g = std::move(narrow_g_[v]);  // moved-from: empty again
  }
}

}  // namespace mt
