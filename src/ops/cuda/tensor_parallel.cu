// CUDA kernels of tensor parallelism's element-wise work: the maximum and the sums over
// every rank's gathered row statistics or key/value gradients, sequence parallelism's
// reordering between [B, T, C] and the rank-by-rank pieces, and the vocabulary-parallel
// cross-entropy's steps (row maxima, row statistics, finish, first maximum, backward).
//
// Each has the CPU function's semantics (parallel/tensor.cpp, ops/cross_entropy.cpp). The
// maxima, copies and fixed-order sums over ranks give the CPU's bits; the exponentials and
// the logarithm use the GPU's expf/logf, as the whole-vocabulary kernels do (loss_optim.cu).
// Deterministic: grids depend only on the shape, block reductions are a fixed tree, no atomics.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;  // threads per block (a power of two: the reduction trees)

void check_device_i32(const Tensor& t, const char* what) {
  MT_CHECK(t.device() == Device::cuda, what << ": tensor on " << device_name(t.device()) << ", expected cuda");
  MT_CHECK(t.dtype() == DType::i32, what << ": dtype " << dtype_name(t.dtype()) << ", expected i32");
}

void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << ": " << t.numel() << " elements (shape " << shape_str(t.shape()) << "), expected "
                                << n);
}

// The rows N (one block each) of logits [N, V], with the checks every vocabulary-shard op needs.
void check_shard(const Tensor& logits, int64_t valid, int64_t& N, int64_t& V, const char* op) {
  check_device_f32(logits, op);
  MT_CHECK(logits.ndim() >= 1 && logits.dim(-1) > 0,
           op << ": logits must be [N, V], got " << shape_str(logits.shape()));
  V = logits.dim(-1);
  N = logits.numel() / V;
  MT_CHECK(valid >= 0 && valid <= V, op << ": " << valid << " valid columns of " << V);
  MT_CHECK(N < (int64_t{1} << 31), op << ": " << N << " rows is more than one launch handles (2^31 - 1)");
}

// ---- over ranks -------------------------------------------------------------------------

// out[i] = max over r < size of all[r n + i], folded from rank 0 up as std::max does.
__global__ void max_over_ranks_kernel(float* __restrict__ out, const float* __restrict__ all, int64_t n, int size) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float m = all[i];
    for (int r = 1; r < size; ++r) {
      const float a = all[r * n + i];
      m = (m < a) ? a : m;  // std::max(m, a)
    }
    out[i] = m;
  }
}

// out[i] = all[first n + i] + ... + all[(first + count - 1) n + i], added in rank order.
__global__ void sum_over_ranks_kernel(float* __restrict__ out, const float* __restrict__ all, int64_t n, int first,
                                      int count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = all[first * n + i];
    for (int r = first + 1; r < first + count; ++r) s = __fadd_rn(s, all[r * n + i]);
    out[i] = s;
  }
}

// Element j of full [B, T, C] <-> element k of ranked [size, B, T / size, C]; to_ranked
// copies full -> ranked, else ranked -> full. Grid-stride over B T C.
__global__ void ranked_kernel(float* __restrict__ full, float* __restrict__ ranked, int64_t B, int64_t T, int64_t C,
                              int64_t Tl, bool to_ranked) {
  const int64_t total = B * T * C;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = j % C, t = (j / C) % T, b = j / (C * T);
    const int64_t r = t / Tl, tl = t % Tl;
    const int64_t k = ((r * B + b) * Tl + tl) * C + c;
    if (to_ranked) ranked[k] = full[j];
    else full[j] = ranked[k];
  }
}

// ---- vocabulary-parallel cross-entropy ----------------------------------------------------

// One block per row n: row_max[n] = max of logits[n, 0..valid) (-inf when valid is 0).
__global__ void row_max_kernel(float* __restrict__ row_max, const float* __restrict__ logits, int64_t V,
                               int64_t valid) {
  __shared__ float buf[kThreads];
  const float* row = logits + blockIdx.x * V;  // [V]
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < valid; i += kThreads) m = row[i] > m ? row[i] : m;
  m = block_reduce<kThreads>(m, buf, [](float a, float b) { return a > b ? a : b; });
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

