#include "core/tensor.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cuda.h"
#include "core/error.h"
#include "core/half.h"

namespace mt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::u16: return 2;
    case DType::u32: return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::u16: return "u16";
    case DType::u32: return "u32";
  }
  return "?";
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::~Storage() {
  if (owned && alloc) alloc->deallocate(ptr, bytes, tag);
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Allocator& alloc, MemTag tag) {
  for (int64_t d : shape) MT_CHECK(d >= 0, "negative dimension in shape " << shape_str(shape));
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->bytes = shape_numel(shape) * dtype_size(dtype);
  t.storage_->ptr = alloc.allocate(t.storage_->bytes, tag);
  t.storage_->alloc = &alloc;
  t.storage_->tag = tag;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Allocator& alloc, MemTag tag) {
  Tensor t = empty(shape, dtype, alloc, tag);
  t.zero_();
  return t;
}

Tensor Tensor::wrap(void* ptr, const Shape& shape, DType dtype) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->ptr = ptr;
  t.storage_->bytes = shape_numel(shape) * dtype_size(dtype);
  t.storage_->owned = false;
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

int64_t Tensor::dim(int i) const {
  int n = ndim();
  if (i < 0) i += n;
  MT_CHECK(i >= 0 && i < n, "dimension " << i << " out of range for shape " << shape_str(shape_));
  return shape_[i];
}

float* Tensor::f32() const {
  MT_CHECK(dtype_ == DType::f32, "expected an f32 tensor, got " << dtype_name(dtype_));
  return data<float>();
}
double* Tensor::f64() const {
  MT_CHECK(dtype_ == DType::f64, "expected an f64 tensor, got " << dtype_name(dtype_));
  return data<double>();
}
int32_t* Tensor::i32() const {
  MT_CHECK(dtype_ == DType::i32, "expected an i32 tensor, got " << dtype_name(dtype_));
  return data<int32_t>();
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  MT_CHECK(offset >= 0 && offset + shape_numel(shape) <= numel(),
           "view of " << shape_str(shape) << " at offset " << offset << " exceeds tensor of " << numel()
                      << " elements");
  Tensor t = *this;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  MT_CHECK(shape_numel(shape) == numel(), "cannot reshape " << shape_str(shape_) << " to " << shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

void Tensor::zero_() const {
  if (!numel()) return;
  if (device() == Device::cuda) cuda_memset0(raw(), nbytes());
  else std::memset(raw(), 0, nbytes());
}

void Tensor::copy_from(const Tensor& src) const {
  MT_CHECK(src.numel() == numel() && src.dtype() == dtype_,
           "copy of " << shape_str(src.shape()) << " " << dtype_name(src.dtype()) << " into "
                      << shape_str(shape_) << " " << dtype_name(dtype_));
  if (!numel()) return;
  if (device() == Device::cuda || src.device() == Device::cuda) cuda_memcpy(raw(), src.raw(), nbytes());
  else std::memmove(raw(), src.raw(), nbytes());
}

void Tensor::convert_from(const Tensor& src) const {
  MT_CHECK(src.numel() == numel(), "conversion of " << shape_str(src.shape()) << " into " << shape_str(shape_));
  if (!numel()) return;
  if (device() == Device::cuda && src.device() == Device::cuda) {
    cuda_convert(dtype_, raw(), src.dtype(), src.raw(), numel());
  } else if (dtype_ == src.dtype()) {
    copy_from(src);
  } else if (device() == src.device()) {
    convert(dtype_, raw(), src.dtype(), src.raw(), numel());
  } else {  // between host and device in two dtypes: converted on the host, through a copy there
    const bool to_host = device() == Device::cpu;
    std::vector<char> bytes(numel() * dtype_size(to_host ? src.dtype() : dtype_));
    const Tensor staged = wrap(bytes.data(), shape_, to_host ? src.dtype() : dtype_);
    if (to_host) {
      staged.copy_from(src);
      convert(dtype_, raw(), src.dtype(), staged.raw(), numel());
    } else {
      convert(dtype_, staged.raw(), src.dtype(), src.raw(), numel());
      copy_from(staged);
    }
  }
}

void convert(DType to, void* dst, DType from, const void* src, int64_t n) {
  constexpr int64_t kBlock = 4096;  // fp16 conversions run in blocks of the vectorised converters
  if (to == from) {
    if (n) std::memmove(dst, src, n * dtype_size(to));
    return;
  }
  auto* h = static_cast<uint16_t*>(dst);
  auto* f = static_cast<float*>(dst);
  const auto* sh = static_cast<const uint16_t*>(src);
  const auto* sf = static_cast<const float*>(src);
  if (from == DType::f32 && to == DType::bf16) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(sf[i]);
  } else if (from == DType::f32 && to == DType::f16) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) f32_to_f16_n(sf + b, h + b, std::min(kBlock, n - b));
  } else if (from == DType::bf16 && to == DType::f32) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) f[i] = bf16_to_f32(sh[i]);
  } else if (from == DType::f16 && to == DType::f32) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) f16_to_f32_n(sh + b, f + b, std::min(kBlock, n - b));
  } else {
    MT_FAIL("internal: no conversion from " << dtype_name(from) << " to " << dtype_name(to));
  }
}

void accumulate(DType to, void* dst, DType from, const void* src, int64_t n) {
  const bool half = from == DType::bf16 || from == DType::f16;
  MT_CHECK((to == DType::f32 || to == DType::bf16 || to == DType::f16) && (from == DType::f32 || from == to ||
                                                                           (to == DType::f32 && half)),
           "internal: no accumulation of " << dtype_name(from) << " into " << dtype_name(to));
  if (to == DType::f32 && from == DType::f32) {
    float* d = static_cast<float*>(dst);
    const float* s = static_cast<const float*>(src);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
    return;
  }
  constexpr int64_t kBlock = 4096;  // widened in blocks, summed, rounded back
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, len = std::min(kBlock, n - lo);
    float d[kBlock], s[kBlock];
    const size_t es = dtype_size(to), fs = dtype_size(from);
    convert(DType::f32, d, to, static_cast<const char*>(dst) + lo * es, len);
    convert(DType::f32, s, from, static_cast<const char*>(src) + lo * fs, len);
    for (int64_t i = 0; i < len; ++i) d[i] += s[i];
    convert(to, static_cast<char*>(dst) + lo * es, DType::f32, d, len);
  }
}

void accumulate(const Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.numel() == src.numel() && dst.device() == src.device(),
           "internal: accumulation of " << shape_str(src.shape()) << " into " << shape_str(dst.shape())
                                        << " (same size, same device)");
  if (dst.device() == Device::cuda) cuda_accumulate(dst.dtype(), dst.raw(), src.dtype(), src.raw(), dst.numel());
  else accumulate(dst.dtype(), dst.raw(), src.dtype(), src.raw(), dst.numel());
}

}  // namespace mt
