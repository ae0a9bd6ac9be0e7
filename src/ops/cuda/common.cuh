// What every kernel file shares: error checks, the compute stream, grid sizes.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/cuda.h"
#include "core/cuda/check.h"  // MT_CUDA_CHECK
#include "core/error.h"
#include "core/tensor.h"

// After each launch: a bad configuration fails here, naming the kernel.
#define MT_CUDA_LAUNCHED(name)                                                                        \
  do {                                                                                                \
    cudaError_t err_ = cudaGetLastError();                                                            \
    MT_CHECK(err_ == cudaSuccess, "CUDA kernel " << name << " failed to launch: " << cudaGetErrorString(err_)); \
  } while (0)

namespace mt::cuda {

inline cudaStream_t stream() { return static_cast<cudaStream_t>(cuda_stream()); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over n elements with `threads` per block.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t b = ceil_div(n, threads);
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

// Block tree over buf[kBlock] (every thread of the block calls; blockDim.x == kBlock, a
// power of two): combines buf[i] and buf[i + s] for s = kBlock / 2 ... 1, a fixed order. The
// result is read by every thread, then the block syncs so that buf may be reused at once.
template <int kBlock, class T, class Combine>
__device__ T block_reduce(T x, T* buf, Combine combine) {
  const int tid = threadIdx.x;
  buf[tid] = x;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (tid < s) buf[tid] = combine(buf[tid], buf[tid + s]);
    __syncthreads();
  }
  const T r = buf[0];
  __syncthreads();
  return r;
}

// Device memory for one op, stream-ordered: allocated on the compute stream and freed on it
// after the work queued so far (so a later op may reuse it only after this one's kernels).
// None for 0 bytes; 256-byte aligned. `what` names it where memory runs out.
class Scratch {
 public:
  Scratch() = default;
  explicit Scratch(size_t bytes, const char* what = "a kernel") {
    if (bytes) p_ = cuda_scratch_allocate(bytes < 256 ? 256 : bytes, what);
  }
  ~Scratch() {
    if (p_) cudaFreeAsync(p_, stream());
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(Scratch&& o) noexcept {
    std::swap(p_, o.p_);  // o frees what this held
    return *this;
  }
  char* get() const { return static_cast<char*>(p_); }
  template <class T> T* as() const { return static_cast<T*>(p_); }

 private:
  void* p_ = nullptr;
};

// t's elements in dtype `to` (f32, bf16 or f16), as a handle to device memory (for the
// kernels' pointers only): t itself where it holds them, else a copy converted into `slot`
// (rounded to nearest even, or widened exactly: cuda_convert).
inline Tensor as_dtype(const Tensor& t, DType to, Scratch& slot) {
  if (t.dtype() == to) return t;
  slot = Scratch(static_cast<size_t>(t.numel()) * dtype_size(to));
  cuda_convert(to, slot.get(), t.dtype(), t.raw(), t.numel());
  return Tensor::wrap(slot.get(), t.shape(), to);
}

// v stored into *p: as it is into fp32, rounded to the nearest (ties to even) into bf16 or
// f16, as cuda_convert rounds. For kernels whose output type is a template parameter.
__device__ inline void store_rounded(float* p, float v) { *p = v; }
__device__ inline void store_rounded(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ inline void store_rounded(__half* p, float v) { *p = __float2half_rn(v); }

// Where a kernel that writes fp32 writes output t: t itself where it holds f32, else fp32
// scratch in `slot` (a handle as as_dtype's), rounded into t by store_output afterwards.
inline Tensor fp32_output(const Tensor& t, Scratch& slot) {
  if (t.dtype() == DType::f32) return t;
  slot = Scratch(static_cast<size_t>(t.numel()) * sizeof(float));
  return Tensor::wrap(slot.get(), t.shape(), DType::f32);
}
inline void store_output(const Tensor& t, const Tensor& written) {
  if (written.raw() != t.raw()) cuda_convert(t.dtype(), t.raw(), DType::f32, written.raw(), t.numel());
}

// The op's tensors must all be f32 on the device (the CPU ops' rule, plus the device).
inline void check_device_f32(const Tensor& t, const char* what) {
  MT_CHECK(t.device() == Device::cuda, what << ": tensor on " << device_name(t.device()) << ", expected cuda");
  MT_CHECK(t.dtype() == DType::f32, what << ": dtype " << dtype_name(t.dtype()) << ", expected f32");
}

}  // namespace mt::cuda