// One block per row n: sum_exp[n] = sum over i < valid of exp(logits[n, i] - row_max[n])
// (thread j sums columns j, j + kThreads, ... in order, then the tree); target_logit[n] =
// logits[n, t - begin] where this shard holds target t, else 0.
__global__ void row_stats_kernel(float* __restrict__ sum_exp, float* __restrict__ target_logit,
                                 const float* __restrict__ logits, const int32_t* __restrict__ targets,
                                 const float* __restrict__ row_max, int64_t V, int64_t begin, int64_t valid) {
  __shared__ float buf[kThreads];
  const int64_t n = blockIdx.x;
  const float* row = logits + n * V;  // [V]
  const float m = row_max[n];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < valid; i += kThreads) s += expf(row[i] - m);
  s = block_reduce<kThreads>(s, buf, [](float a, float b) { return a + b; });
  if (threadIdx.x == 0) {
    sum_exp[n] = s;
    const int64_t t = static_cast<int64_t>(targets[n]) - begin;
    target_logit[n] = targets[n] >= 0 && t >= 0 && t < valid ? row[t] : 0.0f;
  }
}

// lse[n] = row_max[n] + log(sum_exp[n]); losses[n] = lse[n] - target_logit[n] (0 when the
// target is -1). Grid-stride over N.
__global__ void finish_kernel(float* __restrict__ losses, float* __restrict__ lse, const float* __restrict__ row_max,
                              const float* __restrict__ sum_exp, const float* __restrict__ target_logit,
                              const int32_t* __restrict__ targets, int64_t N) {
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float l = __fadd_rn(row_max[n], logf(sum_exp[n]));
    lse[n] = l;
    losses[n] = targets[n] < 0 ? 0.0f : __fsub_rn(l, target_logit[n]);
  }
}

// One block: out[0] = the sum of losses[0..N) in double; thread j sums rows j, j + kThreads,
// ... in order, then the tree (the order of the whole-vocabulary kernel's total).
__global__ void total_kernel(double* out, const float* __restrict__ losses, int64_t N) {
  __shared__ double buf[kThreads];
  double acc = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += kThreads) acc += static_cast<double>(losses[n]);
  acc = block_reduce<kThreads>(acc, buf, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) out[0] = acc;
}

// One block per row n: first[n] = -(begin + the first column i < valid with logits[n, i] ==
// row_max[n]), or -inf where there is none. The tree takes the least such column.
__global__ void first_max_kernel(float* __restrict__ first, const float* __restrict__ logits,
                                 const float* __restrict__ row_max, int64_t V, int64_t begin, int64_t valid) {
  __shared__ int64_t buf[kThreads];
  const int64_t n = blockIdx.x;
  const float* row = logits + n * V;  // [V]
  const float m = row_max[n];
  int64_t at = valid;  // none
  for (int64_t i = threadIdx.x; i < valid; i += kThreads)
    if (row[i] == m) {
      at = i;  // the thread's columns rise: its first hit is its least
      break;
    }
  at = block_reduce<kThreads>(at, buf, [](int64_t a, int64_t b) { return a < b ? a : b; });
  if (threadIdx.x == 0) first[n] = at < valid ? -static_cast<float>(begin + at) : -INFINITY;
}

