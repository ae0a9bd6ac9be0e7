// core/cuda.h: the caching CudaAllocator (counts per tag, reuse of freed blocks, the cache's
// release, and its give and take with the kernels' scratch pool), copies between host and
// device, Tensor::zero_ on the device, and cuda_convert and round_tensor against the host's
// convert and round_to bit for bit. Without a GPU only
// the allocator's refusal runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/cuda.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/autocast.h"

using namespace mt;

// A CUDA build on a machine without a GPU (and a build without CUDA) refuses a device
// allocator with a message that says what to do.
TEST(CudaRuntime, AllocatorWithoutGpuThrows) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  try {
    CudaAllocator gpu;
    FAIL() << "CudaAllocator constructed without a GPU";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("training.device = cpu"), std::string::npos) << msg;
  }
}

#if MESHTRAIN_CUDA
#include <cuda_runtime_api.h>  // cudaMemGetInfo, cudaFreeAsync

namespace {

size_t live(const Allocator& a, MemTag t) { return a.stats().live[static_cast<int>(t)]; }
size_t peak(const Allocator& a, MemTag t) { return a.stats().peak[static_cast<int>(t)]; }

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// Values for the 16-bit conversions: random ones over many magnitudes, exact ties of bf16
// and fp16 (even and odd kept mantissa), fp16's overflow and subnormal edges, huge and tiny
// fp32 values, zeros, infinities. (NaN is left out: its payload is not specified.)
std::vector<float> conversion_values() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, -70000.0f,
                          6.1035156e-5f, 5.9604645e-8f, 2.9802322e-8f, 2.98023259e-8f, 1e-40f, -1e-45f,
                          1e30f, -3.4e38f, 3.4028235e38f, 1e-38f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  std::mt19937 g(7);
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1), expo(1, 254), sign(0, 1);
  std::uniform_int_distribution<uint32_t> f16_exp(127 - 24, 127 + 15);  // fp16's normal and subnormal range
  for (int k = 0; k < 4000; ++k) {
    const uint32_t s = sign(g) << 31;
    v.push_back(from_bits(s | (expo(g) << 23) | mant(g)));                         // any finite fp32
    v.push_back(from_bits(s | (f16_exp(g) << 23) | mant(g)));                      // fp16's range
    v.push_back(from_bits(s | (expo(g) << 23) | (mant(g) & ~0xffffu) | 0x8000u));  // bf16 ties
    v.push_back(from_bits(s | (f16_exp(g) << 23) | (mant(g) & ~0x1fffu) | 0x1000u));  // fp16 ties (normal)
    v.push_back(from_bits(s | ((127 - 20) << 23) | (mant(g) & ~0x1fffu)));  // fp16 subnormals, some exact, some ties
  }
  v.push_back(0.1f);  // an odd count: not a multiple of any block
  return v;
}

}  // namespace

TEST(CudaRuntime, AllocatorCountsAndCaches) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  EXPECT_EQ(gpu.device(), Device::cuda);
  {
    Tensor a = Tensor::empty({1000}, DType::f32, gpu, MemTag::params);
    Tensor b = Tensor::empty({3, 7}, DType::bf16, gpu, MemTag::activations);
    EXPECT_EQ(a.device(), Device::cuda);
    EXPECT_EQ(live(gpu, MemTag::params), 4000u);  // the requested bytes, as on the host
    EXPECT_EQ(live(gpu, MemTag::activations), 42u);
    EXPECT_EQ(gpu.stats().live_total, 4042u);
    {
      Tensor c = Tensor::empty({500}, DType::f32, gpu, MemTag::params);
      EXPECT_EQ(live(gpu, MemTag::params), 6000u);
    }
    EXPECT_EQ(live(gpu, MemTag::params), 4000u);
    EXPECT_EQ(peak(gpu, MemTag::params), 6000u);
    EXPECT_EQ(gpu.stats().peak_total, 6042u);
  }
  EXPECT_EQ(gpu.stats().live_total, 0u);
  EXPECT_EQ(peak(gpu, MemTag::params), 6000u);
  gpu.reset_peaks();
  EXPECT_EQ(peak(gpu, MemTag::params), 0u);

  // A freed block serves the next request of the same size: the same pointer comes back.
  gpu.release_cache();
  EXPECT_EQ(gpu.cached_bytes(), 0u);
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({12345}, DType::f32, gpu, MemTag::grads);
    first = t.raw();
  }
  EXPECT_GT(gpu.cached_bytes(), 0u);
  {
    Tensor t = Tensor::empty({12345}, DType::f32, gpu, MemTag::grads);
    EXPECT_EQ(t.raw(), first);
    EXPECT_EQ(gpu.cached_bytes(), 0u);
    EXPECT_EQ(live(gpu, MemTag::grads), 12345u * 4);
  }
  // release_cache gives the free lists back to the driver.
  EXPECT_GT(gpu.cached_bytes(), 0u);
  gpu.release_cache();
  EXPECT_EQ(gpu.cached_bytes(), 0u);
  EXPECT_EQ(gpu.stats().live_total, 0u);
  // A large block (over 1 MiB: rounded to 2 MiB) is reused too.
  {
    Tensor t = Tensor::empty({3 << 20}, DType::f32, gpu, MemTag::comm);
    first = t.raw();
  }
  {
    Tensor t = Tensor::empty({3 << 20}, DType::f32, gpu, MemTag::comm);
    EXPECT_EQ(t.raw(), first);
  }
}

