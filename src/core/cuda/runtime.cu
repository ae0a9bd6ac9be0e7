// core/cuda.h with CUDA: the compute stream, copies, conversions and the caching allocator.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "core/cuda.h"
#include "core/cuda/check.h"
#include "core/error.h"
#include "core/tensor.h"

namespace mt {

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: not an error here
    return 0;
  }
  return n;
}

std::string cuda_device_name(int dev) {
  cudaDeviceProp p{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return p.name;
}

void cuda_set_device(int dev) { MT_CUDA_CHECK(cudaSetDevice(dev)); }

// The device the compute stream was created on (set on first use of cuda_stream()).
static int g_stream_device = -1;

void* cuda_stream() {
  // Created on first use and kept for the process (destroying it at exit would race the
  // driver's own teardown).
  static cudaStream_t s = [] {
    cudaStream_t st;
    MT_CUDA_CHECK(cudaGetDevice(&g_stream_device));
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // The kernels' scratch comes from cudaMallocAsync: keep what the pool has once taken
    // (by default it gives memory back at every synchronisation, and maps it again at the
    // next allocation, which cost more than the products it served).
    int dev = 0;
    cudaMemPool_t pool;
    MT_CUDA_CHECK(cudaGetDevice(&dev));
    MT_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
    uint64_t keep = UINT64_MAX;
    MT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return st;
  }();
  return s;
}

static cudaStream_t stream() { return static_cast<cudaStream_t>(cuda_stream()); }

void cuda_synchronize() { MT_CUDA_CHECK(cudaStreamSynchronize(stream())); }

void cuda_memcpy(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  cudaStream_t st = stream();
  // The current device is per host thread: a communication thread copies on the compute
  // stream's device, whichever GPU the process chose (cuda_set_device).
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != g_stream_device) MT_CUDA_CHECK(cudaSetDevice(g_stream_device));
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st));
  MT_CUDA_CHECK(cudaStreamSynchronize(st));
}

void cuda_memset0(void* p, size_t bytes) {
  if (bytes) MT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
}

namespace {

template <class To, class From>
__global__ void convert_kernel(To* dst, const From* src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if constexpr (std::is_same_v<To, float>) dst[i] = static_cast<float>(src[i]);
    else if constexpr (std::is_same_v<To, __nv_bfloat16>) dst[i] = __float2bfloat16_rn(static_cast<float>(src[i]));
    else dst[i] = __float2half_rn(static_cast<float>(src[i]));
  }
}

template <class To, class From>
void launch_convert(void* dst, const void* src, int64_t n) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  convert_kernel<<<blocks, threads, 0, stream()>>>(static_cast<To*>(dst), static_cast<const From*>(src), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

// dst[i] += src[i]: both widened to float, added, rounded once to dst's type (nearest even),
// as accumulate() in core/tensor.cpp does on the host. One thread per element, grid-stride.
template <class To, class From>
__global__ void accumulate_kernel(To* dst, const From* src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float sum = static_cast<float>(dst[i]) + static_cast<float>(src[i]);
    if constexpr (std::is_same_v<To, float>) dst[i] = sum;
    else if constexpr (std::is_same_v<To, __nv_bfloat16>) dst[i] = __float2bfloat16_rn(sum);
    else dst[i] = __float2half_rn(sum);
  }
}

template <class To, class From>
void launch_accumulate(void* dst, const void* src, int64_t n) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  accumulate_kernel<<<blocks, threads, 0, stream()>>>(static_cast<To*>(dst), static_cast<const From*>(src), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

// x[i] rounded in place to the nearest value of Half (ties to even), kept as float, as
// round_to() in ops/autocast.h does on the host, and bits[i] = the same value (bits not
// null). One thread per element, grid-stride.
template <class Half>
__global__ void round_kernel(float* x, int64_t n, Half* bits) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    Half h;
    if constexpr (std::is_same_v<Half, __nv_bfloat16>) h = __float2bfloat16_rn(x[i]), x[i] = __bfloat162float(h);
    else h = __float2half_rn(x[i]), x[i] = __half2float(h);
    if (bits) bits[i] = h;
  }
}

