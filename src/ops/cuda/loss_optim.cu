// CUDA kernels of the loss and the optimizer: fused softmax cross-entropy (forward and
// backward), the AdamW update of a flat segment, SGD / LARS and LAMB over a tensor's
// elements, sums of squares (of values, or of LAMB's update direction) and in-place scaling.
//
// Every kernel runs on the compute stream. Reductions are deterministic: block sizes and
// grids depend only on the shape, each thread sums a fixed strided set of elements in
// index order, and blocks combine their threads in a fixed shared-memory tree (no atomics).
// Scratch memory (the per-block partial sums, the one-double results, a long list of decay
// ranges) is taken with cudaMallocAsync and given back with cudaFreeAsync on the stream.
#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;        // threads per block of every kernel here (a power of two)
constexpr int kSumsqBlocks = 1024;   // sumsq's fixed grid: per-block partials, then one block
constexpr int kDecayInline = 16;     // decay ranges passed by value; more go through device memory

// Copies one double from the device and waits for it (the functions that return a value).
double fetch_double(const double* d) {
  double h = 0.0;
  MT_CUDA_CHECK(cudaMemcpyAsync(&h, d, sizeof(double), cudaMemcpyDeviceToHost, stream()));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return h;
}

// ---- block reductions (blockDim.x == kThreads; every thread of the block must call) ----
// common.cuh's fixed-order tree.

__device__ float block_max(float x, float* buf) {
  return block_reduce<kThreads>(x, buf, [](float a, float b) { return a > b ? a : b; });
}
template <class T>
__device__ T block_sum(T x, T* buf) {
  return block_reduce<kThreads>(x, buf, [](T a, T b) { return a + b; });
}

// ---- cross entropy --------------------------------------------------------------------

// One block per row n (grid N, kThreads threads), one pass over the row (the logits are the
// step's largest tensor; a second pass would read them from memory again): thread j visits
// columns j, j + kThreads, ... in order, keeping its running max m_j and s_j = sum of
// exp(logit - m_j), rescaled when m_j rises; then m = the block's max and s = the block's
// sum of s_j exp(m_j - m), both by the fixed tree. lse[n] = m + log(s), losses[n] = lse -
// logits[n, t] (0 when t == -1). A NaN logit makes s, and so the loss, NaN.
__global__ void ce_forward_kernel(float* __restrict__ losses, float* __restrict__ lse,
                                  const float* __restrict__ logits, const int32_t* __restrict__ targets, int64_t V) {
  __shared__ float buf[kThreads];
  const int64_t n = blockIdx.x;
  const float* row = logits + n * V;  // [V]
  float mj = -INFINITY, sj = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const float x = row[i];
    if (x > mj) {
      sj = sj * expf(mj - x) + 1.0f;  // the first value: 0 * exp(-inf) + 1
      mj = x;
    } else if (x != -INFINITY) {  // exp(-inf) adds 0; skipped, a thread of -inf logits keeps s_j = 0
      sj += expf(x - mj);
    }
  }
  const float m = block_max(mj, buf);
  const float s = block_sum(sj == 0.0f ? 0.0f : sj * expf(mj - m), buf);  // a thread without columns: 0
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    const int32_t t = targets[n];
    lse[n] = l;
    losses[n] = (t < 0 || t >= V) ? 0.0f : l - row[t];  // t was checked on the host to be in [-1, V)
  }
}

// One block (kThreads threads): out[0] = sum of losses[0..N) in double. Thread j sums rows
// j, j + kThreads, ... in order; the tree combines the threads.
__global__ void ce_total_kernel(double* out, const float* __restrict__ losses, int64_t N) {
  __shared__ double buf[kThreads];
  double acc = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += kThreads) acc += static_cast<double>(losses[n]);
  acc = block_sum(acc, buf);
  if (threadIdx.x == 0) out[0] = acc;
}