// The kernels' scratch pool keeps what it once took, and the tensor cache keeps freed blocks:
// each gives way to the other. Scratch of 60% of the free memory, given back, then a tensor
// of that size (the pool is trimmed for it); freed into the cache, then scratch of that
// size again (the cache is emptied for it). Either used to fail as out of memory with the
// memory idle in the other.
TEST(CudaRuntime, ScratchAndTensorCachesGiveWayToEachOther) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  cudaStream_t st = static_cast<cudaStream_t>(cuda_stream());
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  const size_t big = free_bytes / 10 * 6 / 4 * 4;
  void* s = cuda_scratch_allocate(big, "the test's scratch");
  ASSERT_EQ(cudaFreeAsync(s, st), cudaSuccess);
  cuda_synchronize();
  {
    const Tensor t = Tensor::empty({static_cast<int64_t>(big / 4)}, DType::f32, gpu, MemTag::other);
    EXPECT_NE(t.raw(), nullptr);
  }
  EXPECT_GE(gpu.cached_bytes(), big);
  s = cuda_scratch_allocate(big, "the test's scratch");
  EXPECT_EQ(gpu.cached_bytes(), 0u) << "the tensor cache gave its blocks back";
  ASSERT_EQ(cudaFreeAsync(s, st), cudaSuccess);
  cuda_synchronize();
}

TEST(CudaRuntime, CopiesRoundTripExactly) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  for (int64_t n : {int64_t{1}, int64_t{257}, int64_t{1} << 20}) {
    std::vector<float> h = random_floats(n, 3), back(n, 0.0f), back2(n, 0.0f);
    Tensor d = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
    d.copy_from(Tensor::wrap(h.data(), {n}, DType::f32));
    Tensor d2 = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
    d2.copy_from(d);  // device to device
    Tensor::wrap(back.data(), {n}, DType::f32).copy_from(d);
    Tensor::wrap(back2.data(), {n}, DType::f32).copy_from(d2);
    EXPECT_EQ(0, std::memcmp(back.data(), h.data(), n * 4)) << "n=" << n;
    EXPECT_EQ(0, std::memcmp(back2.data(), h.data(), n * 4)) << "n=" << n;
  }
  // A view's offset is honoured on the device.
  std::vector<float> h = random_floats(100, 4), part(30, 0.0f);
  Tensor d = Tensor::empty({100}, DType::f32, gpu, MemTag::other);
  d.copy_from(Tensor::wrap(h.data(), {100}, DType::f32));
  Tensor::wrap(part.data(), {30}, DType::f32).copy_from(d.view(50, {30}));
  EXPECT_EQ(0, std::memcmp(part.data(), h.data() + 50, 30 * 4));
}

TEST(CudaRuntime, ZeroOnDevice) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  const int64_t n = 1001;
  std::vector<float> h = random_floats(n, 5), back(n);
  Tensor d = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
  d.copy_from(Tensor::wrap(h.data(), {n}, DType::f32));
  d.view(100, {200}).zero_();  // only the view
  Tensor::wrap(back.data(), {n}, DType::f32).copy_from(d);
  for (int64_t i = 0; i < n; ++i) {
    if (i >= 100 && i < 300) ASSERT_EQ(back[i], 0.0f) << i;
    else ASSERT_EQ(back[i], h[i]) << i;
  }
  Tensor z = Tensor::zeros({7, 13}, DType::f32, gpu, MemTag::other);
  std::vector<float> zb(91, 1.0f);
  Tensor::wrap(zb.data(), {7, 13}, DType::f32).copy_from(z);
  for (float x : zb) ASSERT_EQ(x, 0.0f);
}

