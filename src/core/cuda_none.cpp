// core/cuda.h in builds without CUDA: no device, and a clear error for anything that needs one.
#include "core/cuda.h"

#include "core/error.h"

#if !MESHTRAIN_CUDA

namespace mt {

namespace {
[[noreturn]] void no_cuda() {
  MT_FAIL("this meshtrain was built without CUDA: install the CUDA toolkit and rebuild (cmake finds it under "
          "/usr/local/cuda; MESHTRAIN_CUDA=ON), or use training.device = cpu");
}
}  // namespace

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
std::string cuda_device_name(int) { no_cuda(); }
void cuda_set_device(int) { no_cuda(); }
void* cuda_stream() { no_cuda(); }
void cuda_synchronize() { no_cuda(); }
void cuda_memcpy(void*, const void*, size_t) { no_cuda(); }
void cuda_memset0(void*, size_t) { no_cuda(); }
void cuda_convert(DType, void*, DType, const void*, int64_t) { no_cuda(); }
void cuda_accumulate(DType, void*, DType, const void*, int64_t) { no_cuda(); }
void cuda_round(DType, float*, int64_t, uint16_t*) { no_cuda(); }
void cuda_sum_in_order(DType, const void*, int64_t, int, const void*, int, void*, int64_t, void*) { no_cuda(); }
void* cuda_scratch_allocate(size_t, const char*) { no_cuda(); }
CudaAllocator::CudaAllocator() { no_cuda(); }
CudaAllocator::~CudaAllocator() = default;
size_t CudaAllocator::cached_bytes() const { return 0; }
void CudaAllocator::release_cache() {}
void* CudaAllocator::raw_allocate(size_t) { no_cuda(); }
void CudaAllocator::raw_deallocate(void*) { no_cuda(); }

}  // namespace mt

#endif