// Grid (N, chunks) of kThreads threads: block (n, c) writes dlogits[n, i] for the columns
// i = c * kThreads + j, stepping by chunks * kThreads: (exp(logit - lse[n]) - [i == t]) * scale,
// or 0 for an ignored row. Each element is read before the same thread writes it, so
// dlogits may alias logits (no __restrict__ on those two).
__global__ void ce_backward_kernel(float* dlogits, const float* logits, const float* __restrict__ lse,
                                   const int32_t* __restrict__ targets, float scale, int64_t V) {
  const int64_t n = blockIdx.x;
  const int32_t t = targets[n];
  const float* row = logits + n * V;  // [V]
  float* d = dlogits + n * V;         // [V]
  const int64_t step = static_cast<int64_t>(gridDim.y) * kThreads;
  if (t < 0) {
    for (int64_t i = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x; i < V; i += step) d[i] = 0.0f;
    return;
  }
  const float l = lse[n];
  for (int64_t i = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x; i < V; i += step) {
    // the CPU op's order: exp * scale, then minus scale at the target (no fused multiply-add)
    float g = __fmul_rn(expf(row[i] - l), scale);
    if (i == t) g = __fsub_rn(g, scale);
    d[i] = g;
  }
}

// Checks the operands of the cross-entropy ops (device f32 logits/lse, device i32 targets,
// shapes), then copies the targets to the host and checks each is in [0, V) or -1, as the
// CPU op does (this waits for the stream). Returns N and V.
void check_ce(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t& N, int64_t& V,
              const char* op) {
  check_device_f32(logits, op);
  check_device_f32(lse, op);
  MT_CHECK(targets.device() == Device::cuda, op << ": targets on " << device_name(targets.device())
                                                 << ", expected cuda");
  MT_CHECK(targets.dtype() == DType::i32, op << ": targets must be i32, got " << dtype_name(targets.dtype()));
  MT_CHECK(logits.ndim() >= 1 && logits.dim(-1) > 0, op << ": logits must be [N, V] with V > 0, got "
                                                          << shape_str(logits.shape()));
  V = logits.dim(-1);
  N = logits.numel() / V;
  MT_CHECK(targets.numel() == N, op << ": targets has " << targets.numel() << " elements, logits "
                                    << shape_str(logits.shape()) << " has " << N << " rows");
  MT_CHECK(lse.numel() == N, op << ": lse has " << lse.numel() << " elements (shape " << shape_str(lse.shape())
                                << "), expected " << N);
  MT_CHECK(N < (int64_t{1} << 31), op << ": " << N << " rows is more than one launch handles (2^31 - 1)");
  std::vector<int32_t> tp(static_cast<size_t>(N));
  cuda_memcpy(tp.data(), targets.raw(), static_cast<size_t>(N) * sizeof(int32_t));
  for (int64_t n = 0; n < N; ++n)
    MT_CHECK(tp[n] >= -1 && tp[n] < V, op << ": target " << tp[n] << " at row " << n << " is outside [0, " << V
                                          << ") (use -1 to ignore a position)");
}

}  // namespace

double cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets) {
  int64_t N = 0, V = 0;
  check_ce(logits, targets, lse, N, V, "cross_entropy_forward: logits/targets/lse");
  check_device_f32(losses, "cross_entropy_forward: losses");
  MT_CHECK(losses.numel() == N, "cross_entropy_forward: losses has " << losses.numel() << " elements (shape "
                                    << shape_str(losses.shape()) << "), expected " << N);
  if (N == 0) return 0.0;
  ce_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream()>>>(
      losses.data<float>(), lse.data<float>(), logits.data<float>(), targets.data<int32_t>(), V);
  MT_CUDA_LAUNCHED("ce_forward_kernel");
  Scratch total(sizeof(double));
  ce_total_kernel<<<1, kThreads, 0, stream()>>>(total.as<double>(), losses.data<float>(), N);
  MT_CUDA_LAUNCHED("ce_total_kernel");
  return fetch_double(total.as<double>());
}