TEST(CudaRuntime, ConvertMatchesHostBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  std::vector<float> h = conversion_values();
  const int64_t n = static_cast<int64_t>(h.size());
  Tensor d = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
  d.copy_from(Tensor::wrap(h.data(), {n}, DType::f32));
  for (DType half : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(half));
    // f32 -> 16 bits
    std::vector<uint16_t> want(n), got(n, 0xdead);
    convert(half, want.data(), DType::f32, h.data(), n);
    Tensor d16 = Tensor::empty({n}, half, gpu, MemTag::other);
    cuda_convert(half, d16.raw(), DType::f32, d.raw(), n);
    Tensor::wrap(got.data(), {n}, half).copy_from(d16);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i)
      if (got[i] != want[i] && bad++ < 5)
        ADD_FAILURE() << "value " << h[i] << " (bits 0x" << std::hex << [&] {
          uint32_t b;
          std::memcpy(&b, &h[i], 4);
          return b;
        }() << "): device 0x" << got[i] << ", host 0x" << want[i] << std::dec;
    EXPECT_EQ(bad, 0);
    // 16 bits -> f32 (exact)
    std::vector<float> want32(n), got32(n, 0.0f);
    convert(DType::f32, want32.data(), half, want.data(), n);
    Tensor d32 = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
    cuda_convert(DType::f32, d32.raw(), half, d16.raw(), n);
    Tensor::wrap(got32.data(), {n}, DType::f32).copy_from(d32);
    EXPECT_EQ(0, std::memcmp(got32.data(), want32.data(), n * 4));
  }
  // the same dtype: a plain copy
  Tensor d2 = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
  cuda_convert(DType::f32, d2.raw(), DType::f32, d.raw(), n);
  std::vector<float> back(n);
  Tensor::wrap(back.data(), {n}, DType::f32).copy_from(d2);
  EXPECT_EQ(0, std::memcmp(back.data(), h.data(), n * 4));
}

// Tensor::convert_from between host and device in two dtypes (a compressed reduction's
// host buffer and 16-bit gradients on the GPU) converts on the host: the host's bits, both
// ways.
TEST(CudaRuntime, ConvertFromAcrossDevicesMatchesTheHost) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  std::vector<float> h = conversion_values();
  const int64_t n = static_cast<int64_t>(h.size());
  const Tensor host32 = Tensor::wrap(h.data(), {n}, DType::f32);
  for (DType half : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(half));
    std::vector<uint16_t> want(n), got(n, 0xdead);
    convert(half, want.data(), DType::f32, h.data(), n);
    const Tensor d16 = Tensor::empty({n}, half, gpu, MemTag::other);
    d16.convert_from(host32);  // host f32 -> device 16 bits
    Tensor::wrap(got.data(), {n}, half).copy_from(d16);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n * 2));
    std::vector<float> want32(n), got32(n, 0.0f);
    convert(DType::f32, want32.data(), half, want.data(), n);
    Tensor::wrap(got32.data(), {n}, DType::f32).convert_from(d16);  // device 16 bits -> host f32
    EXPECT_EQ(0, std::memcmp(got32.data(), want32.data(), n * 4));
  }
}

// Rounding in place on the device (round_tensor, the activations a 16-bit scope rounds)
// gives the host's round_to bit for bit, and with a 16-bit destination (an activation kept
// in 16 bits) the host's bits there too; NaN stays NaN.
TEST(CudaRuntime, RoundMatchesHostBitForBit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  CudaAllocator gpu;
  std::vector<float> h = conversion_values();
  h.push_back(std::numeric_limits<float>::quiet_NaN());
  const int64_t n = static_cast<int64_t>(h.size());
  for (DType half : {DType::bf16, DType::f16}) {
    for (bool keep : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(half)) + (keep ? ", with its 16 bits" : ""));
      std::vector<float> want(n), got(n);
      std::vector<uint16_t> want_bits(n), got_bits(n);
      round_to(half, h.data(), want.data(), n, want_bits.data());
      Tensor d = Tensor::empty({n}, DType::f32, gpu, MemTag::other);
      Tensor bits = Tensor::empty({n}, half, gpu, MemTag::other);
      d.copy_from(Tensor::wrap(h.data(), {n}, DType::f32));
      round_tensor(half, d, keep ? &bits : nullptr);
      Tensor::wrap(got.data(), {n}, DType::f32).copy_from(d);
      Tensor::wrap(got_bits.data(), {n}, half).copy_from(bits);
      EXPECT_TRUE(std::isnan(got[n - 1]));
      int bad = 0;
      for (int64_t i = 0; i + 1 < n; ++i) {
        const bool bits_differ = keep && got_bits[i] != want_bits[i];
        if ((std::memcmp(&got[i], &want[i], 4) != 0 || bits_differ) && bad++ < 5)
          ADD_FAILURE() << "value " << h[i] << ": device " << got[i] << " (bits " << got_bits[i] << "), host "
                        << want[i] << " (bits " << want_bits[i] << ")";
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

#endif
