// The whole model on the GPU against the same model on the CPU: GPT-2 and Llama, fp32 and
// bf16, forward, backward and AdamW steps (the CUDA ops behind the op functions, with the
// model code unchanged), and the GPU run's determinism. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/cuda.h"
#include "core/rng.h"
#include "nn/model.h"
#include "optim/optimizer.h"
#if MESHTRAIN_CUDA
#include "ops/cuda/ops.h"
#endif

using namespace mt;

#if MESHTRAIN_CUDA

namespace {

ModelConfig small(const std::string& family, const std::string& precision = "fp32") {
  ModelConfig m;
  m.family = family;
  m.n_layer = 2;
  m.n_head = 4;
  m.n_kv_head = family == "llama" ? 2 : 0;
  m.d_model = 64;
  m.vocab_size = 97;
  m.seq_len = 48;
  m.precision = precision;
  return m;
}

std::vector<int32_t> random_ids(int n, int vocab, uint64_t seed) {
  Philox rng{seed};
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<int32_t>(rng.uniform(1, i) * vocab);
  return v;
}

std::vector<float> host(const Tensor& t) {
  std::vector<float> v(t.numel());
  if (t.dtype() == DType::f32) {
    Tensor::wrap(v.data(), t.shape(), DType::f32).copy_from(t);
    return v;
  }
  std::vector<uint16_t> h(t.numel());
  Tensor::wrap(h.data(), t.shape(), t.dtype()).copy_from(t);
  convert(DType::f32, v.data(), t.dtype(), h.data(), t.numel());
  return v;
}

std::vector<float> all(const Model& m, bool grads) {
  std::vector<float> out;
  for (const Unit& u : m.units()) {
    const std::vector<float> v = host(grads ? u.g : u.w);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// max |a - b| / max |a|
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs((double)a[i] - b[i])), m = std::max(m, std::fabs((double)a[i]));
  return d / m;
}

struct Pair {
  CpuAllocator cpu_alloc;
  CudaAllocator gpu_alloc;
  Model cpu, gpu;
  Pair(const ModelConfig& cfg, int B) : cpu(cfg, cpu_alloc, B), gpu(cfg, gpu_alloc, B) {
    cpu.init(7);
    gpu.init(7);
  }
};

}  // namespace

class CudaModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU on this machine";
  }
};

// fp32: the two runs differ only in the summation order of the matrix products, attention
// and reductions (cuBLASLt's and the kernels' against the CPU's tile grid), each a few
// float roundings (~1e-7 relative) per sum, grown through two blocks and backward to about
// 1e-6 of the largest gradient; 2e-5 leaves room, while a wrong kernel is off by far more.
TEST_P(CudaModel, Fp32ForwardBackwardMatchesCpu) {
  const ModelConfig cfg = small(GetParam());
  const int B = 3, T = 48, N = B * T;
  Pair p(cfg, B);
  EXPECT_EQ(all(p.cpu, false), all(p.gpu, false)) << "the same initialisation on both devices";
  const auto tok = random_ids(N, cfg.vocab_size, 1), tgt = random_ids(N, cfg.vocab_size, 2);
  p.cpu.zero_grad();
  p.gpu.zero_grad();
  const double l_cpu = p.cpu.forward(tok.data(), tgt.data(), B, T);
  const double l_gpu = p.gpu.forward(tok.data(), tgt.data(), B, T);
  EXPECT_NEAR(l_gpu, l_cpu, 1e-5 * std::fabs(l_cpu));
  p.cpu.backward(1.0f / N);
  p.gpu.backward(1.0f / N);
  EXPECT_LT(rel_diff(all(p.cpu, true), all(p.gpu, true)), 2e-5);

  // Shorter sequences and batches in the same buffers (the last micro-batch, validation).
  p.cpu.zero_grad();
  p.gpu.zero_grad();
  const double s_cpu = p.cpu.forward(tok.data(), tgt.data(), 2, 17);
  const double s_gpu = p.gpu.forward(tok.data(), tgt.data(), 2, 17);
  EXPECT_NEAR(s_gpu, s_cpu, 1e-5 * std::fabs(s_cpu));
  p.cpu.backward(1.0f / 34);
  p.gpu.backward(1.0f / 34);
  EXPECT_LT(rel_diff(all(p.cpu, true), all(p.gpu, true)), 2e-5);
}

