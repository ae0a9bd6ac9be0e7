// Pointwise activations on the GPU (ops/activation.h's semantics): tanh-approximated GELU,
// SwiGLU and the residual add. Every kernel is a grid-stride loop in which each thread reads
// its element(s) before writing them, so the aliasing the CPU ops allow (gelu's out == x,
// gelu_backward's dx == dout, swiglu_backward's dgu == gu) is safe here too. No reductions:
// the results are the same bits every run. add_bias is not here (it lives with the linear
// layers' kernels).
#include "ops/cuda/common.cuh"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

// out[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Grid: grid_for(n), grid-stride.
__global__ void gelu_forward_kernel(float* out, const float* x, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    const float t = tanhf(kGeluK * (v + kGeluA * v * v * v));
    out[i] = 0.5f * v * (1.0f + t);
  }
}

// dx[i] = dout[i] * gelu'(x[i]). Grid: grid_for(n), grid-stride.
__global__ void gelu_backward_kernel(float* dx, const float* x, const float* dout, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float v = x[i];
    const float v2 = v * v;
    const float t = tanhf(kGeluK * (v + kGeluA * v2 * v));
    const float sech2 = 1.0f - t * t;
    const float grad = 0.5f * (1.0f + t) + 0.5f * v * sech2 * kGeluK * (1.0f + 3.0f * kGeluA * v2);
    dx[i] = dout[i] * grad;
  }
}

// out[n, f] = silu(gu[n, f]) * gu[n, F + f], one element of out per iteration.
// Grid: grid_for(N F), grid-stride over N * F.
__global__ void swiglu_forward_kernel(float* out, const float* gu, int64_t N, int64_t F) {
  const int64_t total = N * F;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / F, f = i - n * F;
    const float g = gu[n * 2 * F + f];
    const float u = gu[n * 2 * F + F + f];
    const float sig = 1.0f / (1.0f + expf(-g));
    out[i] = g * sig * u;
  }
}

// dgate = dout up sig (1 + gate (1 - sig)), dup = dout silu(gate); one (n, f) pair per
// iteration, both inputs read before both outputs are written (dgu may alias gu).
// Grid: grid_for(N F), grid-stride over N * F.
__global__ void swiglu_backward_kernel(float* dgu, const float* gu, const float* dout, int64_t N, int64_t F) {
  const int64_t total = N * F;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = i / F, f = i - n * F;
    const int64_t ig = n * 2 * F + f, iu = ig + F;
    const float g = gu[ig];
    const float u = gu[iu];
    const float d = dout[i];
    const float sig = 1.0f / (1.0f + expf(-g));
    const float silu = g * sig;
    dgu[ig] = d * u * sig * (1.0f + g * (1.0f - sig));
    dgu[iu] = d * silu;
  }
}

// a[i] += b[i]. Grid: grid_for(n), grid-stride.
__global__ void add_inplace_kernel(float* a, const float* b, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    a[i] += b[i];
}

void check_numel(const Tensor& t, int64_t n, const char* what) {
  MT_CHECK(t.numel() == n, what << " has " << t.numel() << " elements (shape " << shape_str(t.shape())
                                << "), expected " << n);
}

// out [N, F] and gu [N, 2F] (leading dims fold into N).
void check_swiglu(const Tensor& out, const Tensor& gu, int64_t& N, int64_t& F, const char* op) {
  MT_CHECK(out.ndim() >= 1, op << ": out must be [N, F]");
  F = out.dim(-1);
  N = F ? out.numel() / F : 0;
  MT_CHECK(gu.ndim() >= 1 && gu.dim(-1) == 2 * F && gu.numel() == 2 * N * F,
           op << ": gu must be [N, 2F] = [" << N << ", " << 2 * F << "] for out " << shape_str(out.shape()) << ", got "
              << shape_str(gu.shape()));
}

}  // namespace

// out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); out may alias x.
void gelu_forward(const Tensor& out, const Tensor& x) {
  check_device_f32(out, "gelu_forward: out");
  check_device_f32(x, "gelu_forward: x");
  check_numel(out, x.numel(), "gelu_forward: out (must match x)");
  const int64_t n = x.numel();
  if (n == 0) return;
  gelu_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(out.f32(), x.f32(), n);
  MT_CUDA_LAUNCHED("gelu_forward_kernel");
}

// dx = dout * gelu'(x); dx may alias dout.
void gelu_backward(const Tensor& dx, const Tensor& x, const Tensor& dout) {
  check_device_f32(dx, "gelu_backward: dx");
  check_device_f32(x, "gelu_backward: x");
  check_device_f32(dout, "gelu_backward: dout");
  check_numel(dx, x.numel(), "gelu_backward: dx (must match x)");
  check_numel(dout, x.numel(), "gelu_backward: dout (must match x)");
  const int64_t n = x.numel();
  if (n == 0) return;
  gelu_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(dx.f32(), x.f32(), dout.f32(), n);
  MT_CUDA_LAUNCHED("gelu_backward_kernel");
}

// out[N, F] = silu(gate) * up, gate = gu[:, :F], up = gu[:, F:]
void swiglu_forward(const Tensor& out, const Tensor& gu) {
  check_device_f32(out, "swiglu_forward: out");
  check_device_f32(gu, "swiglu_forward: gu");
  int64_t N, F;
  check_swiglu(out, gu, N, F, "swiglu_forward");
  if (N * F == 0) return;
  swiglu_forward_kernel<<<grid_for(N * F, kThreads), kThreads, 0, stream()>>>(out.f32(), gu.f32(), N, F);
  MT_CUDA_LAUNCHED("swiglu_forward_kernel");
}

// dgu[N, 2F] = gradients of gate and up (overwrites; dgu may alias gu)
void swiglu_backward(const Tensor& dgu, const Tensor& gu, const Tensor& dout) {
  check_device_f32(dgu, "swiglu_backward: dgu");
  check_device_f32(gu, "swiglu_backward: gu");
  check_device_f32(dout, "swiglu_backward: dout");
  int64_t N, F;
  check_swiglu(dout, gu, N, F, "swiglu_backward");
  check_numel(dgu, gu.numel(), "swiglu_backward: dgu (must match gu)");
  if (N * F == 0) return;
  swiglu_backward_kernel<<<grid_for(N * F, kThreads), kThreads, 0, stream()>>>(dgu.f32(), gu.f32(), dout.f32(), N,
                                                                               F);
  MT_CUDA_LAUNCHED("swiglu_backward_kernel");
}

// a += b
void add_inplace(const Tensor& a, const Tensor& b) {
  check_device_f32(a, "add_inplace: a");
  check_device_f32(b, "add_inplace: b");
  check_numel(b, a.numel(), "add_inplace: b (must match a)");
  const int64_t n = a.numel();
  if (n == 0) return;
  add_inplace_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(a.f32(), b.f32(), n);
  MT_CUDA_LAUNCHED("add_inplace_kernel");
}

}  // namespace mt::cuda
