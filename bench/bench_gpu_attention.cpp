// The fused causal attention on the GPU: cuda::attention_fused_forward / backward with the
// fp32 kernels (no Autocast scope) and with the tensor-core kernels (under
// Autocast scope(DType::bf16); timed on the WMMA kernels and, on their own "bf16_mma" lines,
// on the mma.sync kernels of attention_mma*.cu, given q|k|v and out in bf16 as the model keeps
// them), at GPT-2 124M's shape (B 8, NH = NKV 12, T 1024, D 64) and a larger-head shape
// (B 2, NH = NKV 16, T 2048, D 128).
//
//   bench_gpu_attention [--reps 20] [--warmup 3]
//
// Each case is timed with CUDA events around each call on the compute stream (the median of
// --reps calls after --warmup untimed ones) and printed as one JSON line: ms and TFLOP/s with
// the causal FLOP count (forward 4 B NH T^2 D / 2 for QK^T and PV, backward 2.5x that), and
// for the tensor-core cases the resident blocks per SM of each kernel and their shared memory.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda.h"
#if MESHTRAIN_CUDA
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/autocast.h"
#include "ops/cuda/attention_tc.h"
#include "ops/cuda/ops.h"
#endif

#if MESHTRAIN_CUDA

using namespace mt;

namespace {

#define BENCH_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t err_ = (call);                                                                \
    MT_CHECK(err_ == cudaSuccess, "CUDA error in " #call ": " << cudaGetErrorString(err_)); \
  } while (0)

struct Shape4 {
  int B, NH, NKV, T, D;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of fn() over reps calls after warmup ones, each between two events on
// the compute stream.
template <class F>
double time_ms(F&& fn, int reps, int warmup) {
  cudaStream_t s = static_cast<cudaStream_t>(cuda_stream());
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(a, s));
    fn();
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  return median(ms);
}

// A device f32 tensor of `shape` filled with uniform values in [lo, hi).
Tensor random_device(CudaAllocator& alloc, const Shape& shape, std::mt19937& g, float lo, float hi) {
  std::vector<float> host(shape_numel(shape));
  std::uniform_real_distribution<float> u(lo, hi);
  for (float& x : host) x = u(g);
  Tensor t = Tensor::empty(shape, DType::f32, alloc, MemTag::activations);
  t.copy_from(Tensor::wrap(host.data(), shape, DType::f32));
  return t;
}

void run_case(const Shape4& c, bool tc, int reps, int warmup) {
  CudaAllocator alloc;
  std::mt19937 g(1234);
  const int W = (c.NH + 2 * c.NKV) * c.D, OW = c.NH * c.D;
  Tensor qkv = random_device(alloc, {c.B, c.T, W}, g, -1.0f, 1.0f);
  Tensor dout = random_device(alloc, {c.B, c.T, OW}, g, -1.0f, 1.0f);
  Tensor out = Tensor::empty({c.B, c.T, OW}, DType::f32, alloc, MemTag::activations);
  Tensor lse = Tensor::empty({c.B, c.NH, c.T}, DType::f32, alloc, MemTag::activations);
  Tensor dqkv = Tensor::empty({c.B, c.T, W}, DType::f32, alloc, MemTag::activations);
  Autocast scope(tc ? DType::bf16 : DType::f32);
  const AttentionShape sh = attention_shape(qkv, c.NH, c.NKV, "bench_gpu_attention");
  // the tensor-core line times the WMMA forward explicitly; the mma.sync forward gets its own line
  const double fwd = time_ms(
      [&] {
        if (tc)
          cuda::attention_tc_forward(out, lse, qkv, sh, DType::bf16, cuda::AttentionTcForward::wmma);
        else
          cuda::attention_fused_forward(out, lse, qkv, c.NH, c.NKV);
      },
      reps, warmup);
  const bool mma = tc && cuda::attention_mma_supported(c.D);
  Tensor qkv16, out16;  // the mma.sync kernels' operands as the model keeps them
  if (mma) {
    qkv16 = Tensor::empty({c.B, c.T, W}, DType::bf16, alloc, MemTag::activations);
    out16 = Tensor::empty({c.B, c.T, OW}, DType::bf16, alloc, MemTag::activations);
    qkv16.convert_from(qkv);
  }
  const double fwd_mma =
      mma ? time_ms([&] { cuda::attention_tc_forward(out, lse, qkv16, sh, DType::bf16, cuda::AttentionTcForward::mma); },
                    reps, warmup)
          : 0.0;
  if (mma) out16.convert_from(out);
  // the tensor-core backward line times the WMMA dK/dV, dQ kernels explicitly; mma.sync its own line
  const double bwd = time_ms(
      [&] {
        if (tc)
          cuda::attention_tc_backward(dqkv, dout, qkv, out, lse, sh, DType::bf16, cuda::AttentionTcBackward::wmma);
        else
          cuda::attention_fused_backward(dqkv, dout, qkv, out, lse, c.NH, c.NKV);
      },
      reps, warmup);
  const double bwd_mma =
      mma ? time_ms(
                [&] {
                  cuda::attention_tc_backward(dqkv, dout, qkv16, out16, lse, sh, DType::bf16,
                                              cuda::AttentionTcBackward::mma);
                },
                reps, warmup)
          : 0.0;
  cuda_synchronize();
  const double fwd_flops = 4.0 * c.B * c.NH * (double)c.T * c.T * c.D / 2.0, bwd_flops = 2.5 * fwd_flops;
  std::string occ;
  if (tc) {
    const cuda::AttentionTcOccupancy o = cuda::attention_tc_occupancy(c.D, DType::bf16);
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  ", \"blocks_per_sm\": {\"forward\": %d, \"dkv\": %d, \"dq\": %d}, \"smem_bytes\": {\"forward\": %lld, "
                  "\"backward\": %lld}",
                  o.forward, o.dkv, o.dq, (long long)o.forward_smem, (long long)o.backward_smem);
    occ = buf;
  }
  for (int pass = 0; pass < 2; ++pass) {
    const double ms = pass == 0 ? fwd : bwd, flops = pass == 0 ? fwd_flops : bwd_flops;
    std::printf(
        "{\"bench\": \"gpu_attention\", \"device\": \"%s\", \"kernels\": \"%s\", \"pass\": \"%s\", \"B\": %d, \"NH\": %d, "
        "\"NKV\": %d, \"T\": %d, \"D\": %d, \"ms\": %.4f, \"tflops\": %.2f%s}\n",
        cuda_device_name(0).c_str(), tc ? "bf16_tensor_core" : "fp32", pass == 0 ? "forward" : "backward", c.B, c.NH,
        c.NKV, c.T, c.D, ms, flops / (ms * 1e-3) / 1e12, occ.c_str());
  }
  if (mma) {
    int64_t smem = 0;
    const int blocks = cuda::attention_mma_occupancy(c.D, DType::bf16, &smem);
    std::printf(
        "{\"bench\": \"gpu_attention\", \"device\": \"%s\", \"kernels\": \"bf16_mma\", \"pass\": \"forward\", \"B\": %d, "
        "\"NH\": %d, \"NKV\": %d, \"T\": %d, \"D\": %d, \"ms\": %.4f, \"tflops\": %.2f, \"speedup_vs_wmma\": %.2f, "
        "\"blocks_per_sm\": {\"forward\": %d}, \"smem_bytes\": {\"forward\": %lld}}\n",
        cuda_device_name(0).c_str(), c.B, c.NH, c.NKV, c.T, c.D, fwd_mma, fwd_flops / (fwd_mma * 1e-3) / 1e12,
        fwd / fwd_mma, blocks, (long long)smem);
  }
  if (mma)
    std::printf(
        "{\"bench\": \"gpu_attention\", \"device\": \"%s\", \"kernels\": \"bf16_mma\", \"pass\": \"backward\", \"B\": %d, "
        "\"NH\": %d, \"NKV\": %d, \"T\": %d, \"D\": %d, \"ms\": %.4f, \"tflops\": %.2f, \"speedup_vs_wmma\": %.2f}\n",
        cuda_device_name(0).c_str(), c.B, c.NH, c.NKV, c.T, c.D, bwd_mma, bwd_flops / (bwd_mma * 1e-3) / 1e12,
        bwd / bwd_mma);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20, warmup = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) {
      reps = std::max(1, std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--warmup")) {
      warmup = std::max(0, std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr, "usage: bench_gpu_attention [--reps 20] [--warmup 3]\n");
      return 2;
    }
  }
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "bench_gpu_attention: no GPU on this machine\n");
    return 1;
  }
  try {
    for (const Shape4& c : {Shape4{8, 12, 12, 1024, 64}, Shape4{2, 16, 16, 2048, 128}})
      for (bool tc : {false, true}) run_case(c, tc, reps, warmup);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}

#else

int main() {
  std::printf("built without CUDA\n");
  return 1;
}

#endif