// Five AdamW steps on each device (the CPU optimizer against cuda::adamw_step over the same
// segments): the parameters stay within 1e-5 of their largest magnitude and the losses
// within 1e-5 relative (AdamW's update is lr-sized per element whatever the gradient's
// last bits, so differences do not grow over a few steps).
TEST_P(CudaModel, Fp32AdamWStepsMatchCpu) {
  const ModelConfig cfg = small(GetParam());
  const int B = 2, T = 32, N = B * T;
  Pair p(cfg, B);
  OptimConfig oc;
  oc.lr = 1e-2;
  std::vector<OptimSegment> cpu_segs;
  std::vector<Tensor> m, v;
  for (Unit& u : p.cpu.units()) {
    OptimSegment s{u.w, u.g, {}, {}};
    for (const ParamSpec& ps : u.params)
      if (ps.decay) s.decay_ranges.push_back({ps.offset, ps.offset + ps.numel()});
    cpu_segs.push_back(s);
  }
  Optimizer opt(oc, cpu_segs, p.cpu_alloc);
  for (const Unit& u : p.gpu.units()) {
    m.push_back(Tensor::zeros({u.numel}, DType::f32, p.gpu_alloc, MemTag::optim));
    v.push_back(Tensor::zeros({u.numel}, DType::f32, p.gpu_alloc, MemTag::optim));
  }
  for (int step = 1; step <= 5; ++step) {
    const auto tok = random_ids(N, cfg.vocab_size, 10 + step), tgt = random_ids(N, cfg.vocab_size, 20 + step);
    p.cpu.zero_grad();
    p.gpu.zero_grad();
    const double l_cpu = p.cpu.forward(tok.data(), tgt.data(), B, T);
    const double l_gpu = p.gpu.forward(tok.data(), tgt.data(), B, T);
    EXPECT_NEAR(l_gpu, l_cpu, 1e-5 * std::fabs(l_cpu)) << "step " << step;
    p.cpu.backward(1.0f / N);
    p.gpu.backward(1.0f / N);
    opt.step(oc.lr);
    for (size_t i = 0; i < p.gpu.units().size(); ++i) {
      const Unit& u = p.gpu.units()[i];
      cuda::adamw_step(u.w, u.g, m[i], v[i], cpu_segs[i].decay_ranges, oc.lr, oc.beta1, oc.beta2, oc.eps,
                       oc.weight_decay, step);
    }
  }
  EXPECT_LT(rel_diff(all(p.cpu, false), all(p.gpu, false)), 1e-5);
}

// bf16 working parameters and 16-bit operands in the linear layers on both devices: the
// operands are rounded identically, products are exact in fp32, and only the summation
// order differs; but an activation that lands within a rounding of a bf16 tie may round
// the other way on one device (a 2^-8 relative step in one operand), so the bounds are
// those of one such flip: 1e-3 on the loss, 2e-2 of the largest gradient.
TEST_P(CudaModel, Bf16ForwardBackwardMatchesCpu) {
  const ModelConfig cfg = small(GetParam(), "bf16");
  const int B = 2, T = 48, N = B * T;
  Pair p(cfg, B);
  const auto tok = random_ids(N, cfg.vocab_size, 3), tgt = random_ids(N, cfg.vocab_size, 4);
  p.cpu.zero_grad();
  p.gpu.zero_grad();
  const double l_cpu = p.cpu.forward(tok.data(), tgt.data(), B, T);
  const double l_gpu = p.gpu.forward(tok.data(), tgt.data(), B, T);
  EXPECT_NEAR(l_gpu, l_cpu, 1e-3 * std::fabs(l_cpu));
  p.cpu.backward(1.0f / N);
  p.gpu.backward(1.0f / N);
  EXPECT_LT(rel_diff(all(p.cpu, true), all(p.gpu, true)), 2e-2);
}

// The same step twice on the GPU gives the same bits (no atomics, fixed grids).
TEST_P(CudaModel, GpuStepIsDeterministic) {
  const ModelConfig cfg = small(GetParam());
  const int B = 2, T = 48, N = B * T;
  CudaAllocator alloc;
  Model a(cfg, alloc, B), b(cfg, alloc, B);
  a.init(5);
  b.init(5);
  const auto tok = random_ids(N, cfg.vocab_size, 8), tgt = random_ids(N, cfg.vocab_size, 9);
  for (Model* m : {&a, &b}) {
    m->zero_grad();
    m->forward(tok.data(), tgt.data(), B, T);
    m->backward(1.0f / N);
  }
  EXPECT_EQ(all(a, true), all(b, true));
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModel, ::testing::Values("gpt2", "llama"));

#else

TEST(CudaModel, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