template <class Half>
void launch_round(float* x, int64_t n, void* bits) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  round_kernel<Half><<<blocks, threads, 0, stream()>>>(x, n, static_cast<Half*>(bits));
  MT_CUDA_CHECK(cudaGetLastError());
}

// A reduction's sum over `count` terms in rank order (core/cuda.h: cuda_sum_in_order), each
// element's terms read before it is written, so `out` may be `own`. __fadd_rn keeps every
// addition rounded on its own, as the host loop adds.
template <class T>
__global__ void sum_in_order_kernel(const T* pieces, int64_t stride, int count, const T* own, int own_at, T* out,
                                    int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float acc = 0.0f;
    for (int k = 0, slot = 0; k < count; ++k) {
      const float x = static_cast<float>(k == own_at ? own[i] : pieces[slot++ * stride + i]);
      if (k == 0) acc = std::is_same_v<T, float> ? x : __fadd_rn(0.0f, x);  // comm/sum.h's first()
      else acc = __fadd_rn(acc, x);
    }
    if constexpr (std::is_same_v<T, float>) out[i] = acc;
    else if constexpr (std::is_same_v<T, __nv_bfloat16>) out[i] = __float2bfloat16_rn(acc);
    else out[i] = __float2half_rn(acc);
  }
}

template <class T>
void launch_sum_in_order(const void* pieces, int64_t stride, int count, const void* own, int own_at, void* out,
                         int64_t n, cudaStream_t st) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 65536);
  sum_in_order_kernel<<<blocks, threads, 0, st>>>(static_cast<const T*>(pieces), stride, count,
                                                  static_cast<const T*>(own), own_at, static_cast<T*>(out), n);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void cuda_sum_in_order(DType dt, const void* pieces, int64_t stride, int count, const void* own, int own_at, void* out,
                       int64_t n, void* stream) {
  if (n == 0) return;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dt == DType::f32) return launch_sum_in_order<float>(pieces, stride, count, own, own_at, out, n, st);
  if (dt == DType::bf16) return launch_sum_in_order<__nv_bfloat16>(pieces, stride, count, own, own_at, out, n, st);
  if (dt == DType::f16) return launch_sum_in_order<__half>(pieces, stride, count, own, own_at, out, n, st);
  MT_FAIL("internal: no device sum of " << dtype_name(dt));
}

void cuda_round(DType t, float* x, int64_t n, uint16_t* bits) {
  if (n == 0) return;
  if (t == DType::bf16) return launch_round<__nv_bfloat16>(x, n, bits);
  if (t == DType::f16) return launch_round<__half>(x, n, bits);
  MT_FAIL("internal: no device rounding to " << dtype_name(t));
}

void cuda_accumulate(DType to, void* dst, DType from, const void* src, int64_t n) {
  if (n == 0) return;
  if (to == DType::f32 && from == DType::f32) return launch_accumulate<float, float>(dst, src, n);
  if (to == DType::f32 && from == DType::bf16) return launch_accumulate<float, __nv_bfloat16>(dst, src, n);
  if (to == DType::f32 && from == DType::f16) return launch_accumulate<float, __half>(dst, src, n);
  if (to == DType::bf16 && from == DType::bf16) return launch_accumulate<__nv_bfloat16, __nv_bfloat16>(dst, src, n);
  if (to == DType::bf16 && from == DType::f32) return launch_accumulate<__nv_bfloat16, float>(dst, src, n);
  if (to == DType::f16 && from == DType::f16) return launch_accumulate<__half, __half>(dst, src, n);
  if (to == DType::f16 && from == DType::f32) return launch_accumulate<__half, float>(dst, src, n);
  MT_FAIL("internal: no device accumulation of " << dtype_name(from) << " into " << dtype_name(to));
}

