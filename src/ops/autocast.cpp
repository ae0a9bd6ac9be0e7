#include "ops/autocast.h"

#include <algorithm>

#include "core/cuda.h"
#include "core/error.h"
#include "core/half.h"

namespace mt {

namespace {
thread_local DType g_autocast = DType::f32;
}

Autocast::Autocast(DType t) : prev_(g_autocast) {
  MT_CHECK(t == DType::f32 || t == DType::bf16 || t == DType::f16,
           "internal: autocast to " << dtype_name(t) << "; use f32, bf16 or f16");
  g_autocast = t;
}

Autocast::~Autocast() { g_autocast = prev_; }

DType autocast_dtype() { return g_autocast; }

void round_to(DType t, const float* src, float* dst, int64_t n, uint16_t* bits) {
  if (t == DType::bf16 && bits) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(bits[i] = f32_to_bf16(src[i]));
  } else if (t == DType::bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(f32_to_bf16(src[i]));
  } else if (t == DType::f16) {
    constexpr int64_t kBlock = 1024;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) {
      uint16_t own[kBlock];
      uint16_t* h = bits ? bits + b : own;
      const int64_t m = std::min(kBlock, n - b);
      f32_to_f16_n(src + b, h, m);
      f16_to_f32_n(h, dst + b, m);
    }
  } else {
    MT_CHECK(t == DType::f32 && !bits, "internal: round_to " << dtype_name(t));
    if (dst != src)
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  }
}

void round_tensor(DType t, const Tensor& x, const Tensor* bits) {
  MT_CHECK(x.dtype() == DType::f32, "internal: round_tensor of a " << dtype_name(x.dtype()) << " tensor");
  uint16_t* b = nullptr;
  if (bits) {
    MT_CHECK(bits->dtype() == t && bits->numel() == x.numel() && bits->device() == x.device(),
             "internal: " << dtype_name(t) << " bits of " << x.numel() << " values in " << bits->numel() << " "
                          << dtype_name(bits->dtype()) << " ones");
    b = static_cast<uint16_t*>(bits->raw());
  }
  if (x.device() == Device::cuda) cuda_round(t, x.f32(), x.numel(), b);
  else round_to(t, x.f32(), x.f32(), x.numel(), b);
}

}  // namespace mt