void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            float scale) {
  int64_t N = 0, V = 0;
  check_ce(logits, targets, lse, N, V, "cross_entropy_backward: logits/targets/lse");
  check_device_f32(dlogits, "cross_entropy_backward: dlogits");
  MT_CHECK(dlogits.numel() == N * V, "cross_entropy_backward: dlogits (must match logits) has "
                                         << dlogits.numel() << " elements (shape " << shape_str(dlogits.shape())
                                         << "), expected " << N * V);
  if (N == 0) return;
  // about 4 columns per thread; at most 65535 chunks (the grid's y limit), the loop covers the rest
  const int64_t chunks = std::min<int64_t>(ceil_div(V, int64_t{kThreads} * 4), 65535);
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>(chunks));
  ce_backward_kernel<<<grid, kThreads, 0, stream()>>>(dlogits.data<float>(), logits.data<float>(), lse.data<float>(),
                                                      targets.data<int32_t>(), scale, V);
  MT_CUDA_LAUNCHED("ce_backward_kernel");
}

// ---- AdamW ----------------------------------------------------------------------------

namespace {

// The update's constants, rounded to float on the host exactly as the CPU optimizer does.
struct AdamConsts {
  float decay_mul;     // 1 - lr * wd, on elements in a decay range (others: 1)
  float b1, b2, one_minus_b1, one_minus_b2;
  float step_size;     // lr / bc1
  float bc2_sqrt;      // sqrt(bc2)
  float eps;
};

// The decay ranges [begin, end), sorted and disjoint: up to kDecayInline by value, else in
// device memory (`dev`: begin0, end0, begin1, end1, ...).
struct DecayRanges {
  int count = 0;
  int64_t begin[kDecayInline] = {};
  int64_t end[kDecayInline] = {};
  const int64_t* dev = nullptr;
};

__device__ bool in_decay(const DecayRanges& r, int64_t i) {
  if (r.dev == nullptr) {
    bool hit = false;
#pragma unroll
    for (int k = 0; k < kDecayInline; ++k)
      if (k < r.count && i >= r.begin[k] && i < r.end[k]) hit = true;
    return hit;
  }
  // the last range whose begin <= i, then whether i is before its end
  int lo = 0, hi = r.count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (r.dev[2 * mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && i < r.dev[2 * (lo - 1) + 1];
}

// Grid-stride over the n elements of the segment (grid_for(n) blocks of kThreads): PyTorch's
// AdamW in the CPU optimizer's float operation order, each operation rounded on its own:
// p *= decay_mul; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g g; p -= step_size m / (sqrt(v) / bc2_sqrt + eps).
__global__ void adamw_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                             float* __restrict__ v, int64_t n, AdamConsts c, DecayRanges r) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float pi = in_decay(r, i) ? __fmul_rn(p[i], c.decay_mul) : p[i];  // the CPU's p * 1.0f is p
    const float mi = __fadd_rn(__fmul_rn(m[i], c.b1), __fmul_rn(c.one_minus_b1, gi));
    const float vi = __fadd_rn(__fmul_rn(v[i], c.b2), __fmul_rn(__fmul_rn(c.one_minus_b2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
    p[i] = __fsub_rn(pi, __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
  }
}

}  // namespace

void adamw_step(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                const std::vector<std::pair<int64_t, int64_t>>& decay, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t t) {
  check_device_f32(w, "adamw_step: w");
  check_device_f32(g, "adamw_step: g");
  check_device_f32(m, "adamw_step: m");
  check_device_f32(v, "adamw_step: v");
  const int64_t n = w.numel();
  for (const Tensor* x : {&g, &m, &v})
    MT_CHECK(x->numel() == n, "adamw_step: g, m and v must have w's " << n << " elements, got " << x->numel()
                                                                      << " (shape " << shape_str(x->shape()) << ")");
  MT_CHECK(t >= 1, "adamw_step: the step count t starts at 1, got " << t);
  int64_t prev_end = 0;
  for (const auto& [b, e] : decay) {
    MT_CHECK(b >= prev_end && b <= e && e <= n, "adamw_step: decay range [" << b << ", " << e
                                                    << ") is not sorted, disjoint and inside [0, " << n << ")");
    prev_end = e;
  }
  MT_CHECK(decay.size() < (size_t{1} << 30), "adamw_step: " << decay.size() << " decay ranges is too many");
  if (n == 0) return;

  // The constants as Optimizer::step computes them (optim/optimizer.cpp).
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  AdamConsts c;
  c.decay_mul = static_cast<float>(1.0 - lr * weight_decay);
  c.b1 = static_cast<float>(beta1);
  c.b2 = static_cast<float>(beta2);
  c.one_minus_b1 = static_cast<float>(1.0 - beta1);
  c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(eps);

  DecayRanges r;
  r.count = static_cast<int>(decay.size());
  std::unique_ptr<Scratch> dev_ranges;
  if (decay.size() <= static_cast<size_t>(kDecayInline)) {
    for (size_t k = 0; k < decay.size(); ++k) {
      r.begin[k] = decay[k].first;
      r.end[k] = decay[k].second;
    }
  } else {
    std::vector<int64_t> flat;  // begin0, end0, begin1, end1, ...
    for (const auto& [b, e] : decay) {
      flat.push_back(b);
      flat.push_back(e);
    }
    dev_ranges = std::make_unique<Scratch>(flat.size() * sizeof(int64_t));
    cuda_memcpy(dev_ranges->get(), flat.data(), flat.size() * sizeof(int64_t));  // waits: `flat` is freed after
    r.dev = dev_ranges->as<int64_t>();
  }
  adamw_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(w.data<float>(), g.data<float>(), m.data<float>(),
                                                                  v.data<float>(), n, c, r);
  MT_CUDA_LAUNCHED("adamw_kernel");
}

// ---- SGD, LARS and LAMB -----------------------------------------------------------------

namespace {

// Grid-stride (grid_for(n) blocks of kThreads): the CPU's sgd_range, each operation rounded
// on its own (no fused multiply-add).
__global__ void sgd_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ buf, int64_t n,
                           float wd, float lr, float momentum, bool first, bool nesterov, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float pi = p[i];
    const float d = __fmul_rn(scale, __fadd_rn(g[i], __fmul_rn(wd, pi)));
    const float b = first ? d : __fadd_rn(__fmul_rn(momentum, buf[i]), d);
    buf[i] = b;
    const float upd = nesterov ? __fadd_rn(d, __fmul_rn(momentum, b)) : b;
    p[i] = __fsub_rn(pi, __fmul_rn(lr, upd));
  }
}

// LAMB's direction u = (m inv_bc1) / (sqrt(v) / bc2_sqrt + eps) + wd w, the CPU's order.
__device__ float lamb_direction(float m, float v, float w, float wd, const LambConsts& c) {
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  return __fadd_rn(__fdiv_rn(__fmul_rn(m, c.inv_bc1), denom), __fmul_rn(wd, w));
}

// Grid-stride: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g.
__global__ void lamb_moments_kernel(const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                                    int64_t n, LambConsts c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    m[i] = __fadd_rn(__fmul_rn(m[i], c.b1), __fmul_rn(c.one_minus_b1, gi));
    v[i] = __fadd_rn(__fmul_rn(v[i], c.b2), __fmul_rn(__fmul_rn(c.one_minus_b2, gi), gi));
  }
}

// Grid-stride: w -= step u.
__global__ void lamb_apply_kernel(float* __restrict__ w, const float* __restrict__ m, const float* __restrict__ v,
                                  int64_t n, LambConsts c, float wd, float step) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float wi = w[i];
    w[i] = __fsub_rn(wi, __fmul_rn(step, lamb_direction(m[i], v[i], wi, wd, c)));
  }
}

