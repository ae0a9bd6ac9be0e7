// What the MPI tests of collectives on GPU tensors share (mpi_test_cuda_comm.cpp: ranks
// sharing a GPU; mpi_test_cuda_nccl.cpp: NCCL): per-rank test values, their GPU copies, a
// tensor's bytes wherever it lives, and the check that a group carries every collective on
// GPU tensors with the bytes the host path gives.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
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

// `dev`'s collectives on GPU tensors give, byte for byte, what `host` (the same ranks, in
// the same order) gives on host tensors: all-reduce, reduce-scatter (into a separate output,
// its input left alone, and into its own chunk, ZeRO stage 1's), all-gather (from a
// separate input, and in place: the input the output's own chunk, ZeRO's parameters) and
// broadcast from every root; f32, bf16 and f16 at lengths that do not divide evenly.
inline void expect_collectives_carry_the_hosts_bytes(Communicator& host, Communicator& dev, CpuAllocator& a,
                                                     CudaAllocator& g) {
  const int n = host.size(), r = host.rank();
  for (DType dt : kReducible)
    for (int64_t len : kLengths) {
      const std::string what = std::string(dtype_name(dt)) + " x " + std::to_string(len);
      Tensor h = host_values(a, len, dt, r, 1), d = on_gpu(g, h);
      host.allreduce(h);
      dev.allreduce(d);
      EXPECT_EQ(bytes_of(d), bytes_of(h)) << "allreduce " << what;

      Tensor hin = host_values(a, n * len, dt, r, 2), din = on_gpu(g, hin);
      Tensor hout = Tensor::zeros({len}, dt, a, MemTag::comm), dout = Tensor::zeros({len}, dt, g, MemTag::comm);
      host.reduce_scatter(hin, hout);
      dev.reduce_scatter(din, dout);
      EXPECT_EQ(bytes_of(dout), bytes_of(hout)) << "reduce_scatter " << what;
      EXPECT_EQ(bytes_of(din), bytes_of(hin)) << "reduce_scatter's input " << what;
      host.reduce_scatter(hin, hin.view(r * len, {len}));
      dev.reduce_scatter(din, din.view(r * len, {len}));
      EXPECT_EQ(bytes_of(din), bytes_of(hin)) << "reduce_scatter in place " << what;
      EXPECT_EQ(bytes_of(din.view(r * len, {len})), bytes_of(hout)) << "reduce_scatter in place " << what;

      Tensor hg = Tensor::zeros({n * len}, dt, a, MemTag::comm), dg = Tensor::zeros({n * len}, dt, g, MemTag::comm);
      host.allgather(h, hg);
      dev.allgather(d, dg);
      EXPECT_EQ(bytes_of(dg), bytes_of(hg)) << "allgather " << what;
      host.allgather(hin.view(r * len, {len}), hin);
      dev.allgather(din.view(r * len, {len}), din);
      EXPECT_EQ(bytes_of(din), bytes_of(hin)) << "allgather in place " << what;

      for (int root = 0; root < n; ++root) {
        Tensor hb = host_values(a, len, dt, r, 5 + root), db = on_gpu(g, hb);
        host.broadcast(hb, root);
        dev.broadcast(db, root);
        EXPECT_EQ(bytes_of(db), bytes_of(hb)) << "broadcast from " << root << " " << what;
      }
    }
}

}  // namespace mt::test
