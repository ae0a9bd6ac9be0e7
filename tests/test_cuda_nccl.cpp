// The single-GPU parts of NCCL's path (comm/nccl_comm.h): the owner's sum in rank order on
// the device (cuda_sum_in_order) against the host communicator's sum bit for bit, and an NCCL
// group of one rank running each operation through its stream, after the compute stream's
// work. Between ranks on separate GPUs: mpi_test_cuda_nccl.cpp. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/nccl_comm.h"
#include "comm/sum.h"
#include "core/cuda.h"
#include "core/half.h"

using namespace mt;

namespace {

#if MESHTRAIN_CUDA

#define SKIP_WITHOUT_GPU() \
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine"

// n values of dt, of mixed signs and magnitudes (so that sums round and their order shows),
// with a negative zero first.
std::vector<uint8_t> values(DType dt, int64_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint8_t> b(n * dtype_size(dt));
  for (int64_t i = 0; i < n; ++i) {
    const float v = i == 0 ? -0.0f : u(g) * std::ldexp(1.0f, static_cast<int>(g() % 20) - 10);
    if (dt == DType::f32) std::memcpy(&b[i * 4], &v, 4);
    else {
      const uint16_t h = dt == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
      std::memcpy(&b[i * 2], &h, 2);
    }
  }
  return b;
}

std::vector<uint8_t> fetch(const void* d, size_t bytes) {
  std::vector<uint8_t> b(bytes);
  cuda_memcpy(b.data(), d, bytes);
  return b;
}

TEST(CudaNccl, SumInOrderMatchesTheHostBitForBit) {
  SKIP_WITHOUT_GPU();
  CudaAllocator gpu;
  const int64_t n = 3001, stride = 3072;
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int count = 1; count <= 5; ++count)
      for (int own_at = 0; own_at < count; ++own_at)
        for (bool in_place : {false, true}) {
          const size_t es = dtype_size(dt);
          // the other terms' slots (stride apart) and this rank's own term
          std::vector<uint8_t> slots(stride * es * count), own = values(dt, n, 100 + count);
          for (int s = 0; s + 1 < count; ++s) {
            const std::vector<uint8_t> v = values(dt, n, 7 * s + count);
            std::memcpy(&slots[s * stride * es], v.data(), v.size());
          }
          std::vector<const void*> terms;  // the host's terms, in rank order
          for (int k = 0, s = 0; k < count; ++k) terms.push_back(k == own_at ? own.data() : &slots[s++ * stride * es]);
          std::vector<uint8_t> want(n * es);
          comm_sum::sum_in_order(dt, nullptr, terms, nullptr, want.data(), n);

          Tensor d_slots = Tensor::empty({static_cast<int64_t>(slots.size())}, DType::u16, gpu, MemTag::comm);
          Tensor d_own = Tensor::empty({static_cast<int64_t>(own.size())}, DType::u16, gpu, MemTag::comm);
          Tensor d_out = Tensor::empty({static_cast<int64_t>(own.size())}, DType::u16, gpu, MemTag::comm);
          cuda_memcpy(d_slots.raw(), slots.data(), slots.size());
          cuda_memcpy(d_own.raw(), own.data(), own.size());
          void* out = in_place ? d_own.raw() : d_out.raw();
          cuda_sum_in_order(dt, d_slots.raw(), stride, count, d_own.raw(), own_at, out, n, cuda_stream());
          EXPECT_EQ(fetch(out, n * es), want) << dtype_name(dt) << ", " << count << " terms, own at " << own_at
                                              << (in_place ? ", in place" : "");
        }
}

TEST(CudaNccl, OneRankGroupRunsEveryOperationAfterTheComputeStream) {
  SKIP_WITHOUT_GPU();
  if (!nccl_built()) GTEST_SKIP() << "built without NCCL's header";
  ASSERT_EQ(nccl_status().rfind('!', 0), std::string::npos) << nccl_status();
  CudaAllocator gpu;
  std::unique_ptr<Communicator> one = comm_local();
  std::unique_ptr<DeviceCollectives> d = nccl_collectives(*one, gpu);
  EXPECT_EQ(d->describe(), "NCCL " + nccl_status());
  auto run = [&](auto op) {
    std::shared_ptr<void> ready = d->issued();
    op(ready.get());
    while (!d->done()) {
    }
  };
  const int64_t n = int64_t{1} << 22;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const size_t es = dtype_size(dt);
    const std::vector<uint8_t> a = values(dt, n, 1), b = values(dt, n, 2);
    Tensor x = Tensor::empty({n}, dt, gpu, MemTag::comm), y = Tensor::empty({n}, dt, gpu, MemTag::comm);
    Tensor out = Tensor::empty({n}, dt, gpu, MemTag::comm);
    cuda_memcpy(x.raw(), a.data(), a.size());
    cuda_memcpy(y.raw(), b.data(), b.size());
    // x += y queued on the compute stream, not waited for: the reduction must see its result
    cuda_accumulate(dt, x.raw(), dt, y.raw(), n);
    run([&](void* ready) { d->reduce_ranges(x, {0, n}, out, /*gather=*/false, ready); });
    std::vector<uint8_t> sum = a;
    accumulate(dt, sum.data(), dt, b.data(), n);
    std::vector<uint8_t> want(n * es);
    const std::vector<const void*> terms{sum.data()};
    comm_sum::sum_in_order(dt, nullptr, terms, nullptr, want.data(), n);  // one term: 0 + x for bf16
    EXPECT_EQ(fetch(out.raw(), n * es), want) << "reduce " << dtype_name(dt);

    run([&](void* ready) { d->reduce_ranges(x, {0, n}, x, /*gather=*/true, ready); });  // the all-reduce, in place
    EXPECT_EQ(fetch(x.raw(), n * es), want) << "allreduce " << dtype_name(dt);
    Tensor g = Tensor::empty({n}, dt, gpu, MemTag::comm);
    run([&](void* ready) { d->allgather(y, g, ready); });
    EXPECT_EQ(fetch(g.raw(), n * es), b) << "allgather " << dtype_name(dt);
    run([&](void* ready) { d->broadcast(y, 0, ready); });
    EXPECT_EQ(fetch(y.raw(), n * es), b) << "broadcast " << dtype_name(dt);
  }
}

#else

TEST(CudaNccl, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif

}  // namespace
