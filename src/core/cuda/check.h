// The CUDA runtime's error check, for every file that calls the runtime (kernels, the
// allocator, NCCL's streams and events).
#pragma once
#include <cuda_runtime_api.h>

#include "core/error.h"

// Throws mt::Error naming the call when a CUDA runtime call fails.
#define MT_CUDA_CHECK(call)                                                                 \
  do {                                                                                      \
    cudaError_t err_ = (call);                                                              \
    MT_CHECK(err_ == cudaSuccess, "CUDA error in " #call ": " << cudaGetErrorString(err_)); \
  } while (0)
