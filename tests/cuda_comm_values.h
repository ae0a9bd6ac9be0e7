// What the MPI tests of collectives on GPU tensors share (mpi_test_cuda_comm.cpp: ranks
// sharing a GPU; mpi_test_cuda_nccl.cpp: NCCL): per-rank test values, their GPU copies, and
// a tensor's bytes wherever it lives, to compare the GPU paths with the host's byte for byte.
#pragma once
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cuda.h"
#include "core/half.h"
#include "core/tensor.h"

namespace mt::test {

// n values of dtype dt that differ by rank and `seed`, of mixed magnitudes (so that 16-bit
// sums round, and the order of their terms shows).
inline Tensor host_values(CpuAllocator& a, int64_t n, DType dt, int rank, int seed) {
  Tensor t = Tensor::empty({n}, dt, a, MemTag::comm);
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::sin(0.37f * i + 1.3f * rank + seed) * static_cast<float>(1 + (i * 7 + rank) % 13);
    if (dt == DType::f32) t.f32()[i] = v;
    else t.data<uint16_t>()[i] = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
  return t;
}

inline Tensor on_gpu(CudaAllocator& g, const Tensor& h) {
  Tensor d = Tensor::empty(h.shape(), h.dtype(), g, MemTag::comm);
  d.copy_from(h);
  return d;
}

// A tensor's bytes, from host or GPU memory.
inline std::vector<unsigned char> bytes_of(const Tensor& t) {
  std::vector<unsigned char> b(t.nbytes());
  if (t.device() == Device::cuda) cuda_memcpy(b.data(), t.raw(), t.nbytes());
  else std::memcpy(b.data(), t.raw(), t.nbytes());
  return b;
}

inline constexpr DType kReducible[] = {DType::f32, DType::bf16, DType::f16};
inline constexpr int64_t kLengths[] = {1, 7, 1000, 65537};

}  // namespace mt::test