void cuda_convert(DType to, void* dst, DType from, const void* src, int64_t n) {
  if (n == 0) return;
  if (to == from) {
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * dtype_size(to), cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  if (to == DType::f32 && from == DType::bf16) return launch_convert<float, __nv_bfloat16>(dst, src, n);
  if (to == DType::f32 && from == DType::f16) return launch_convert<float, __half>(dst, src, n);
  if (to == DType::bf16 && from == DType::f32) return launch_convert<__nv_bfloat16, float>(dst, src, n);
  if (to == DType::f16 && from == DType::f32) return launch_convert<__half, float>(dst, src, n);
  MT_FAIL("no device conversion from " << dtype_name(from) << " to " << dtype_name(to));
}

// Blocks are rounded to 512 bytes below 1 MiB and to 2 MiB above, so that sizes that
// differ a little (the last micro-batch, a shard) share free lists.
static size_t round_block(size_t bytes) {
  const size_t q = bytes < (1u << 20) ? 512 : (2u << 20);
  return (bytes + q - 1) / q * q;
}

// Every CudaAllocator alive, so that scratch that cannot grow can empty their caches.
static std::mutex g_allocators_mu;
static std::vector<CudaAllocator*> g_allocators;

// The scratch pool's memory that no allocation holds, back to the driver (after the work
// queued, whose frees it waits for).
static void trim_scratch_pool() {
  cudaMemPool_t pool;
  if (g_stream_device < 0 || cudaDeviceGetDefaultMemPool(&pool, g_stream_device) != cudaSuccess) return;
  cudaStreamSynchronize(stream());
  cudaMemPoolTrimTo(pool, 0);
}

void* cuda_scratch_allocate(size_t bytes, const char* what) {
  void* p = nullptr;
  cudaError_t err = cudaMallocAsync(&p, bytes, stream());
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    std::string advice = "use a smaller model, micro_batch or seq_len";
    {
      std::lock_guard<std::mutex> lock(g_allocators_mu);
      for (CudaAllocator* a : g_allocators) a->release_cache();
      if (!g_allocators.empty()) advice = g_allocators.front()->advice();
    }
    err = cudaMallocAsync(&p, bytes, stream());
    MT_CHECK(err != cudaErrorMemoryAllocation,
             "out of cuda memory allocating " << format_bytes(bytes) << " of scratch for " << what << "; " << advice);
  }
  MT_CHECK(err == cudaSuccess, "CUDA error allocating " << format_bytes(bytes) << " of scratch for " << what << ": "
                                                         << cudaGetErrorString(err));
  return p;
}

CudaAllocator::CudaAllocator() {
  MT_CHECK(cuda_device_count() > 0,
           "training.device = cuda, but no GPU is visible (cudaGetDeviceCount found none); use training.device = cpu");
  std::lock_guard<std::mutex> lock(g_allocators_mu);
  g_allocators.push_back(this);
}

CudaAllocator::~CudaAllocator() {
  {
    std::lock_guard<std::mutex> lock(g_allocators_mu);
    g_allocators.erase(std::find(g_allocators.begin(), g_allocators.end(), this));
  }
  cudaStreamSynchronize(stream());
  std::lock_guard<std::mutex> lock(cache_mu_);
  for (auto& [p, size] : sizes_) cudaFree(p);
}

size_t CudaAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  return cached_;
}

void CudaAllocator::release_cache() {
  std::lock_guard<std::mutex> lock(cache_mu_);
  cudaStreamSynchronize(stream());
  for (auto& [size, p] : free_) {
    cudaFree(p);
    sizes_.erase(p);
  }
  free_.clear();
  cached_ = 0;
}

void* CudaAllocator::raw_allocate(size_t bytes) {
  const size_t size = round_block(bytes);
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      cached_ -= size;
      return p;
    }
  }
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, size);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    release_cache();
    trim_scratch_pool();
    err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return nullptr;  // the base class reports what ran out
    }
  }
  // Another error (a kernel's fault, sticky since) is that error, not a lack of memory.
  MT_CHECK(err == cudaSuccess, "CUDA error allocating " << format_bytes(size) << " of device memory: "
                                                         << cudaGetErrorString(err)
                                                         << " (a kernel queued before may have failed)");
  std::lock_guard<std::mutex> lock(cache_mu_);
  sizes_[p] = size;
  return p;
}

void CudaAllocator::raw_deallocate(void* p) {
  // Kernels queued on the compute stream may still read the block; a later allocation
  // that reuses it queues its work behind them on the same stream, so no wait is needed.
  std::lock_guard<std::mutex> lock(cache_mu_);
  auto it = sizes_.find(p);
  MT_CHECK(it != sizes_.end(), "internal: freeing device memory this allocator did not allocate");
  free_.emplace(it->second, p);
  cached_ += it->second;
}

}  // namespace mt
