// The CUDA runtime pieces the engine uses outside kernels: whether CUDA is built and a GPU
// present, the compute stream, the caching device allocator, copies and conversions
// between host and device memory.
//
//   CudaAllocator gpu;                                       // training.device = cuda
//   Tensor x = Tensor::empty({B, T, C}, DType::f32, gpu, MemTag::activations);
//   x.copy_from(host_tensor);                                // host -> device, returns when done
//
// Every kernel runs on one compute stream (cuda_stream()), so work is ordered as it is
// issued; copies to the host wait for it. Builds without CUDA (MESHTRAIN_CUDA off) have
// the same functions: cuda_built() is false, cuda_device_count() 0, and the others fail
// with a message saying how to build with CUDA.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "core/allocator.h"

namespace mt {

enum class DType;

bool cuda_built();
int cuda_device_count();               // 0 without a driver or a GPU
std::string cuda_device_name(int dev);  // "NVIDIA H100 80GB HBM3"
void cuda_set_device(int dev);          // before the first allocation on this process
void* cuda_stream();                    // the compute stream (a cudaStream_t)
void cuda_synchronize();                // waits for the compute stream

// Copies between any two of host and device memory (unified addressing), after the work
// queued on the compute stream; returns when the copy is done.
void cuda_memcpy(void* dst, const void* src, size_t bytes);
void cuda_memset0(void* p, size_t bytes);  // on the compute stream
// dst[i] = src[i] between f32 and bf16 / f16 on the device (rounded to nearest even, as
// convert() in core/tensor.h does on the host), n elements, on the compute stream.
void cuda_convert(DType to, void* dst, DType from, const void* src, int64_t n);
// dst[i] += src[i] on the device, n elements, on the compute stream: dst in f32, bf16 or f16,
// src in f32 or dst's dtype, summed in float and rounded once (nearest even), bit for bit as
// accumulate() in core/tensor.h does on the host.
void cuda_accumulate(DType to, void* dst, DType from, const void* src, int64_t n);
// x[i] rounded in place to the nearest value of t (bf16 or f16, ties to even), kept as
// float, bit for bit as round_to() in ops/autocast.h does on the host (NaN stays NaN), n
// elements, on the compute stream; bits, where given (device memory): the same values in
// t's 16 bits as well, in the same pass.
void cuda_round(DType t, float* x, int64_t n, uint16_t* bits = nullptr);
// A reduction's sum, bit for bit as the host communicator takes it (comm/sum.h): out[i] =
// the sum over k = 0 .. count - 1, in that order, of term k's element i, in float (f32 from
// term 0; bf16 and f16 from 0 + term 0), rounded once to dt (nearest even). Term k is
// own[i] when k == own_at, else the next slot of `pieces` (slot s at pieces + s * stride
// elements, the slots in rank order without own). `out` may be `own`. n elements of dt, on
// `stream` (a cudaStream_t).
void cuda_sum_in_order(DType dt, const void* pieces, int64_t stride, int count, const void* own, int own_at, void* out,
                       int64_t n, void* stream);

// Stream-ordered device memory for a kernel's scratch (cudaMallocAsync on the compute
// stream, from a pool that keeps what it once took); give it back with cudaFreeAsync on the
// compute stream. When the pool cannot grow, every CudaAllocator's cache is returned to the
// driver and the allocation tried again; then it fails naming the bytes and `what`.
void* cuda_scratch_allocate(size_t bytes, const char* what);

// Device memory, cached: freed blocks go to a free list by size and serve later requests
// of the same rounded size without cudaMalloc (which synchronizes the device); when
// cudaMalloc runs out, this cache and the scratch pool's unused memory are returned to the
// driver and the allocation tried again (any other CUDA error fails, naming it, rather
// than passing for a lack of memory). Live bytes per tag are counted by the Allocator base
// as on the host.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator();
  ~CudaAllocator() override;
  Device device() const override { return Device::cuda; }
  size_t cached_bytes() const;  // held in the free lists
  void release_cache();         // gives the free lists back to the driver

 protected:
  void* raw_allocate(size_t bytes) override;
  void raw_deallocate(void* p) override;

 private:
  mutable std::mutex cache_mu_;
  std::multimap<size_t, void*> free_;  // rounded size -> block
  std::map<void*, size_t> sizes_;      // every block from cudaMalloc -> its rounded size
  size_t cached_ = 0;
};

}  // namespace mt