void check_same_numel(const Tensor& x, const Tensor& ref, const char* what) {
  MT_CHECK(x.numel() == ref.numel(), what << " has " << x.numel() << " elements (shape " << shape_str(x.shape())
                                          << "), expected " << ref.numel());
}

}  // namespace

void sgd_step(const Tensor& w, const Tensor& g, const Tensor& buf, float wd, float lr, float momentum, bool first,
              bool nesterov, float scale) {
  check_device_f32(w, "sgd_step: w");
  check_device_f32(g, "sgd_step: g");
  check_device_f32(buf, "sgd_step: buf");
  check_same_numel(g, w, "sgd_step: g");
  check_same_numel(buf, w, "sgd_step: buf");
  const int64_t n = w.numel();
  if (n == 0) return;
  sgd_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(w.data<float>(), g.data<float>(), buf.data<float>(),
                                                                n, wd, lr, momentum, first, nesterov, scale);
  MT_CUDA_LAUNCHED("sgd_kernel");
}

void lamb_moments(const Tensor& g, const Tensor& m, const Tensor& v, const LambConsts& c) {
  check_device_f32(g, "lamb_moments: g");
  check_device_f32(m, "lamb_moments: m");
  check_device_f32(v, "lamb_moments: v");
  check_same_numel(m, g, "lamb_moments: m");
  check_same_numel(v, g, "lamb_moments: v");
  const int64_t n = g.numel();
  if (n == 0) return;
  lamb_moments_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(g.data<float>(), m.data<float>(),
                                                                         v.data<float>(), n, c);
  MT_CUDA_LAUNCHED("lamb_moments_kernel");
}

