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
#include "train_runs.h"
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

// max over steps of |a - b| / |a|
double loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s) d = std::max(d, std::fabs(a[s] - b[s]) / std::fabs(a[s]));
  return d;
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
// segments). The losses stay within 1e-5 relative. The parameters are compared to 1e-3 of
// their largest magnitude (measured on an H100: 1.4e-4 for GPT-2, 9.4e-5 for Llama): Adam
// divides each gradient by its own running size, so an element whose gradient is at the
// level of rounding takes a step of up to lr (1e-2 here) in a direction the rounding
// decides, on either device; a wrong update (no bias correction, decay on the wrong
// ranges) moves most elements by a sizeable fraction of lr.
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
  EXPECT_LT(rel_diff(all(p.cpu, false), all(p.gpu, false)), 1e-3);
}

// bf16 working parameters and 16-bit operands in the linear layers on both devices: the
// operands are rounded identically, products are exact in fp32, and only the summation
// order differs; but an activation that lands within a rounding of a bf16 tie may round
// the other way on one device (a 2^-8 relative step in one operand), and GPT-2's GELU and
// its derivative are cuBLASLt's epilogues on the GPU (linear_gelu_fused, linear_dgelu_fused;
// within a 16-bit step and fp32 rounding of the CPU's), so the bounds are those of such
// flips: 1e-3 on the loss, 2e-2 of the largest gradient.
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

// The whole command with training.device = cuda against the CPU run (fp32, 8 steps, the
// tiny configuration of the parallel tests, whose eps = 1e-4 keeps Adam from magnifying
// rounding-level gradients): the losses agree to 1e-4 relative and the parameters to 1e-4
// of the largest, for float sums in different orders over 8 updates. Then the GPU's
// checkpoint (written through host copies) resumes on the CPU and continues as the GPU
// run does, and a CPU checkpoint resumes on the GPU.
TEST_P(CudaModel, TrainingOnGpuMatchesCpuAndCheckpointsCrossDevices) {
  test::TempDir d;
  const std::string data = test::write_tokens(d, "t.bin", 3000, 37);
  // A constant rate, so that the 8-step runs' schedule is the 12-step run's first 8 steps.
  const std::string opts = test::options(GetParam(), 8, 4) + " --optim.schedule=constant --data.path=" + data;
  using test::train_run;
  const test::RunResult cpu = train_run(d, "cpu", 1, opts + " --training.steps=8");
  const test::RunResult gpu = train_run(d, "gpu", 1, opts + " --training.steps=8 --training.device=cuda");
  ASSERT_EQ(gpu.loss.size(), 8u) << gpu.output;
  EXPECT_LT(loss_diff(cpu.loss, gpu.loss), 1e-4);
  ASSERT_EQ(cpu.units.size(), gpu.units.size());
  std::vector<float> a, b;
  for (size_t u = 0; u < cpu.units.size(); ++u) {
    a.insert(a.end(), cpu.units[u].begin(), cpu.units[u].end());
    b.insert(b.end(), gpu.units[u].begin(), gpu.units[u].end());
  }
  EXPECT_LT(rel_diff(a, b), 1e-4);

  // 12 steps straight on the GPU; 8 on the GPU then 4 more on the CPU from its checkpoint;
  // 8 on the CPU then 4 more on the GPU.
  const test::RunResult straight = train_run(d, "straight", 1, opts + " --training.steps=12 --training.device=cuda");
  std::filesystem::remove(d / "gpu.jsonl");  // the resumed runs' metrics alone
  std::filesystem::remove(d / "cpu.jsonl");
  const test::RunResult to_cpu = train_run(d, "gpu", 1, opts + " --training.steps=12 --checkpoint.resume=true");
  const test::RunResult to_gpu =
      train_run(d, "cpu", 1, opts + " --training.steps=12 --checkpoint.resume=true --training.device=cuda");
  ASSERT_EQ(to_cpu.loss.size(), 4u) << to_cpu.output;
  ASSERT_EQ(to_gpu.loss.size(), 4u) << to_gpu.output;
  const std::vector<double> tail(straight.loss.begin() + 8, straight.loss.end());
  EXPECT_LT(loss_diff(tail, to_cpu.loss), 1e-4);
  EXPECT_LT(loss_diff(tail, to_gpu.loss), 1e-4);
}

// Two ranks sharing the GPU (DDP, gradients reduced through host memory) against one rank
// on the GPU, both reading the same global batch of 8 (one rank accumulates its four
// micro-batches in turn, two ranks add two each and then each other's sums: the same terms
// in another order). fp32: losses and parameters within 1e-5. bf16: the bounds the CPU's
// layouts meet (tests/test_precision.cpp): a master weight that lands on the other side
// of a bf16 rounding boundary moves its working copy by 2^-8, so 1e-4 in loss and 3e-3 in
// parameters.
TEST_P(CudaModel, TwoRanksSharingTheGpuMatchOneRank) {
  test::TempDir d;
  const std::string data = test::write_tokens(d, "t.bin", 3000, 37);
  const std::string opts = test::options(GetParam(), 8, 2) + " --training.device=cuda --data.path=" + data;
  for (const std::string precision : {"fp32", "bf16"}) {
    const std::string o = opts + " --training.precision=" + precision;
    const test::RunResult one = test::train_run(d, "one_" + precision, 1, o);
    const test::RunResult two = test::train_run(d, "two_" + precision, 2, o + " --parallel.dp=2");
    ASSERT_EQ(two.loss.size(), one.loss.size()) << two.output;
    const bool fp32 = precision == "fp32";
    EXPECT_LT(loss_diff(one.loss, two.loss), fp32 ? 1e-5 : 1e-4) << precision;
    std::vector<float> a, b;
    for (size_t u = 0; u < one.units.size(); ++u) {
      a.insert(a.end(), one.units[u].begin(), one.units[u].end());
      b.insert(b.end(), two.units[u].begin(), two.units[u].end());
    }
    EXPECT_LT(rel_diff(a, b), fp32 ? 1e-5 : 3e-3) << precision;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModel, ::testing::Values("gpt2", "llama"));

#else

TEST(CudaModel, NotBuilt) { GTEST_SKIP() << "built without CUDA"; }

#endif
