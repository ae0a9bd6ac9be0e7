// Tensor: a typed, shaped, contiguous view into reference-counted device storage.
//
//   CpuAllocator alloc;
//   Tensor x = Tensor::zeros({B, T, C}, DType::f32, alloc, MemTag::activations);
//   float* p = x.f32();                       // row-major, contiguous
//   Tensor w = flat.view(offset, {C, C});     // a view into a flat parameter buffer
//
// Views share storage (offset counted in elements of the tensor's dtype). Tensors are
// always contiguous; ops take flat pointers and leading dims are folded into rows.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator.h"

namespace mt {

enum class DType { f32, f64, bf16, f16, i32, u16, u32 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& s);

// Bytes owned by one allocation; returned to its allocator when the last view goes.
struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  Allocator* alloc = nullptr;
  MemTag tag = MemTag::other;
  bool owned = true;  // false: wraps memory someone else owns (no accounting, no free)
  ~Storage();
};

// dst[i] = src[i] between f32 and bf16 / f16 (or the same dtype), n elements.
void convert(DType to, void* dst, DType from, const void* src, int64_t n);
// dst[i] = dst[i] + src[i] over n elements, src in f32 or dst's dtype (or 16 bits into f32),
// dst in f32, bf16 or f16: a 16-bit element is widened, the sum taken in float and rounded
// once (host memory).
void accumulate(DType to, void* dst, DType from, const void* src, int64_t n);

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dtype, Allocator& alloc, MemTag tag);
  static Tensor zeros(const Shape& shape, DType dtype, Allocator& alloc, MemTag tag);
  // Wraps host memory owned elsewhere (tests, mmapped files). Not counted, not freed.
  static Tensor wrap(void* ptr, const Shape& shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return numel() * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ && storage_->alloc ? storage_->alloc->device() : Device::cpu; }

  void* raw() const { return static_cast<char*>(storage_->ptr) + offset_ * dtype_size(dtype_); }
  template <class T> T* data() const { return static_cast<T*>(raw()); }
  float* f32() const;      // checks dtype f32
  double* f64() const;     // checks dtype f64
  int32_t* i32() const;    // checks dtype i32

  // A view of numel(shape) elements starting `offset` elements into this tensor.
  Tensor view(int64_t offset, const Shape& shape) const;
  // Same elements, new shape (numel must match).
  Tensor reshape(const Shape& shape) const;
  void zero_() const;
  // Same numel and dtype (handles are const; data is not). Either side may be on the GPU:
  // a copy that involves the device returns when it is done (core/cuda.h).
  void copy_from(const Tensor& src) const;
  // The same with a change of dtype between f32 and bf16 / f16 (to 16 bits: rounded to
  // nearest even, as half.h does; to f32: exact), or a plain copy when the dtypes match.
  // Between host and device the conversion runs on the host, through a temporary copy.
  void convert_from(const Tensor& src) const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // elements
  Shape shape_;
  DType dtype_ = DType::f32;
};

// dst += src as accumulate() above, for tensors of the same numel on one device (the GPU's
// runs on the compute stream, core/cuda.h, with the same rounding).
void accumulate(const Tensor& dst, const Tensor& src);

}  // namespace mt