void lamb_apply(const Tensor& w, const Tensor& m, const Tensor& v, const LambConsts& c, float wd, float step) {
  check_device_f32(w, "lamb_apply: w");
  check_device_f32(m, "lamb_apply: m");
  check_device_f32(v, "lamb_apply: v");
  check_same_numel(m, w, "lamb_apply: m");
  check_same_numel(v, w, "lamb_apply: v");
  const int64_t n = w.numel();
  if (n == 0) return;
  lamb_apply_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(w.data<float>(), m.data<float>(),
                                                                       v.data<float>(), n, c, wd, step);
  MT_CUDA_LAUNCHED("lamb_apply_kernel");
}

// ---- sums of squares, scaling ---------------------------------------------------------

namespace {

// What a sum of squares reads at element i: x[i] (widened from 16 bits), or LAMB's direction there.
__device__ float widen(float x) { return x; }
__device__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ float widen(__half x) { return __half2float(x); }
template <class T>
struct Plain {
  const T* x;
  __device__ float operator()(int64_t i) const { return widen(x[i]); }
};
struct LambDirection {
  const float *w, *m, *v;
  float wd;
  LambConsts c;
  __device__ float operator()(int64_t i) const { return lamb_direction(m[i], v[i], w[i], wd, c); }
};

// Grid kSumsqBlocks x kThreads: part[b] = the sum in double of load(i)^2 over the elements
// i = b * kThreads + j + k * kSumsqBlocks * kThreads (thread j, k = 0, 1, ... in order),
// threads combined by the block tree.
template <class Load>
__global__ void sumsq_partial_kernel(double* __restrict__ part, Load load, int64_t n) {
  __shared__ double buf[kThreads];
  double acc = 0.0;
  const int64_t step = static_cast<int64_t>(kSumsqBlocks) * kThreads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n; i += step) {
    const double xi = load(i);
    acc += xi * xi;
  }
  acc = block_sum(acc, buf);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// One block of kThreads: out[0] = the sum of part[0..count) (thread j: j, j + kThreads, ...
// in order, then the tree).
__global__ void sum_parts_kernel(double* out, const double* __restrict__ part, int count) {
  __shared__ double buf[kThreads];
  double acc = 0.0;
  for (int k = threadIdx.x; k < count; k += kThreads) acc += part[k];
  acc = block_sum(acc, buf);
  if (threadIdx.x == 0) out[0] = acc;
}

// Grid-stride (grid_for(n) blocks of kThreads): x[i] *= s.
__global__ void scale_kernel(float* __restrict__ x, int64_t n, float s) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = x[i] * s;
}

}  // namespace