// v as Out: itself, or rounded to the nearest bf16 / f16 (ties to even), as cuda_convert does.
template <class Out>
__device__ Out rounded_as(float v) {
  if constexpr (std::is_same_v<Out, float>) return v;
  else if constexpr (std::is_same_v<Out, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

// Grid (N, chunks): dlogits[n, i] = exp(logits[n, i] - lse[n]) * scale for i < valid, minus
// scale at the target's column when this shard holds it; 0 in the padding columns and on
// ignored rows; in fp32, or rounded to Out. Each element is read before the same thread
// writes it: fp32 dlogits may alias logits.
template <class Out>
__global__ void backward_shard_kernel(Out* dlogits, const float* logits, const float* __restrict__ lse,
                                      const int32_t* __restrict__ targets, float scale, int64_t V, int64_t begin,
                                      int64_t valid) {
  const int64_t n = blockIdx.x;
  const int64_t t = targets[n] < 0 ? -1 : static_cast<int64_t>(targets[n]) - begin;  // the local column, if held
  const bool ignored = targets[n] < 0;
  const float* row = logits + n * V;  // [V]
  Out* d = dlogits + n * V;           // [V]
  const float l = lse[n];
  const int64_t step = static_cast<int64_t>(gridDim.y) * kThreads;
  for (int64_t i = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x; i < V; i += step) {
    if (ignored || i >= valid) {
      d[i] = rounded_as<Out>(0.0f);
      continue;
    }
    float g = __fmul_rn(expf(row[i] - l), scale);  // the CPU op's order: no fused multiply-add
    if (i == t) g = __fsub_rn(g, scale);
    d[i] = rounded_as<Out>(g);
  }
}

}  // namespace

void max_over_ranks(const Tensor& out, const Tensor& all, int size) {
  check_device_f32(out, "tp max: out");
  check_device_f32(all, "tp max: gathered");
  const int64_t n = out.numel();
  MT_CHECK(size >= 1 && all.numel() >= n * size, "tp max: " << all.numel() << " gathered elements for " << size
                                                              << " ranks of " << n);
  if (n == 0) return;
  max_over_ranks_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(out.f32(), all.f32(), n, size);
  MT_CUDA_LAUNCHED("max_over_ranks_kernel");
}

void sum_over_ranks(const Tensor& out, const Tensor& all, int first, int count) {
  check_device_f32(out, "tp sum over key/value sharers: out");
  check_device_f32(all, "tp sum over key/value sharers: gathered");
  const int64_t n = out.numel();
  MT_CHECK(first >= 0 && count >= 1 && all.numel() >= n * (first + count),
           "tp sum over ranks " << first << " to " << first + count - 1 << ": " << all.numel() << " gathered elements");
  if (n == 0) return;
  sum_over_ranks_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(out.f32(), all.f32(), n, first, count);
  MT_CUDA_LAUNCHED("sum_over_ranks_kernel");
}

void reorder_sequence(const Tensor& full, const Tensor& ranked, int size, bool to_ranked) {
  check_device_f32(full, "sequence-parallel reorder: full");
  check_device_f32(ranked, "sequence-parallel reorder: ranked");
  MT_CHECK(full.ndim() == 3 && size >= 1 && full.dim(1) % size == 0 && ranked.numel() >= full.numel(),
           "sequence-parallel reorder: full " << shape_str(full.shape()) << ", " << ranked.numel()
                                              << " ranked elements, " << size << " ranks");
  const int64_t B = full.dim(0), T = full.dim(1), C = full.dim(2);
  if (full.numel() == 0) return;
  ranked_kernel<<<grid_for(full.numel(), kThreads), kThreads, 0, stream()>>>(full.f32(), ranked.f32(), B, T, C,
                                                                             T / size, to_ranked);
  MT_CUDA_LAUNCHED("ranked_kernel");
}

void cross_entropy_row_max(const Tensor& row_max, const Tensor& logits, int64_t valid) {
  int64_t N = 0, V = 0;
  check_shard(logits, valid, N, V, "cross_entropy_row_max");
  check_device_f32(row_max, "cross_entropy_row_max: row_max");
  check_numel(row_max, N, "cross_entropy_row_max: row_max");
  if (N == 0) return;
  row_max_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream()>>>(row_max.f32(), logits.f32(), V, valid);
  MT_CUDA_LAUNCHED("row_max_kernel");
}

void cross_entropy_row_stats(const Tensor& sum_exp, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, int64_t begin, int64_t valid, const Tensor& row_max) {
  int64_t N = 0, V = 0;
  check_shard(logits, valid, N, V, "cross_entropy_row_stats");
  check_device_i32(targets, "cross_entropy_row_stats: targets");
  check_numel(targets, N, "cross_entropy_row_stats: targets");
  for (const Tensor* t : {&sum_exp, &target_logit, &row_max}) {
    check_device_f32(*t, "cross_entropy_row_stats");
    check_numel(*t, N, "cross_entropy_row_stats");
  }
  if (N == 0) return;
  row_stats_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream()>>>(
      sum_exp.f32(), target_logit.f32(), logits.f32(), targets.i32(), row_max.f32(), V, begin, valid);
  MT_CUDA_LAUNCHED("row_stats_kernel");
}

double cross_entropy_finish(const Tensor& losses, const Tensor& lse, const Tensor& row_max, const Tensor& sum_exp,
                            const Tensor& target_logit, const Tensor& targets) {
  const int64_t N = losses.numel();
  for (const Tensor* t : {&losses, &lse, &row_max, &sum_exp, &target_logit}) {
    check_device_f32(*t, "cross_entropy_finish");
    check_numel(*t, N, "cross_entropy_finish");
  }
  check_device_i32(targets, "cross_entropy_finish: targets");
  check_numel(targets, N, "cross_entropy_finish: targets");
  if (N == 0) return 0.0;
  finish_kernel<<<grid_for(N, kThreads), kThreads, 0, stream()>>>(losses.f32(), lse.f32(), row_max.f32(),
                                                                  sum_exp.f32(), target_logit.f32(), targets.i32(), N);
  MT_CUDA_LAUNCHED("finish_kernel");
  double* total = nullptr;
  total = static_cast<double*>(cuda_scratch_allocate(sizeof(double), "the loss's total"));
  total_kernel<<<1, kThreads, 0, stream()>>>(total, losses.f32(), N);
  const cudaError_t launched = cudaGetLastError();
  double h = 0.0;
  const cudaError_t copied = cudaMemcpyAsync(&h, total, sizeof(double), cudaMemcpyDeviceToHost, stream());
  const cudaError_t freed = cudaFreeAsync(total, stream());
  MT_CHECK(launched == cudaSuccess, "CUDA kernel total_kernel failed to launch: " << cudaGetErrorString(launched));
  MT_CUDA_CHECK(copied);
  MT_CUDA_CHECK(freed);
  MT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return h;
}

void cross_entropy_first_max(const Tensor& first, const Tensor& logits, const Tensor& row_max, int64_t begin,
                             int64_t valid) {
  int64_t N = 0, V = 0;
  check_shard(logits, valid, N, V, "cross_entropy_first_max");
  for (const Tensor* t : {&first, &row_max}) {
    check_device_f32(*t, "cross_entropy_first_max");
    check_numel(*t, N, "cross_entropy_first_max");
  }
  if (N == 0) return;
  first_max_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream()>>>(first.f32(), logits.f32(), row_max.f32(), V,
                                                                        begin, valid);
  MT_CUDA_LAUNCHED("first_max_kernel");
}

void cross_entropy_backward_shard(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                                  const Tensor& targets, float scale, int64_t begin, int64_t valid) {
  int64_t N = 0, V = 0;
  check_shard(logits, valid, N, V, "cross_entropy_backward");
  check_device_f32(dlogits, "cross_entropy_backward: dlogits");
  check_numel(dlogits, N * V, "cross_entropy_backward: dlogits (must match logits)");
  cross_entropy_backward_shard_to(dlogits.raw(), DType::f32, logits, lse, targets, scale, begin, valid);
}

void cross_entropy_backward_shard_to(void* dlogits, DType dt, const Tensor& logits, const Tensor& lse,
                                     const Tensor& targets, float scale, int64_t begin, int64_t valid) {
  int64_t N = 0, V = 0;
  check_shard(logits, valid, N, V, "cross_entropy_backward");
  check_device_f32(lse, "cross_entropy_backward: lse");
  check_numel(lse, N, "cross_entropy_backward: lse");
  check_device_i32(targets, "cross_entropy_backward: targets");
  check_numel(targets, N, "cross_entropy_backward: targets");
  if (N == 0) return;
  // about 4 columns per thread; at most 65535 chunks (the grid's y limit), the loop covers the rest
  const int64_t chunks = std::min<int64_t>(ceil_div(V, int64_t{kThreads} * 4), 65535);
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(chunks));
  auto launch = [&](auto* out) {
    backward_shard_kernel<<<grid, kThreads, 0, stream()>>>(out, logits.f32(), lse.f32(), targets.i32(), scale, V,
                                                           begin, valid);
  };
  if (dt == DType::f32) launch(static_cast<float*>(dlogits));
  else if (dt == DType::bf16) launch(static_cast<__nv_bfloat16*>(dlogits));
  else if (dt == DType::f16) launch(static_cast<__half*>(dlogits));
  else MT_FAIL("internal: cross_entropy_backward into " << dtype_name(dt));
  MT_CUDA_LAUNCHED("backward_shard_kernel");
}

}  // namespace mt::cuda