std::vector<double> sumsq_each(const std::vector<SumsqTerm>& terms, const LambConsts& c) {
  const size_t k = terms.size();
  std::vector<double> out(k, 0.0);
  for (const SumsqTerm& t : terms) {
    if (!t.x.defined()) continue;
    if (!t.m.defined()) {
      MT_CHECK(t.x.device() == Device::cuda, "sumsq: x: tensor on " << device_name(t.x.device()) << ", expected cuda");
      MT_CHECK(t.x.dtype() == DType::f32 || t.x.dtype() == DType::bf16 || t.x.dtype() == DType::f16,
               "sumsq: x: dtype " << dtype_name(t.x.dtype()) << ", expected f32, bf16 or f16");
      continue;
    }
    check_device_f32(t.x, "sumsq: x");
    check_device_f32(t.m, "sumsq: m");
    check_device_f32(t.v, "sumsq: v");
    check_same_numel(t.m, t.x, "sumsq: m");
    check_same_numel(t.v, t.x, "sumsq: v");
  }
  if (k == 0) return out;
  Scratch scratch(k * (kSumsqBlocks + 1) * sizeof(double));  // [k][kSumsqBlocks partials], then [k] totals
  double* totals = scratch.as<double>() + k * kSumsqBlocks;
  MT_CUDA_CHECK(cudaMemsetAsync(totals, 0, k * sizeof(double), stream()));  // the empty terms' 0
  for (size_t j = 0; j < k; ++j) {
    const SumsqTerm& t = terms[j];
    const int64_t n = t.x.defined() ? t.x.numel() : 0;
    if (n == 0) continue;
    double* part = scratch.as<double>() + j * kSumsqBlocks;
    if (t.m.defined())
      sumsq_partial_kernel<<<kSumsqBlocks, kThreads, 0, stream()>>>(
          part, LambDirection{t.x.data<float>(), t.m.data<float>(), t.v.data<float>(), t.wd, c}, n);
    else if (t.x.dtype() == DType::bf16)
      sumsq_partial_kernel<<<kSumsqBlocks, kThreads, 0, stream()>>>(
          part, Plain<__nv_bfloat16>{static_cast<const __nv_bfloat16*>(t.x.raw())}, n);
    else if (t.x.dtype() == DType::f16)
      sumsq_partial_kernel<<<kSumsqBlocks, kThreads, 0, stream()>>>(
          part, Plain<__half>{static_cast<const __half*>(t.x.raw())}, n);
    else
      sumsq_partial_kernel<<<kSumsqBlocks, kThreads, 0, stream()>>>(part, Plain<float>{t.x.data<float>()}, n);
    MT_CUDA_LAUNCHED("sumsq_partial_kernel");
    sum_parts_kernel<<<1, kThreads, 0, stream()>>>(totals + j, part, kSumsqBlocks);
    MT_CUDA_LAUNCHED("sum_parts_kernel");
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(out.data(), totals, k * sizeof(double), cudaMemcpyDeviceToHost, stream()));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return out;
}

double sumsq(const Tensor& x) {
  check_device_f32(x, "sumsq: x");
  return sumsq_each({SumsqTerm{x, {}, {}, 0.0f}})[0];
}

void scale_inplace(const Tensor& x, float s) {
  check_device_f32(x, "scale_inplace: x");
  const int64_t n = x.numel();
  if (n == 0) return;
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x.data<float>(), n, s);
  MT_CUDA_LAUNCHED("scale_kernel");
}

}  // namespace mt::cuda
